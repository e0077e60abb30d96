"""No fusion: one physical table per logical table (`embedding.fusion: false`)."""

from __future__ import annotations

from recflow.embedding.planner import LogicalTable, PhysicalTable, Planner


class SeparatePlanner(Planner):
    def plan(self, tables: list[LogicalTable]) -> list[PhysicalTable]:
        return [PhysicalTable(t.name, (t,)) for t in tables]
