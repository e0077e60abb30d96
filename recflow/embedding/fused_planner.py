"""Fusion: logical tables that agree on dim, initializer, optimizer and policies
share one physical table (and so one unique/lookup/insert chain per step)."""

from __future__ import annotations

from recflow.embedding.planner import LogicalTable, PhysicalTable, Planner
from recflow.features.keys import MAX_SLOTS


class FusedPlanner(Planner):
    def plan(self, tables: list[LogicalTable]) -> list[PhysicalTable]:
        groups: dict[tuple, list[LogicalTable]] = {}
        for table in tables:
            groups.setdefault(table.signature, []).append(table)
        physical = []
        for members in groups.values():
            for start in range(0, len(members), MAX_SLOTS):  # the key slot has 8 bits
                chunk = tuple(members[start : start + MAX_SLOTS])
                name = chunk[0].name if len(chunk) == 1 else f"fused_{len(physical)}_d{chunk[0].dim}"
                physical.append(PhysicalTable(name, chunk))
        return physical
