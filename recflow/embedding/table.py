"""A hash table split into shards by key, each shard a core `DenseHashTable`.

Only core TF ops: an exported table loads in stock TensorFlow.

Keys are never erased. `DenseHashTable.insert` takes the first empty *or
deleted* bucket of a key's probe chain without looking further for the key, so
an erase followed by a re-insert can leave a key in the table twice (DESIGN.md
section 9). Lifecycle changes (eviction, dropping admission counters) instead
`rebuild` a shard: its bucket arrays are replaced by empty ones of a chosen
size, then the survivors are inserted once. A key is therefore written only by
`insert` into a table that never held a deleted bucket, and is held at most once.
"""

from __future__ import annotations

import tensorflow as tf

from recflow.embedding.placement import Placement
from recflow.features.keys import DELETED_KEY, EMPTY_KEY

MIN_BUCKETS = 1 << 4
INITIAL_BUCKETS = 1 << 12
MAX_LOAD = 0.8  # DenseHashTable doubles its buckets when an insert would pass this load


def buckets_for(keys: int, headroom: int = 0) -> int:
    """The fewest buckets (a power of two) that hold `keys + headroom` keys without growing."""
    buckets = MIN_BUCKETS
    while keys + headroom > MAX_LOAD * buckets:
        buckets *= 2
    return buckets


class ShardedTable(tf.Module):
    """int64 key -> row of `width` values (or one scalar when `width` is None).

    Args:
        name: a name for the shards (`<name>_shard_<i>`).
        width: row width; None stores one scalar per key.
        placement: which shard holds a key and on which device.
        dtype: value dtype.
        initial_buckets: buckets of each shard at creation (a power of two).
    """

    def __init__(
        self,
        name: str,
        width: int | None,
        placement: Placement,
        dtype=tf.float32,
        initial_buckets: int = INITIAL_BUCKETS,
    ):
        super().__init__(name=name.replace(".", "_"))
        if initial_buckets < MIN_BUCKETS or initial_buckets & (initial_buckets - 1):
            raise ValueError(
                f"`initial_buckets` must be a power of two >= {MIN_BUCKETS}. "
                f"Received: initial_buckets={initial_buckets}"
            )
        self.width = width
        self.placement = placement
        self.value_dtype = dtype
        default = tf.zeros([width] if width else [], dtype)
        self.shards = []
        for i in range(placement.num_shards):
            with tf.device(placement.device(i)):
                self.shards.append(
                    tf.lookup.experimental.DenseHashTable(
                        key_dtype=tf.int64,
                        value_dtype=dtype,
                        default_value=default,
                        empty_key=EMPTY_KEY,
                        deleted_key=DELETED_KEY,
                        initial_num_buckets=initial_buckets,
                        name=f"{name.replace('.', '_')}_shard_{i}",
                    )
                )

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def _shape(self, values: tf.Tensor) -> tf.Tensor:
        # Lookups return an unknown static shape: pin it right away.
        return tf.reshape(values, [-1, self.width] if self.width else [-1])

    def _partition(self, keys: tf.Tensor):
        shard = self.placement.shard_of(keys)
        positions = tf.dynamic_partition(tf.range(tf.size(keys)), shard, self.num_shards)
        return tf.dynamic_partition(keys, shard, self.num_shards), positions, shard

    def lookup(self, keys: tf.Tensor) -> tf.Tensor:
        """Rows of `keys` (the default, all zeros, for missing keys)."""
        if self.num_shards == 1:
            return self._shape(self.shards[0].lookup(keys))
        parts, positions, _ = self._partition(keys)
        found = []
        for i, table in enumerate(self.shards):
            with tf.device(self.placement.device(i)):
                found.append(self._shape(table.lookup(parts[i])))
        return tf.dynamic_stitch(positions, found)

    def lookup_shard(self, i: int, keys: tf.Tensor) -> tf.Tensor:
        """Rows of `keys` in shard `i` alone (keys that belong to it), on its device."""
        with tf.device(self.placement.device(i)):
            return self._shape(self.shards[i].lookup(keys))

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> list:
        """Writes rows (distinct keys); returns the insert ops (one per shard)."""
        if self.num_shards == 1:
            return [self.shards[0].insert(keys, values)]
        key_parts, _, shard = self._partition(keys)
        value_parts = tf.dynamic_partition(values, shard, self.num_shards)
        ops = []
        for i, table in enumerate(self.shards):
            with tf.device(self.placement.device(i)):
                ops.append(table.insert(key_parts[i], value_parts[i]))
        return ops

    def export_shard(self, i: int) -> tuple[tf.Tensor, tf.Tensor]:
        """(keys, values) held by shard `i`, empty buckets dropped; runs on the shard's device."""
        with tf.device(self.placement.device(i)):
            keys, values = self.shards[i].export()
            keys = tf.reshape(keys, [-1])
            live = keys >= 0
            return tf.boolean_mask(keys, live), tf.boolean_mask(self._shape(values), live)

    def export(self) -> tuple[tf.Tensor, tf.Tensor]:
        """All (keys, values), every shard."""
        parts = [self.export_shard(i) for i in range(self.num_shards)]
        return tf.concat([k for k, _ in parts], 0), tf.concat([v for _, v in parts], 0)

    def rebuild_shard(self, i: int, keys: tf.Tensor, values: tf.Tensor, buckets: int) -> None:
        """Replaces shard `i`'s contents with (keys, values): empty buckets, then one insert.

        `keys` must be distinct and belong to shard `i`; `buckets` is a power of
        two (see `buckets_for`).
        """
        shape = [buckets, self.width] if self.width else [buckets]
        with tf.device(self.placement.device(i)):
            table = self.shards[i]
            tf.raw_ops.LookupTableImportV2(
                table_handle=table.resource_handle,
                keys=tf.fill([buckets, 1], tf.constant(EMPTY_KEY, tf.int64)),
                values=tf.zeros(shape, self.value_dtype),
            )
            table.insert(keys, values)

    def num_buckets(self, i: int) -> int:
        """Buckets of shard `i` (eager)."""
        with tf.device(self.placement.device(i)):
            return int(tf.shape(self.shards[i].export()[0])[0])

    def shard_sizes(self) -> list[int]:
        """Keys held by each shard (eager)."""
        return [int(table.size()) for table in self.shards]

    def size(self) -> tf.Tensor:
        return tf.add_n([table.size() for table in self.shards])
