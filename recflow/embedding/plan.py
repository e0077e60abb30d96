"""The planner a config chooses: `embedding.fusion` on fuses compatible tables
(`FusedPlanner`), off keeps one physical table per logical table
(`SeparatePlanner`)."""

from __future__ import annotations

from recflow.config.schema import Config
from recflow.embedding.fused_planner import FusedPlanner
from recflow.embedding.planner import PhysicalTable, Planner, logical_tables
from recflow.embedding.separate_planner import SeparatePlanner


def make_planner(config: Config) -> Planner:
    return FusedPlanner() if config.embedding.fusion else SeparatePlanner()


def plan_tables(config: Config, first_order: bool = False) -> list[PhysicalTable]:
    """The physical tables of a config under its `embedding.fusion` setting."""
    return make_planner(config).plan(logical_tables(config, first_order))
