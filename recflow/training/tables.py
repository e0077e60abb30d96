"""What a model dir's checkpoints hold: the embedding engine restored without the
model, its table statistics, and their history over the checkpoints kept
(`recflow tables`)."""

from __future__ import annotations

import os
import re

import tensorflow as tf

from recflow.config.loader import load_config
from recflow.embedding.engine import EmbeddingEngine, check_checkpoint
from recflow.embedding.placement import ModPlacement
from recflow.embedding.planner import LINEAR_SUFFIX
from recflow.errors import RecflowError
from recflow.layout import Layout
from recflow.models.registry import get_model_class
from recflow.training.checkpoints import checkpoint_steps, recorded_structure

_SHARD_NAME = re.compile(r"^model/embedding/physical_tables/0/rows/shards/(\d+)/")


def _latest_checkpoint(model_dir: str) -> str:
    path = tf.train.latest_checkpoint(Layout(model_dir).checkpoint_dir)
    if path is None:
        raise RecflowError(f"{model_dir}: no checkpoint found")
    return path


def _first_order(reader, config) -> bool:
    """Whether the checkpoint's model had first-order weights: its recorded identity lists
    their `.linear` tables (an identity-less checkpoint: ask the model class)."""
    saved = recorded_structure(reader)
    if saved is None:
        return get_model_class(config.model.type).first_order
    return any(name.endswith(LINEAR_SUFFIX) for name in saved["tables"])


def restore_engine(model_dir: str, checkpoint: str | None = None):
    """The embedding engine of a model dir, restored from `checkpoint` (a `ckpt-N` prefix;
    default its latest checkpoint), without the model."""
    config_path = Layout(model_dir).config_path
    if not os.path.exists(config_path):
        raise RecflowError(f"{model_dir}: not a model dir (no config.yaml)")
    config = load_config(config_path, needs_model=False)  # a `module:Class` tower stays unread
    path = checkpoint or _latest_checkpoint(model_dir)
    check_checkpoint(path)
    reader = tf.train.load_checkpoint(path)
    # As many local shards as the run had (a key's shard does not depend on where shards live).
    shards = {m.group(1) for m in map(_SHARD_NAME.search, reader.get_variable_to_shape_map()) if m}
    placement = ModPlacement(max(len(shards), 1))
    engine = EmbeddingEngine(config, placement, first_order=_first_order(reader, config))
    holder = tf.Module()
    holder.embedding = engine  # the checkpoint's path to the tables: model/embedding/...
    engine.restore(tf.train.Checkpoint(model=holder), path).expect_partial()
    return engine


def table_stats(model_dir: str) -> dict:
    """Per logical table: keys, waiting keys, bytes and keys per shard, from the latest checkpoint.

    The shards are counted as the run placed them (key -> shard does not depend
    on where the shards live), so a parameter-server run reports its split per PS.
    """
    return restore_engine(model_dir).table_stats()


def table_history(model_dir: str) -> list[tuple[int, dict]]:
    """`(step, table_stats)` of every checkpoint the model dir holds, oldest first."""
    layout = Layout(model_dir)
    steps = sorted(checkpoint_steps(layout.checkpoint_dir))
    if not steps:
        raise RecflowError(f"{model_dir}: no checkpoint found")
    return [
        (step, restore_engine(model_dir, layout.checkpoint(step)).table_stats())
        for step in steps
    ]
