"""A hash table split into shards by key, each shard a core `DenseHashTable`.

Only core TF ops: an exported table loads in stock TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf

from recflow.embedding.placement import Placement
from recflow.features.keys import DELETED_KEY, EMPTY_KEY

INITIAL_BUCKETS = 1 << 12


class ShardedTable(tf.Module):
    """int64 key -> float32 row of `width` (or a scalar when `width` is None).

    Args:
        name: a name for the shards (`<name>/shard_<i>`).
        width: row width; None stores one scalar per key.
        dtype: value dtype.
        placement: which shard holds a key and on which device.
    """

    def __init__(self, name: str, width: int | None, placement: Placement, dtype=tf.float32):
        super().__init__(name=name.replace(".", "_"))
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
                        initial_num_buckets=INITIAL_BUCKETS,
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

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> list:
        """Writes rows; returns the insert ops (one per shard)."""
        if self.num_shards == 1:
            return [self.shards[0].insert(keys, values)]
        key_parts, _, shard = self._partition(keys)
        value_parts = tf.dynamic_partition(values, shard, self.num_shards)
        ops = []
        for i, table in enumerate(self.shards):
            with tf.device(self.placement.device(i)):
                ops.append(table.insert(key_parts[i], value_parts[i]))
        return ops

    def erase(self, keys: tf.Tensor) -> list:
        if self.num_shards == 1:
            return [self.shards[0].erase(keys)]
        key_parts, _, _ = self._partition(keys)
        ops = []
        for i, table in enumerate(self.shards):
            with tf.device(self.placement.device(i)):
                ops.append(table.erase(key_parts[i]))
        return ops

    def export_shard(self, i: int) -> tuple[tf.Tensor, tf.Tensor]:
        """(keys, values) held by shard `i`, empty and deleted buckets dropped."""
        with tf.device(self.placement.device(i)):
            keys, values = self.shards[i].export()
        keys = tf.reshape(keys, [-1])
        live = keys >= 0
        return tf.boolean_mask(keys, live), tf.boolean_mask(self._shape(values), live)

    def export(self) -> tuple[tf.Tensor, tf.Tensor]:
        """All (keys, values), every shard."""
        parts = [self.export_shard(i) for i in range(self.num_shards)]
        return tf.concat([k for k, _ in parts], 0), tf.concat([v for _, v in parts], 0)

    def size(self) -> tf.Tensor:
        return tf.add_n([table.size() for table in self.shards])
