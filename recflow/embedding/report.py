"""`recflow plan` and `recflow tables`: what the engine builds, and what a checkpoint holds."""

from __future__ import annotations

import os
import re

from recflow.config.schema import Config
from recflow.embedding.optimizers import make_optimizer
from recflow.embedding.planner import PhysicalTable, plan_tables
from recflow.embedding.rows import KEY_BYTES, RowLayout
from recflow.embedding.table import MAX_LOAD
from recflow.errors import RecflowError

_SHARD_NAME = re.compile(r"^model/embedding/physical_tables/0/rows/shards/(\d+)/")


def layout_of(table: PhysicalTable) -> RowLayout:
    return RowLayout(table.dim, make_optimizer(table.optimizer).num_slots)


def _first_order(config: Config) -> bool:
    from recflow.models.registry import get_model_class

    return get_model_class(config.model.type).first_order


def format_plan(config: Config, keys_per_table: int = 1_000_000, num_shards: int = 1) -> str:
    """The physical tables, the features reading each, placement and memory at `keys_per_table`."""
    plan = plan_tables(config, _first_order(config))
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
        f"(hash buckets add {1 / MAX_LOAD:.2f}x-{2 / MAX_LOAD:.2f}x while tables grow, "
        f"about {1 / MAX_LOAD:.2f}x after an eviction rebuild)",
    ]
    return "\n".join(lines)


def _latest_checkpoint(model_dir: str) -> str:
    import tensorflow as tf

    path = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
    if path is None:
        raise RecflowError(f"{model_dir}: no checkpoint found")
    return path


def restore_engine(model_dir: str, checkpoint: str | None = None):
    """The embedding engine of a model dir, restored from `checkpoint` (a `ckpt-N` prefix;
    default its latest checkpoint), without the model."""
    import tensorflow as tf

    from recflow.config.loader import load_config
    from recflow.embedding.engine import EmbeddingEngine, check_checkpoint
    from recflow.embedding.placement import ModPlacement

    config_path = os.path.join(model_dir, "config.yaml")
    if not os.path.exists(config_path):
        raise RecflowError(f"{model_dir}: not a model dir (no config.yaml)")
    config = load_config(config_path)
    path = checkpoint or _latest_checkpoint(model_dir)
    check_checkpoint(path)
    # As many local shards as the run had (a key's shard does not depend on where shards live).
    names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    shards = {m.group(1) for m in map(_SHARD_NAME.search, names) if m}
    placement = ModPlacement(max(len(shards), 1))
    engine = EmbeddingEngine(config, placement, first_order=_first_order(config))
    holder = tf.Module()
    holder.embedding = engine  # the checkpoint's path to the tables: model/embedding/...
    tf.train.Checkpoint(model=holder).restore(path).expect_partial()
    return engine


def table_stats(model_dir: str) -> dict:
    """Per logical table: keys, waiting keys, bytes and keys per shard, from the latest checkpoint.

    The shards are counted as the run placed them (key -> shard does not depend
    on where the shards live), so a parameter-server run reports its split per PS.
    """
    return restore_engine(model_dir).table_stats()


def table_history(model_dir: str) -> list[tuple[int, dict]]:
    """`(step, table_stats)` of every checkpoint the model dir holds, oldest first."""
    from recflow.training.checkpoints import checkpoint_steps

    checkpoints = os.path.join(model_dir, "checkpoints")
    steps = sorted(checkpoint_steps(checkpoints))
    if not steps:
        raise RecflowError(f"{model_dir}: no checkpoint found")
    return [
        (step, restore_engine(model_dir, os.path.join(checkpoints, f"ckpt-{step}")).table_stats())
        for step in steps
    ]


def format_tables(stats: dict) -> str:
    lines = [f"{'table':<24} {'keys':>10} {'waiting':>10} {'bytes':>12}  shards  (physical table)"]
    for name, s in stats.items():
        shards = ",".join(str(k) for k in s["shards"])
        lines.append(
            f"{name:<24} {s['keys']:>10} {s['waiting_keys']:>10} {s['bytes']:>12}  [{shards}]  "
            f"({s['physical_table']})"
        )
    return "\n".join(lines)
