"""`recflow plan` and `recflow tables` as text: what the engine builds, and what its tables hold
(`recflow.training.tables` reads them from a model dir)."""

from __future__ import annotations

from recflow.config.schema import Config
from recflow.embedding.optimizers import make_optimizer
from recflow.embedding.plan import plan_tables
from recflow.embedding.planner import PhysicalTable
from recflow.embedding.rows import KEY_BYTES, RowLayout
from recflow.embedding.table import GROWTH_RATIO, MAX_LOAD, SMALL_GROWTH_RATIO, SMALL_SHARD_BYTES


def layout_of(table: PhysicalTable) -> RowLayout:
    return RowLayout(table.dim, make_optimizer(table.optimizer).num_slots)


def format_plan(
    config: Config, first_order: bool, keys_per_table: int = 1_000_000, num_shards: int = 1
) -> str:
    """The physical tables, the features reading each, placement and memory at `keys_per_table`.

    `first_order`: the model reads dim-1 companions of its tables (`RecModel.first_order`).
    """
    plan = plan_tables(config, first_order)
    lines = [
        f"fusion: {'on' if config.embedding.fusion else 'off'}   physical tables: {len(plan)}   "
        f"logical tables: {sum(len(t.logical) for t in plan)}   shards per table: {num_shards}",
        "",
        f"{'physical table':<22} {'dim':>4} {'row floats':>10} {'optimizer':>9}  logical tables (features)",
    ]
    total = 0
    for table in plan:
        layout = layout_of(table)
        readers = []
        for slot, logical in enumerate(table.logical):
            base = logical.name.split(".")[0]
            names = [f.name for f in config.sparse_features if f.table_name == base]
            readers.append(f"{slot}:{logical.name} ({', '.join(names)})")
        total += keys_per_table * len(table.logical) * (KEY_BYTES + 4 * layout.width)
        lines.append(
            f"{table.name:<22} {table.dim:>4} {layout.width:>10} {table.optimizer.type:>9}  "
            + "; ".join(readers)
        )
    lines += [
        "",
        f"placement: shard = (mixed id >> 32) mod {num_shards}; shard i on PS task i "
        f"(~{keys_per_table // num_shards:,} keys of each logical table per shard)",
        f"memory at {keys_per_table:,} keys per logical table: {total / 2**20:,.1f} MiB of rows "
        f"(hash buckets add {1 / MAX_LOAD:.2f}x-{GROWTH_RATIO:.2f}x, up to {SMALL_GROWTH_RATIO:.0f}x "
        f"in a shard under {SMALL_SHARD_BYTES >> 20} MiB, and room for one step's keys)",
    ]
    return "\n".join(lines)


def format_tables(stats: dict) -> str:
    lines = [f"{'table':<24} {'keys':>10} {'waiting':>10} {'bytes':>12}  shards  (physical table)"]
    for name, s in stats.items():
        shards = ",".join(str(k) for k in s["shards"])
        lines.append(
            f"{name:<24} {s['keys']:>10} {s['waiting_keys']:>10} {s['bytes']:>12}  [{shards}]  "
            f"({s['physical_table']})"
        )
    return "\n".join(lines)
