"""A hash table split into shards by key, each shard a few core `DenseHashTable` segments.

Only core TF ops: an exported table loads in stock TensorFlow.

**Never erase.** `DenseHashTable.insert` takes the first empty *or deleted*
bucket of a key's probe chain without looking further for the key, so an erase
followed by a re-insert can leave a key in the table twice (DESIGN.md section
9). Lifecycle changes (eviction, dropping admission counters) instead `rebuild`
a shard: its bucket arrays are replaced by empty ones of a chosen size, then the
survivors are inserted once. A key is written only by `insert` into tables that
never hold a deleted bucket, so it is held at most once.

**Segments.** A `DenseHashTable` has a power-of-two bucket count and doubles past
a load of 0.8, so one table per shard would hold 1.25x-2.5x the buckets its keys
need. Each shard is instead split into `SEGMENTS` tables by the key's route
(bits 47..62 of its mixed id, uniform), each segment taking a share of the
routes proportional to its buckets. A rebuild picks segment sizes whose sum is
within 1/32 of what the survivors and one step's keys need, so right after a
rebuild a shard holds at most ~1.3x the buckets of its keys (plus that headroom);
growth between rebuilds doubles one segment at a time.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from recflow.embedding.placement import Placement, variables_on
from recflow.features.keys import DELETED_KEY, EMPTY_KEY, KEY_WIDTH, mixed

SEGMENTS = 6
MIN_BUCKETS = 1 << 4
INITIAL_BUCKETS = 1 << 12  # per shard, all segments together
MAX_LOAD = 0.8  # DenseHashTable doubles its buckets when an insert would pass this load
MIN_LOAD = 0.5  # a shard whose load fell below this is resized at the next rebuild
ROUTE_SHIFT, ROUTES = 47, 1 << 16  # a key's route: bits 47..62 of its mixed id, in [0, ROUTES)


def segment_buckets(keys: int, headroom: int = 0, segments: int = SEGMENTS) -> list[int]:
    """Bucket counts of the segments in use (powers of two, largest first) for `keys + headroom`.

    Their sum is the least number >= (keys + headroom + slack) / MAX_LOAD with at
    most `segments` bits set, so at most 1/2**(segments - 1) above what the keys
    need. The slack, 4 standard deviations of a segment's share of the keys,
    keeps a segment from growing because its share came out a little large.
    """
    slack = 4 * np.sqrt(keys)
    need = max(int(np.ceil((keys + headroom + slack) / MAX_LOAD)), MIN_BUCKETS)
    unit = MIN_BUCKETS
    while bin(-(-need // unit) * unit).count("1") > segments:
        unit *= 2
    total = -(-need // unit) * unit
    return [1 << b for b in range(total.bit_length() - 1, -1, -1) if total >> b & 1]


def empty_buckets(table, buckets: int, width: int, dtype=tf.float32) -> None:
    """Replaces a `DenseHashTable`'s bucket arrays by `buckets` empty ones, on its device.

    This empties a table without erase (DESIGN.md section 9). The bucket arrays are
    `[buckets, 2]` keys and `[buckets, width]` values (`[buckets]` for width 0). The
    op's shape function wants rank-1 keys, which holds for what it can see only: the
    shapes are passed in as tensors, so on a remote (PS) device the arrays reach the
    kernel with an unknown rank, as they do when a checkpoint is restored.
    """
    values_shape = [buckets, width] if width else [buckets]
    spec = tf.TensorSpec([None], tf.int64)

    @tf.function(input_signature=[spec, spec], autograph=False)
    def empty(keys_shape, values_shape):
        tf.raw_ops.LookupTableImportV2(
            table_handle=table.resource_handle,
            keys=tf.fill(keys_shape, tf.constant(EMPTY_KEY[0], tf.int64)),
            values=tf.zeros(values_shape, dtype),
        )

    empty(tf.constant([buckets, KEY_WIDTH], tf.int64), tf.constant(values_shape, tf.int64))


def segment_layout(used: list[int], segments: int = SEGMENTS) -> tuple[list[int], np.ndarray]:
    """(buckets of every segment, upper route bound of each) for segments of sizes `used`.

    A segment takes a share of the routes proportional to its buckets; the
    segments past `used` get `MIN_BUCKETS` and no route.
    """
    sizes = list(used) + [MIN_BUCKETS] * (segments - len(used))
    weights = np.array(list(used) + [0] * (segments - len(used)), np.float64)
    bounds = np.floor(np.cumsum(weights) / weights.sum() * ROUTES).astype(np.int64)
    bounds[len(used) - 1 :] = ROUTES
    return sizes, bounds


class ShardedTable(tf.Module):
    """Table key (`recflow.features.keys`, [2] int64) -> row of `width` values (or one
    scalar when `width` is None).

    Args:
        name: a name for the shards (`<name>_shard_<i>_<segment>`).
        width: row width; None stores one scalar per key.
        placement: which shard holds a key and on which device.
        dtype: value dtype.
        expected_keys: keys each shard is sized for at creation (None: `INITIAL_BUCKETS`
            buckets per shard).
        headroom: room each shard keeps for one step's new keys.
        segments: `DenseHashTable`s per shard.
    """

    def __init__(
        self,
        name: str,
        width: int | None,
        placement: Placement,
        dtype=tf.float32,
        expected_keys: int | None = None,
        headroom: int = 0,
        segments: int = SEGMENTS,
    ):
        super().__init__(name=name.replace(".", "_"))
        self.width = width
        self.placement = placement
        self.value_dtype = dtype
        self.segments = segments
        default = tf.zeros([width] if width else [], dtype)
        if expected_keys:
            used = segment_buckets(expected_keys, headroom, segments)
        else:
            even = 1 << (segments.bit_length() - 1)  # a power of two of equal segments
            used = [INITIAL_BUCKETS // even] * even
        sizes, routes = segment_layout(used, segments)
        base = name.replace(".", "_")
        self.shards = []
        self.routes = []  # per shard: upper route bound of each segment [segments] int64
        for i in range(placement.num_shards):
            with tf.device(placement.device(i)):
                self.shards.append(
                    [
                        tf.lookup.experimental.DenseHashTable(
                            key_dtype=tf.int64,
                            value_dtype=dtype,
                            default_value=default,
                            empty_key=EMPTY_KEY,
                            deleted_key=DELETED_KEY,
                            initial_num_buckets=size,
                            name=f"{base}_shard_{i}_{j}",
                        )
                        for j, size in enumerate(sizes)
                    ]
                )
            with variables_on(placement.device(i)):
                self.routes.append(tf.Variable(routes, trainable=False, name=f"{base}_routes_{i}"))

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def _shape(self, values: tf.Tensor) -> tf.Tensor:
        # Lookups return an unknown static shape: pin it right away.
        return tf.reshape(values, [-1, self.width] if self.width else [-1])

    @staticmethod
    def _split(keys: tf.Tensor, part: tf.Tensor, n: int):
        """(keys [U, 2] of each part, their positions in `keys`). The keys are gathered by
        position: `tf.dynamic_partition` of a [U, 2] matrix is 3-4x slower here (and a
        bit-cast to one 128-bit scalar per key trips a graph rewrite that folds bit-casts)."""
        positions = tf.dynamic_partition(tf.range(tf.shape(keys)[0]), part, n)
        return [tf.gather(keys, p) for p in positions], positions

    def _segment_of(self, i: int, keys: tf.Tensor) -> tf.Tensor:
        route = tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(mixed(keys), tf.constant(ROUTE_SHIFT, tf.int64)), ROUTES - 1
        )
        return tf.cast(tf.searchsorted(self.routes[i], route, side="right"), tf.int32)

    # ------------------------------------------------------------------ one shard (its device)

    def lookup_shard(self, i: int, keys: tf.Tensor) -> tf.Tensor:
        """Rows of `keys` held by shard `i` (all zeros for missing keys), on its device."""
        with tf.device(self.placement.device(i)):
            segment = self._segment_of(i, keys)
            parts, positions = self._split(keys, segment, self.segments)
            found = [self._shape(t.lookup(k)) for t, k in zip(self.shards[i], parts)]
            return tf.dynamic_stitch(positions, found)

    def insert_shard(self, i: int, keys: tf.Tensor, values: tf.Tensor) -> list:
        with tf.device(self.placement.device(i)):
            segment = self._segment_of(i, keys)
            key_parts, _ = self._split(keys, segment, self.segments)
            value_parts = tf.dynamic_partition(values, segment, self.segments)
            return [t.insert(k, v) for t, k, v in zip(self.shards[i], key_parts, value_parts)]

    def export_shard(self, i: int) -> tuple[tf.Tensor, tf.Tensor]:
        """(keys, values) held by shard `i`, empty buckets dropped; runs on the shard's device."""
        keys, values, _ = self.export_shard_with_buckets(i)
        return keys, values

    def export_shard_with_buckets(self, i: int) -> tuple[tf.Tensor, tf.Tensor, int]:
        """`export_shard` and the shard's bucket count (every segment's)."""
        with tf.device(self.placement.device(i)):
            keys, values, buckets = [], [], 0
            for table in self.shards[i]:
                k, v = table.export()  # every bucket, empty ones included
                k = tf.reshape(k, [-1, KEY_WIDTH])
                buckets += int(tf.shape(k)[0])
                live = k[:, 0] >= 0  # slots are >= 0: not an empty or deleted bucket
                keys.append(tf.boolean_mask(k, live))
                values.append(tf.boolean_mask(self._shape(v), live))
            return tf.concat(keys, 0), tf.concat(values, 0), buckets

    def rebuild_shard(self, i: int, keys: tf.Tensor, values: tf.Tensor, headroom: int = 0) -> None:
        """Replaces shard `i`'s contents with (keys, values), sized to them (eager).

        Every segment gets empty bucket arrays of its new size, then the keys are
        inserted once. `keys` must be distinct and belong to shard `i`;
        `headroom` is room kept for one step's new keys.
        """
        self.reset_shard(i, int(tf.shape(keys)[0]), headroom)
        self.insert_shard(i, keys, values)

    def reset_shard(self, i: int, keys: int, headroom: int = 0) -> None:
        """Empties shard `i`, its segments sized for `keys` keys and `headroom` more (eager)."""
        sizes, routes = segment_layout(segment_buckets(keys, headroom, self.segments), self.segments)
        with tf.device(self.placement.device(i)):
            for table, size in zip(self.shards[i], sizes):
                empty_buckets(table, size, self.width, self.value_dtype)
            self.routes[i].assign(routes)

    def num_buckets(self, i: int) -> int:
        """Buckets of shard `i`, all segments (eager; reads the bucket arrays)."""
        return self.export_shard_with_buckets(i)[2]

    # ------------------------------------------------------------------ every shard

    def partition(self, keys: tf.Tensor) -> tuple[list, list]:
        """(positions, keys) per shard: the shard's keys and where they sit in `keys`.

        With one shard, positions is [None] (every key, in order).
        """
        if self.num_shards == 1:
            return [None], [keys]
        parts, positions = self._split(keys, self.placement.shard_of(keys), self.num_shards)
        return positions, parts

    @staticmethod
    def stitch(positions: list, parts: list) -> tf.Tensor:
        """The inverse of `partition` for per-shard values."""
        return parts[0] if positions[0] is None else tf.dynamic_stitch(positions, parts)

    def lookup(self, keys: tf.Tensor) -> tf.Tensor:
        """Rows of `keys` (the default, all zeros, for missing keys)."""
        if self.num_shards == 1:
            return self.lookup_shard(0, keys)
        parts, positions = self._split(keys, self.placement.shard_of(keys), self.num_shards)
        found = [self.lookup_shard(i, parts[i]) for i in range(self.num_shards)]
        return tf.dynamic_stitch(positions, found)

    def insert(self, keys: tf.Tensor, values: tf.Tensor) -> list:
        """Writes rows (distinct keys); returns the insert ops."""
        if self.num_shards == 1:
            return self.insert_shard(0, keys, values)
        shard = self.placement.shard_of(keys)
        key_parts, _ = self._split(keys, shard, self.num_shards)
        value_parts = tf.dynamic_partition(values, shard, self.num_shards)
        ops = []
        for i in range(self.num_shards):
            ops += self.insert_shard(i, key_parts[i], value_parts[i])
        return ops

    def export(self) -> tuple[tf.Tensor, tf.Tensor]:
        """All (keys, values), every shard."""
        parts = [self.export_shard(i) for i in range(self.num_shards)]
        return tf.concat([k for k, _ in parts], 0), tf.concat([v for _, v in parts], 0)

    def size(self) -> tf.Tensor:
        return tf.add_n([t.size() for shard in self.shards for t in shard])
