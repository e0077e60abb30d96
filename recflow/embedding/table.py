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
within 1/16 of what the survivors and one step's keys need, none more than half
of the sum, so right after a rebuild a shard holds at most ~1.35x the buckets of
its keys (plus that headroom); growth between rebuilds doubles one segment at a time.

**Streaming rebuild.** A segment's export is its bucket arrays themselves, not a
copy. A rebuild copies out one old segment's survivors at a time, already split by
their new segment, and empties that segment before the next; then it sizes and
fills the new segments one at a time, freeing their survivors as it goes. At most
about one segment's survivors are alive beyond the table itself.
"""

from __future__ import annotations

import functools

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
    most `segments - 1` bits set (one segment: one bit), so at most 1/2**(segments - 2)
    above what the keys need. With more than one segment the top power of two is
    split into two halves: no segment holds more than half the buckets, which bounds
    what a streaming rebuild holds beside the table. The slack, 4 standard deviations
    of a segment's share of the keys, keeps a segment from growing because its share
    came out a little large.
    """
    slack = 4 * np.sqrt(keys)
    need = max(int(np.ceil((keys + headroom + slack) / MAX_LOAD)), MIN_BUCKETS)
    bits = max(segments - 1, 1)
    unit = MIN_BUCKETS
    while bin(-(-need // unit) * unit).count("1") > bits:
        unit *= 2
    total = -(-need // unit) * unit
    sizes = [1 << b for b in range(total.bit_length() - 1, -1, -1) if total >> b & 1]
    if segments > 1 and sizes[0] >= 2 * MIN_BUCKETS:
        sizes = [sizes[0] // 2] * 2 + sizes[1:]
    return sizes


def empty_buckets(table, buckets: int, width: int, dtype=tf.float32) -> None:
    """Replaces a `DenseHashTable`'s bucket arrays by `buckets` empty ones, on its device.

    This empties a table without erase (DESIGN.md section 9). The bucket arrays are
    `[buckets, 2]` keys and `[buckets, width]` values (`[buckets]` for width 0). The
    op's shape function wants rank-1 keys, which holds for what it can see only: the
    shapes are passed in as tensors, so on a remote (PS) device the arrays reach the
    kernel with an unknown rank, as they do when a checkpoint is restored. One traced
    function per value dtype serves every table.
    """
    values_shape = [buckets, width] if width else [buckets]
    _emptier(tf.as_dtype(dtype))(
        table.resource_handle,
        tf.constant([buckets, KEY_WIDTH], tf.int64),
        tf.constant(values_shape, tf.int64),
    )


@functools.cache
def _emptier(dtype: tf.DType):
    spec = tf.TensorSpec([None], tf.int64)

    @tf.function(input_signature=[tf.TensorSpec([], tf.resource), spec, spec], autograph=False)
    def empty(handle, keys_shape, values_shape):
        tf.raw_ops.LookupTableImportV2(
            table_handle=handle,
            keys=tf.fill(keys_shape, tf.constant(EMPTY_KEY[0], tf.int64)),
            values=tf.zeros(values_shape, dtype),
        )

    return empty


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


def _grown(buckets: int, keys: int) -> int:
    """The buckets an empty `DenseHashTable` of `buckets` has after one insert of `keys`
    keys: its kernel doubles them while keys > buckets * MAX_LOAD (in float32). A segment
    whose share of a rebuild's survivors came out large is emptied at that size, so its
    inserts, one per old segment, never regrow it and place every key where one insert of
    them all would."""
    load = np.float32(MAX_LOAD)
    while np.float32(keys) > np.float32(buckets) * load:
        buckets *= 2
    return buckets


def _segment_by(routes: tf.Tensor, keys: tf.Tensor) -> tf.Tensor:
    """The segment of each key [n, 2] under `routes` (upper route bound of each segment)."""
    route = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(mixed(keys), tf.constant(ROUTE_SHIFT, tf.int64)), ROUTES - 1
    )
    return tf.cast(tf.searchsorted(routes, route, side="right"), tf.int32)


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
        return _segment_by(self.routes[i], keys)

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
        parts = [self.segment_rows(i, j) for j in range(self.segments)]
        with tf.device(self.placement.device(i)):
            return tf.concat([k for k, _ in parts], 0), tf.concat([v for _, v in parts], 0)

    def _buckets(self, i: int, j: int) -> tuple[tf.Tensor, tf.Tensor]:
        """Segment `j` of shard `i`'s bucket arrays, empty buckets included: the arrays
        themselves, not a copy (valid until the segment is next written)."""
        keys, values = self.shards[i][j].export()
        return tf.reshape(keys, [-1, KEY_WIDTH]), self._shape(values)

    def _held(self, i: int, j: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(key buckets, value buckets, indices of the buckets that hold a key) of a segment."""
        keys, values = self._buckets(i, j)
        return keys, values, tf.where(keys[:, 0] >= 0)[:, 0]  # slots are >= 0: not empty/deleted

    def segment_rows(
        self, i: int, j: int, pick: tf.Tensor | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """(keys, values) segment `j` of shard `i` holds, in bucket order; with `pick` (bool
        over them), only those. Copies these rows only; runs on the shard's device."""
        with tf.device(self.placement.device(i)):
            keys, values, held = self._held(i, j)
            if pick is not None:
                held = tf.boolean_mask(held, pick)
            return tf.gather(keys, held), tf.gather(values, held)

    def segment_keys(self, i: int, j: int) -> tf.Tensor:
        """The keys segment `j` of shard `i` holds, in bucket order (not their values)."""
        with tf.device(self.placement.device(i)):
            keys, _, held = self._held(i, j)
            return tf.gather(keys, held)

    def segment_columns(self, i: int, j: int, start: int, stop: int) -> tf.Tensor:
        """Columns `start:stop` of the rows segment `j` of shard `i` holds, in bucket order."""
        with tf.device(self.placement.device(i)):
            _, values, held = self._held(i, j)
            return tf.gather(values[:, start:stop], held)

    def rebuild_shard(
        self, i: int, keep: list[tf.Tensor], headroom: int = 0, dropped: list | None = None
    ) -> None:
        """Keeps the rows of shard `i` where `keep` is true, in segments sized for them (eager).

        `keep[j]` is a bool per row segment `j` holds, in `segment_rows` order;
        `headroom` is room kept for one step's new keys; the keys of the rows not
        kept are appended to `dropped` when given. Streams (module docstring): each
        old segment's kept rows are copied out, split by their new segment, and the
        old segment is emptied before the next; then each new segment, largest first,
        is emptied at its new size and filled. A new segment receives its keys in
        the order the old segments held them, as one insert of them all would.
        """
        with tf.device(self.placement.device(i)):
            survivors = sum(int(tf.math.count_nonzero(k)) for k in keep)
            sizes, routes = segment_layout(
                segment_buckets(survivors, headroom, self.segments), self.segments
            )
            new_routes = tf.constant(routes)
            pieces = [[] for _ in sizes]  # per new segment: (keys, values), old segment order
            for j, table in enumerate(self.shards[i]):
                keys, values, held = self._held(i, j)
                if dropped is not None:
                    dropped.append(tf.gather(keys, tf.boolean_mask(held, ~keep[j])))
                held = tf.boolean_mask(held, keep[j])
                target = _segment_by(new_routes, tf.gather(keys, held))
                for m, part in enumerate(tf.dynamic_partition(held, target, self.segments)):
                    if int(tf.size(part)):
                        pieces[m].append((tf.gather(keys, part), tf.gather(values, part)))
                del keys, values, held, target, part  # the old arrays' last references
                empty_buckets(table, MIN_BUCKETS, self.width, self.value_dtype)
            self.routes[i].assign(routes)
            for m, table in enumerate(self.shards[i]):
                arrived = sum(int(tf.shape(keys)[0]) for keys, _ in pieces[m])
                empty_buckets(table, _grown(sizes[m], arrived), self.width, self.value_dtype)
                for keys, values in pieces[m]:
                    table.insert(keys, values)
                pieces[m] = None

    def reset_shard(self, i: int, keys: int, headroom: int = 0) -> None:
        """Empties shard `i`, its segments sized for `keys` keys and `headroom` more (eager)."""
        sizes, routes = segment_layout(segment_buckets(keys, headroom, self.segments), self.segments)
        with tf.device(self.placement.device(i)):
            for table, size in zip(self.shards[i], sizes):
                empty_buckets(table, size, self.width, self.value_dtype)
            self.routes[i].assign(routes)

    def num_buckets(self, i: int) -> int:
        """Buckets of shard `i`, all segments (eager; copies nothing)."""
        with tf.device(self.placement.device(i)):
            return sum(int(tf.shape(self._buckets(i, j)[0])[0]) for j in range(self.segments))

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
