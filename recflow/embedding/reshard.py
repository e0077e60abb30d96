"""Restoring tables saved with another number of shards (parameter servers).

A key's shard is `(mixed >> 32) mod #shards` (`ModPlacement`), so the shards of a
checkpoint written with P shards do not fit a run with Q != P: a restore shard for
shard would look most keys up on the wrong shard and never find them. `reshard`
moves every saved key to its owner under the run's placement instead, the rows of
each table (embedding, optimizer slots, sighting count and last step, packed) and
the admission counters of the keys still waiting, values unchanged.

It streams: each saved shard is read from the checkpoint one segment at a time
(`tf.train.load_checkpoint`: one tensor at a time), its live keys are split by
their new shard and inserted there (on its PS task), and the next segment is
read. A first pass reads the keys only and counts each new shard's keys, so every
new shard is emptied once and sized for them (as an eviction rebuild sizes it):
it never grows while rows arrive. No process holds more than one saved segment
beside the shards it owns; no key is erased or written twice (each lived in one
saved shard), so every key is held once.
"""

from __future__ import annotations

import collections
import logging
import re

import numpy as np
import tensorflow as tf

from recflow.embedding.table import ShardedTable

logger = logging.getLogger(__name__)

ROOT = "model/embedding"  # the engine's path in a trainer's checkpoint
_TABLE_KEYS = re.compile(
    r"^(?P<root>.+)/physical_tables/(?P<table>\d+)/(?P<part>rows|counters)/shards/"
    r"(?P<shard>\d+)/(?P<segment>\d+)/\.ATTRIBUTES/table-keys$"
)


def _segments(reader, root: str) -> dict:
    """{(physical table, part): {saved shard: [segment path prefix, ...]}} of a checkpoint."""
    found: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for name in reader.get_variable_to_shape_map():
        m = _TABLE_KEYS.match(name)
        if m and m["root"] == root:
            shard = found[int(m["table"]), m["part"]][int(m["shard"])]
            shard.append(name[: -len("table-keys")])
    return found


def saved_shards(path: str, root: str = ROOT) -> int:
    """The number of shards the tables of checkpoint `path` were saved in (0: no table)."""
    shards = {len(s) for s in _segments(tf.train.load_checkpoint(path), root).values()}
    if len(shards) > 1:
        raise ValueError(f"{path}: its tables are saved in different shard counts {sorted(shards)}")
    return shards.pop() if shards else 0


def _live_keys(reader, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(keys [n, 2], bucket index of each) of a saved segment, empty and deleted buckets dropped."""
    keys = reader.get_tensor(prefix + "table-keys").reshape(-1, 2)
    live = np.flatnonzero(keys[:, 0] >= 0)  # slots are >= 0: not an empty or deleted bucket
    return keys[live], live


def _move(table: ShardedTable, reader, shards: dict, headroom: int) -> int:
    """Refills every shard of `table` with the saved shards' keys, each at its new owner;
    returns the keys moved."""
    placement = table.placement
    counts = np.zeros(table.num_shards, np.int64)
    for prefixes in shards.values():  # pass 1: keys only, to size the new shards
        for prefix in prefixes:
            keys, _ = _live_keys(reader, prefix)
            owner = placement.shard_of(tf.constant(keys)).numpy()
            counts += np.bincount(owner, minlength=table.num_shards)
    for i, n in enumerate(counts):
        table.reset_shard(i, int(n), headroom)
    for saved in sorted(shards):  # pass 2: one saved segment at a time
        for prefix in shards[saved]:
            keys, live = _live_keys(reader, prefix)
            if not keys.size:
                continue
            values = reader.get_tensor(prefix + "table-values")[live]
            owner = placement.shard_of(tf.constant(keys)).numpy()
            for i in np.unique(owner):
                pick = owner == i
                table.insert_shard(int(i), tf.constant(keys[pick]), tf.constant(values[pick]))
    return int(counts.sum())


def reshard(engine, path: str, root: str = ROOT) -> dict[str, int]:
    """Refills every table of `engine` from checkpoint `path`, saved with another number
    of shards, each key at its owner under `engine.placement` (eager; on a PS cluster,
    from the chief: each part is inserted on its shard's PS task).

    Whatever a restore shard for shard put into the tables is replaced. Returns the
    keys moved per physical table: its rows, and `<name>/counters` its admission counters.
    """
    reader = tf.train.load_checkpoint(path)
    saved = _segments(reader, root)
    moved = {}
    for index, table in enumerate(engine.physical_tables):
        name = table.spec.name
        moved[name] = _move(table.rows, reader, saved.get((index, "rows"), {}), table.step_keys)
        if table.counters is not None:
            counters = saved.get((index, "counters"), {})
            moved[name + "/counters"] = _move(table.counters, reader, counters, table.step_keys)
    logger.info("resharded %s to %d shards: %s", path, engine.placement.num_shards, moved)
    return moved
