"""The fusion planner interface: logical tables -> physical tables.

A logical table is what a config names (`tables.item`, or a feature's own
table). A physical table is what holds rows: several compatible logical tables
may share one, each under its own key slot (see `recflow.features.keys`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from recflow.config.schema import (
    AdmissionConfig,
    Config,
    EvictionConfig,
    InitializerConfig,
    OptimizerConfig,
)

LINEAR_SUFFIX = ".linear"  # first-order (dim 1) companion of a logical table


@dataclass(frozen=True)
class LogicalTable:
    name: str
    dim: int
    initializer: InitializerConfig
    optimizer: OptimizerConfig
    admission: AdmissionConfig | None = None
    eviction: EvictionConfig | None = None
    expected_keys: int | None = None  # a sizing hint; fused tables add theirs up

    @property
    def signature(self) -> tuple:
        """What must agree for two logical tables to share a physical one."""
        return (self.dim, self.initializer, self.optimizer, self.admission, self.eviction)


@dataclass(frozen=True)
class PhysicalTable:
    name: str
    logical: tuple[LogicalTable, ...]  # slot i holds logical[i]

    @property
    def dim(self) -> int:
        return self.logical[0].dim

    @property
    def initializer(self) -> InitializerConfig:
        return self.logical[0].initializer

    @property
    def optimizer(self) -> OptimizerConfig:
        return self.logical[0].optimizer

    @property
    def admission(self) -> AdmissionConfig | None:
        return self.logical[0].admission

    @property
    def eviction(self) -> EvictionConfig | None:
        return self.logical[0].eviction

    def slot(self, logical_name: str) -> int:
        for i, table in enumerate(self.logical):
            if table.name == logical_name:
                return i
        raise KeyError(logical_name)


class Planner(abc.ABC):
    """Groups logical tables into physical tables."""

    @abc.abstractmethod
    def plan(self, tables: list[LogicalTable]) -> list[PhysicalTable]:
        """Returns physical tables covering every logical table exactly once."""


def logical_tables(config: Config, first_order: bool = False) -> list[LogicalTable]:
    """The logical tables of a config, with dim-1 companions for first-order terms."""
    tables = []
    for name in config.table_names():
        t = config.table(name)
        optimizer = config.sparse_optimizer(name)
        policies = (t.admission, t.eviction, t.expected_keys)
        tables.append(LogicalTable(name, t.dim, t.initializer, optimizer, *policies))
        if first_order:
            zeros = InitializerConfig(type="zeros")
            tables.append(LogicalTable(name + LINEAR_SUFFIX, 1, zeros, optimizer, *policies))
    return tables
