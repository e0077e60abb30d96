"""A hash table split into shards by key, each shard a few core `DenseHashTable` segments.

Only core TF ops: an exported table loads in stock TensorFlow.

**Never erase.** `DenseHashTable.insert` takes the first empty *or deleted*
bucket of a key's probe chain without looking further for the key, so an erase
followed by a re-insert can leave a key in the table twice (DESIGN.md section
9). Lifecycle changes (eviction, dropping admission counters) instead `rebuild`
a shard: its bucket arrays are replaced by empty ones of a chosen size, then the
survivors are inserted once. A key is written only by `insert` into tables that
never hold a deleted bucket, so it is held at most once.

**Segments.** A `DenseHashTable` has a power-of-two bucket count and doubles when
an insert would pass its `max_load_factor`, so one table per shard would hold
1.1x-2.2x the buckets its keys need. Each shard is instead split into `SEGMENTS`
tables by the key's route (bits 47..62 of its mixed id, uniform), each segment
taking a share of the routes proportional to its buckets (less 4 standard deviations
of its keys, so small segments fill no sooner than large ones). A layout picks segment
sizes whose sum has at most `SEGMENTS - 1` bits set (within 1/16 of any target),
none more than half of the sum.

**Growth** (`ShardedTable.grow`). Segments of one layout all reach the same load
together, so left to the kernel they would all double at about the same time and
a shard's buckets/keys would swing between 1.1x and 2.2x (mean ~1.6x). Instead,
after every step (every PS wave) a cheap check (`Watches`: one call for every table of
an engine) reads each segment's size and the largest insert the shard took since the
last check; a shard where that insert could make some segment double is laid out
again, keeping every row
(`grow_buckets`: at most `GROWTH_RATIO` times the buckets its keys and a step's
inserts fill, so about 10%-17% of room for new keys), by the streaming rebuild.
Its buckets/keys thus stays between ~1/MAX_LOAD (1.11x) and `GROWTH_RATIO`
(1.3x) plus one step's inserts, at the cost of moving each key ~6-9 more times as
the table grows (each re-layout moves the shard's keys once). A small shard, one
that a growth layout of `SMALL_GROWTH_RATIO` (2x) keeps under `SMALL_SHARD_BYTES`
(64 MiB), grows 2x instead: there a layout's cost is mostly its fixed cost (about
35 ms locally for the two tables of the bench's DeepFM, from 18,000 keys to 60,000),
and a table that fills in its first epoch was laid out 9 times there at 1.3x. The kernel's own
doubling remains the safety valve when a step inserts more than the last ones
did; the next check then lays an over-provisioned shard out again.

Why not the alternatives: a higher `max_load_factor` alone keeps the 2x swing;
segments of staggered loads only spread the doublings out in time (the mean
stays ~1.6x); growing one segment at a time needs moving route ranges, i.e.
rebuilding the segments that give them up. Training segments use
`max_load_factor` `MAX_LOAD` = 0.9 (a standard attr of `MutableDenseHashTableV2`:
checkpoints are unchanged; it lengthens probe chains: measured here on 2M buckets,
CPU per lookup of a held key ~10% and of a missing key ~30%-65% above load 0.55 at
loads 0.8-0.9), which gives growth room without passing ~1.3x. A table's kernel
counts every key of an insert as new (updates too), so a shard always keeps room for
one step's inserts: a small table that a step's keys cover is held at ~1.1x-1.3x
(keys + a step's keys).

Cost, measured (docs/performance.md, "Growing tables"): in a job whose every step
brings 204,800 new keys until 20M, 22 layouts move each key ~6 times (the rule
replayed in numpy; it gives the measured 1.21x); the whole job took 40% more CPU
(76 -> 107 s; 10% at 2M keys) for 28% fewer bytes per key. Under parameter servers
the check runs after each wave of chunks, so within a long wave a segment may still
double; the check after it lays the shard out again.

**Streaming rebuild.** A segment's export is its bucket arrays themselves, not a
copy. A rebuild copies out one old segment's survivors at a time, already split by
their new segment, and empties that segment before the next; then it sizes and
fills the new segments one at a time, freeing their survivors as it goes. At most
about one segment's survivors are alive beyond the table itself.

**Where maintenance runs.** A rebuild (`census`, then `relayout`), a growth layout and
a count are functions of a shard's handles (`on_shard`). On a parameter server each
is traced once per table, for all its shards, and runs as one call on the shard's PS
task, its order kept by control dependencies: run eagerly, each of its hundreds of ops
was a round trip from the chief (a 40-step job on 2 PS with admission and a ttl,
checkpointing every 8 steps, took 79 s to train, now 28 s; 4.5 s without them). A
local shard runs them eagerly, where tracing would cost more than it saves.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Callable, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

from recflow.embedding.placement import Placement, variables_on
from recflow.embedding.rows import KEY_BYTES
from recflow.features.keys import DELETED_KEY, EMPTY_KEY, KEY_WIDTH, mixed

SEGMENTS = 6
MIN_BUCKETS = 1 << 4
INITIAL_BUCKETS = 1 << 12  # per shard, all segments together
MAX_LOAD = 0.9  # a segment's `max_load_factor`: it doubles when an insert would pass this load
STOCK_LOAD = 0.8  # the `max_load_factor` of a `DenseHashTable` made by its own class (serving)
MIN_LOAD = 0.5  # a shard whose load fell below this is resized at the next rebuild
GROWTH_RATIO = 1.3  # a growth layout holds at most this many buckets per key (and step key)
SMALL_GROWTH_RATIO = 2.0  # ... or this many, while that keeps the shard under SMALL_SHARD_BYTES
SMALL_SHARD_BYTES = 64 << 20
ROUTE_SHIFT, ROUTES = 47, 1 << 16  # a key's route: bits 47..62 of its mixed id, in [0, ROUTES)


# Which rows of a shard a rebuild keeps: given the handles of the same shard of the tables it
# reads (`also`), each segment's (key buckets, value buckets, indices of the buckets held)
# and the step (int64), a bool per held bucket of each segment. Runs eager or traced.
Keep = Callable[[tuple, list, tf.Tensor], list]


class ShardHandles(NamedTuple):
    """One shard's resources as tensors, what its maintenance functions take (`on_shard`):
    each segment's table handle and the routes variable's handle."""

    tables: tuple
    routes: tf.Tensor


class Census(NamedTuple):
    """What `ShardedTable.census` finds on a shard (numpy)."""

    held: np.ndarray  # rows per segment [segments] int64
    kept: np.ndarray  # rows per segment the rebuild would keep [segments] int64
    sizes: list[int]  # buckets per segment
    routes: np.ndarray  # upper route bound of each segment [segments] int64


def segment_buckets(
    keys: int, headroom: int = 0, segments: int = SEGMENTS, load: float = MAX_LOAD
) -> list[int]:
    """Bucket counts of the segments in use (powers of two, largest first) for `keys + headroom`.

    Their sum is the least number >= (keys + headroom + slack) / load with at most
    `segments - 1` bits set (one segment: one bit), so at most 1/2**(segments - 2)
    above what the keys need. The slack, 4 standard deviations of each segment's
    share of the keys, keeps a segment from growing because its share came out a
    little large. `load`: the tables' `max_load_factor`.
    """
    need = max(int(np.ceil((keys + headroom + _slack(keys, segments)) / load)), MIN_BUCKETS)
    bits = max(segments - 1, 1)
    unit = MIN_BUCKETS
    while bin(-(-need // unit) * unit).count("1") > bits:
        unit *= 2
    return _split_total(-(-need // unit) * unit, segments)


def grow_buckets(keys: int, step: int, bucket_bytes: int, segments: int = SEGMENTS) -> list[int]:
    """Segment bucket counts a growth layout gives a shard of `keys` keys whose steps insert
    up to `step` keys: the largest sum <= `GROWTH_RATIO` x (keys + step) with at most
    `segments - 1` bits set, but never less than `segment_buckets` with room for 1/16
    more keys (so a layout is not redone a few steps later). `SMALL_GROWTH_RATIO` instead
    while that many buckets of `bucket_bytes` (key and value) stay under `SMALL_SHARD_BYTES`."""
    least = segment_buckets(keys, step + keys // 16, segments)
    ratio = growth_ratio(keys + step, bucket_bytes)
    total = int(ratio * (keys + step))
    top = max(total.bit_length() - max(segments - 1, 1), MIN_BUCKETS.bit_length() - 1)
    total = total >> top << top  # its `segments - 1` highest bits
    return least if total <= sum(least) else _split_total(total, segments)


def growth_ratio(keys: int, bucket_bytes: int) -> float:
    """Buckets per key a growth layout may give `keys` keys (and a step's) whose buckets
    take `bucket_bytes` each: `SMALL_GROWTH_RATIO` while that stays under
    `SMALL_SHARD_BYTES`, else `GROWTH_RATIO`."""
    small = SMALL_GROWTH_RATIO * keys * bucket_bytes <= SMALL_SHARD_BYTES
    return SMALL_GROWTH_RATIO if small else GROWTH_RATIO


def _slack(keys: int, segments: int) -> float:
    """Room for 4 standard deviations of every segment's share of `keys` (`segment_layout`):
    their sum is at most 4 sqrt(segments x keys)."""
    return 4 * np.sqrt(segments * keys)


def _split_total(total: int, segments: int) -> list[int]:
    """The powers of two of `total`'s bits, largest first; with more than one segment the
    top one split into two halves, so no segment holds more than half the buckets (which
    bounds what a streaming rebuild holds beside the table)."""
    sizes = [1 << b for b in range(total.bit_length() - 1, -1, -1) if total >> b & 1]
    if segments > 1 and sizes[0] >= 2 * MIN_BUCKETS:
        sizes = [sizes[0] // 2] * 2 + sizes[1:]
    return sizes


def traced(fn: Callable) -> Callable:
    """`tf.function(fn)` without AutoGraph for a table's upkeep (a census, a relayout, a
    count, the growth check's reads), its traces counted for it alone, called without
    TensorFlow's graph optimizer (grappler).

    tf.function counts traces per code object, over every instance of a method: each
    table tracing its own function once would read as frequent retracing and warn. A
    partial hides the code, so each table's function is counted apart.

    Upkeep moves and counts rows, runs once per checkpoint or growth check, and is
    instantiated once per shard: grappler's passes cost that first call more than they
    can save. A 2-PS, 2-worker launch of 80 steps with a rebuild at each of its 5
    checkpoints took 21.1-21.7 s against 23.5-24.1 s (2 pairs, 2.4 CPU s less)."""
    function = tf.function(functools.partial(fn), autograph=False)

    def call(*args):
        with _without_grappler():
            return function(*args)

    return call


@contextlib.contextmanager
def _without_grappler():
    """Function calls of this thread, inside the block, skip grappler: the call's
    config (the `config_proto` attribute of its call op, which the device that runs
    it instantiates the function with) turns the meta-optimizer off. TF has no public
    per-call switch; `context.function_call_options` is the thread's call config that
    tf.function reads (TF 2.17, pinned)."""
    eager = context.context()
    before = eager.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(before.config_proto_serialized)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    options = copy.copy(before)
    options.config_proto_serialized = config
    eager.function_call_options = options
    try:
        yield
    finally:
        eager.function_call_options = before


def masked(x: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """The entries of `x` (along its first axis) where `mask` [n] bool is true, in order:
    `tf.boolean_mask` as one op (which runs about 30x faster eagerly: 28 against 793 us)."""
    return tf.dynamic_partition(x, tf.cast(mask, tf.int32), 2)[1]


def id_counts(ids: tf.Tensor, n: int) -> tf.Tensor:
    """How many of `ids` [m] (int32 or int64) equal each of 0 .. n - 1: [n] int64; negative
    ones (empty and deleted buckets' slots) count for none. One op: `tf.math.bincount`
    runs about 20x slower eagerly (770 against 36 us), a Python wrapper around several."""
    return tf.math.unsorted_segment_sum(tf.ones_like(ids, tf.int64), ids, n)


def _pinned(values: tf.Tensor, width: int) -> tf.Tensor:
    """Values of a lookup or an export, shaped [n, width] ([n] when width is 0). Traced ones
    come with an unknown static shape: pin it right away (eager ones know theirs, and an
    eager reshape costs more than the export)."""
    shape = [-1, width] if width else [-1]
    if values.shape.rank == len(shape) and values.shape[1:] == shape[1:]:
        return values
    return tf.reshape(values, shape)


def _bucket_arrays(table: tf.Tensor, dtype, width: int) -> tuple[tf.Tensor, tf.Tensor]:
    """A segment's bucket arrays (`table`: its handle), empty buckets included: the
    arrays themselves, not a copy (valid until the segment is next written)."""
    keys, values = tf.raw_ops.LookupTableExportV2(table_handle=table, Tkeys=tf.int64, Tvalues=dtype)
    keys = keys if keys.shape[1:] == [KEY_WIDTH] else tf.reshape(keys, [-1, KEY_WIDTH])
    return keys, _pinned(values, width)


def _held_buckets(table: tf.Tensor, dtype, width: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(key buckets, value buckets, indices of the buckets that hold a key) of a segment."""
    keys, values = _bucket_arrays(table, dtype, width)
    slots = tf.gather(keys, 0, axis=1)  # >= 0: not empty/deleted (a gather: eager slices are slow)
    return keys, values, tf.squeeze(tf.where(slots >= 0), 1)  # eager: 21 us, a reshape 61


@functools.cache
def _exporter(dtype: tf.DType, width: int, segments: int):
    """The concrete function `(segment handles...) -> (keys, values)` of what a shard's
    segments hold, in segment and bucket order, empty buckets dropped. One call instead
    of seven ops a segment: eagerly, each op a dispatch; on a parameter server, each a
    round trip. It depends on the row format only, so tables of one format share it; its
    ops carry no device and run where it is called."""
    handle = tf.TensorSpec([], tf.resource)

    @tf.function(input_signature=[handle] * segments, autograph=False)
    def export(*tables):
        keys, values = [], []
        for table in tables:
            k, v, held = _held_buckets(table, dtype, width)
            keys.append(tf.gather(k, held))
            values.append(tf.gather(v, held))
        return tf.concat(keys, 0), tf.concat(values, 0)

    return export.get_concrete_function()


def empty_buckets(table: tf.Tensor, buckets, width: int, dtype=tf.float32) -> tf.Tensor:
    """Replaces a `DenseHashTable`'s bucket arrays (`table`: its handle) by `buckets` empty
    ones, on its device; returns a tensor ready once they are (eager or traced).

    This empties a table without erase (DESIGN.md section 9). The bucket arrays are
    `[buckets, 2]` keys and `[buckets, width]` values (`[buckets]` for width 0). The
    op's shape function wants rank-1 keys, which holds for what it can see only: the
    shapes are passed in as tensors, so on a remote (PS) device the arrays reach the
    kernel with an unknown rank, as they do when a checkpoint is restored. One traced
    function per value dtype serves every table.
    """
    if isinstance(buckets, (int, np.integer)):  # known: no ops build the shapes
        keys_shape = np.array([buckets, KEY_WIDTH], np.int64)
        values_shape = np.array([buckets, width] if width else [buckets], np.int64)
    else:
        buckets = tf.cast(buckets, tf.int64)
        keys_shape = tf.stack([buckets, KEY_WIDTH])
        values_shape = tf.stack([buckets, width]) if width else tf.reshape(buckets, [1])
        values_shape = tf.cast(values_shape, tf.int64)
    return _emptier(tf.as_dtype(dtype))(table, keys_shape, values_shape)


@functools.cache
def _emptier(dtype: tf.DType):
    """The concrete function (a call skips the polymorphic dispatch: 306 -> 183 us eager)."""
    spec = tf.TensorSpec([None], tf.int64)

    @tf.function(input_signature=[tf.TensorSpec([], tf.resource), spec, spec], autograph=False)
    def empty(handle, keys_shape, values_shape):
        # Traced inside another function, the shapes' lengths are known: hide them.
        keys_shape, values_shape = (
            tf.raw_ops.PlaceholderWithDefault(input=s, shape=[None]) for s in (keys_shape, values_shape)
        )
        tf.raw_ops.LookupTableImportV2(
            table_handle=handle,
            keys=tf.fill(keys_shape, tf.constant(EMPTY_KEY[0], tf.int64)),
            values=tf.zeros(values_shape, dtype),
        )
        return tf.constant(True)  # the call's output: ready once the import has run

    return empty.get_concrete_function()


def segment_layout(used: list[int], segments: int = SEGMENTS) -> tuple[list[int], np.ndarray]:
    """(buckets of every segment, upper route bound of each) for segments of sizes `used`.

    A segment takes a share of the routes proportional to what it holds at load
    `MAX_LOAD` less 4 standard deviations of that (its keys are a random share), so
    a small segment fills no sooner than a large one; the segments past `used` get
    `MIN_BUCKETS` and no route.
    """
    sizes = list(used) + [MIN_BUCKETS] * (segments - len(used))
    full = MAX_LOAD * np.array(used, np.float64)
    room = np.maximum(full - 4 * np.sqrt(full), full / 4)
    weights = np.concatenate([room, np.zeros(segments - len(used))])
    bounds = np.floor(np.cumsum(weights) / weights.sum() * ROUTES).astype(np.int64)
    bounds[len(used) - 1 :] = ROUTES
    return sizes, bounds


def _grown(buckets: tf.Tensor, keys: tf.Tensor) -> tf.Tensor:
    """The buckets empty `DenseHashTable`s of `buckets` have after one insert of `keys`
    keys each (int64 vectors): the kernel doubles them while keys > buckets * MAX_LOAD
    (in float32). A segment whose share of a rebuild's survivors came out large is
    emptied at that size, so its inserts, one per old segment, never regrow it and
    place every key where one insert of them all would."""
    load, keys = tf.constant(MAX_LOAD, tf.float32), tf.cast(keys, tf.float32)

    def small(b):
        return keys > tf.cast(b, tf.float32) * load

    return tf.while_loop(
        lambda b: tf.reduce_any(small(b)), lambda b: (tf.where(small(b), b * 2, b),), (buckets,)
    )[0]


def _find(table: tf.Tensor, default: tf.Tensor, keys: tf.Tensor) -> tf.Tensor:
    """`DenseHashTable.lookup` through the table's handle."""
    return tf.raw_ops.LookupTableFindV2(table_handle=table, keys=keys, default_value=default)


def _segment_by(routes: tf.Tensor, keys: tf.Tensor) -> tf.Tensor:
    """The segment of each key [n, 2] under `routes` (upper route bound of each segment):
    how many bounds are <= its route (`searchsorted` right, without its reshapes)."""
    route = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(mixed(keys), tf.constant(ROUTE_SHIFT, tf.int64)), ROUTES - 1
    )
    return tf.squeeze(  # eagerly 21 us; an index [0] is a strided slice of ~100
        tf.raw_ops.UpperBound(
            sorted_inputs=tf.expand_dims(routes, 0), values=tf.expand_dims(route, 0), out_type=tf.int32
        ),
        0,
    )


class Segment(tf.lookup.experimental.DenseHashTable):
    """A `DenseHashTable` whose kernel doubles its buckets past `MAX_LOAD`, not 0.8.

    The only change is the `max_load_factor` attr of the `MutableDenseHashTableV2` op
    the class creates (its own constructor always leaves the default): a standard
    attr, so a SavedModel of such a table loads in stock TensorFlow. `load` is the
    attr (the serving tables keep `STOCK_LOAD`).
    """

    def __init__(self, *args, load: float = MAX_LOAD, **kwargs):
        self._max_load = load
        super().__init__(*args, **kwargs)

    def _create_resource(self):
        table = tf.raw_ops.MutableDenseHashTableV2(
            empty_key=tf.convert_to_tensor(self._empty_key, self._key_dtype),
            deleted_key=tf.convert_to_tensor(self._deleted_key, self._key_dtype),
            value_dtype=self._value_dtype,
            shared_name=self._shared_name or "",
            use_node_name_sharing=self._checkpoint and self._shared_name is None,
            value_shape=self._value_shape,
            initial_num_buckets=self._initial_num_buckets,
            max_load_factor=self._max_load,
            name=self._name,
        )
        self._table_name = None if tf.executing_eagerly() else table.op.name.split("/")[-1]
        return table


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
        # A bucket's bytes: its key and its value.
        self.bucket_bytes = KEY_BYTES + (width or 1) * tf.as_dtype(dtype).size
        self._default = default = tf.zeros([width] if width else [], dtype)
        if expected_keys:
            used = segment_buckets(expected_keys, headroom, segments)
        else:
            even = 1 << (segments.bit_length() - 1)  # a power of two of equal segments
            used = [INITIAL_BUCKETS // even] * even
        sizes, routes = segment_layout(used, segments)
        # A new shard's layout: neither growth nor a rebuild lays one out smaller.
        self._initial, self._initial_used = sum(sizes), used
        base = name.replace(".", "_")
        self.shards = []
        self.routes = []  # per shard: upper route bound of each segment [segments] int64
        for i in range(placement.num_shards):
            with tf.device(placement.device(i)):
                self.shards.append(
                    [
                        Segment(
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
        # Plain objects: their variables and functions stay out of `variables` and checkpoints.
        self._watch = _Watch(self, base)
        self._functions = _Functions()

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def _shape(self, values: tf.Tensor) -> tf.Tensor:
        return _pinned(values, self.width)

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
            return self._lookup(self.routes[i], [t.lookup for t in self.shards[i]], keys)

    def find(self, shard: ShardHandles, keys: tf.Tensor) -> tf.Tensor:
        """`lookup_shard` through a shard's handles (inside `on_shard`)."""
        routes = tf.raw_ops.ReadVariableOp(resource=shard.routes, dtype=tf.int64)
        finds = [functools.partial(_find, h, self._default) for h in shard.tables]
        return self._lookup(routes, finds, keys)

    def _lookup(self, routes: tf.Tensor, finds: list, keys: tf.Tensor) -> tf.Tensor:
        parts, positions = self._split(keys, _segment_by(routes, keys), self.segments)
        return tf.dynamic_stitch(positions, [self._shape(f(k)) for f, k in zip(finds, parts)])

    def insert_shard(self, i: int, keys: tf.Tensor, values: tf.Tensor) -> list:
        with tf.device(self.placement.device(i)):
            self._watch.saw(i, tf.shape(keys, tf.int64)[0])
            segment = self._segment_of(i, keys)
            key_parts, _ = self._split(keys, segment, self.segments)
            value_parts = tf.dynamic_partition(values, segment, self.segments)
            return [t.insert(k, v) for t, k, v in zip(self.shards[i], key_parts, value_parts)]

    def export_shard(self, i: int) -> tuple[tf.Tensor, tf.Tensor]:
        """(keys, values) held by shard `i`, segment by segment in bucket order, empty
        buckets dropped: one call of a traced function on the shard's device (`_exporter`)."""
        export = _exporter(tf.as_dtype(self.value_dtype), self.width, self.segments)
        with tf.device(self.placement.device(i)):
            return export(*(t.resource_handle for t in self.shards[i]))

    def _buckets(self, table: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return _bucket_arrays(table, self.value_dtype, self.width)

    def _held(self, table: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        return _held_buckets(table, self.value_dtype, self.width)

    def bucket_slots(self, table: tf.Tensor) -> tf.Tensor:
        """The slot of each bucket of a segment (`table`: its handle) [buckets] int64:
        its key's logical table, negative for an empty or deleted bucket."""
        return tf.gather(self._buckets(table)[0], 0, axis=1)

    def held_keys(self, table: tf.Tensor) -> tf.Tensor:
        """The keys a segment (`table`: its handle) holds, in bucket order."""
        keys, _, held = self._held(table)
        return tf.gather(keys, held)

    def handles(self, i: int) -> ShardHandles:
        return ShardHandles(tuple(t.resource_handle for t in self.shards[i]), self.routes[i].handle)

    def census(self, i: int, keep: Keep | None = None, step: int = 0, also: tuple = ()) -> Census:
        """What a rebuild of shard `i` at `step` would find: rows held and kept per segment,
        the segments' buckets and routes (one call on the shard's device). `also`: the
        tables whose shard `i` `keep` reads (their handles are its first argument)."""
        run = self.on_shard(("census", keep), i, functools.partial(self._census, keep), also)
        held, kept, sizes, routes = (t.numpy() for t in run(tf.constant(step, tf.int64)))
        return Census(held, kept, sizes.tolist(), routes)

    def _census(self, keep: Keep | None, shard: ShardHandles, others: tuple, step: tf.Tensor):
        segments = [self._held(h) for h in shard.tables]
        held = tf.stack([tf.size(h, tf.int64) for _, _, h in segments])
        masks = keep(others, segments, step) if keep is not None else None
        kept = held if masks is None else tf.stack(
            [tf.math.count_nonzero(m, dtype=tf.int64) for m in masks]
        )
        sizes = tf.stack([tf.shape(k, tf.int64)[0] for k, _, _ in segments])
        return held, kept, sizes, tf.raw_ops.ReadVariableOp(resource=shard.routes, dtype=tf.int64)

    def rebuild_shard(
        self, i: int, keep: Keep | None, headroom: int = 0, step: int = 0, also: tuple = ()
    ) -> tf.Tensor | None:
        """Keeps the rows of shard `i` that `keep` picks at `step`, in segments sized for
        them; returns the keys of the rows dropped (None when the shard was left as it is).

        A shard is never laid out smaller than a new one (as growth does not: a small
        table would otherwise shrink at each checkpoint and grow again in the steps
        after). A shard that keeps every row and is loaded at least `MIN_LOAD` or already
        laid out as its survivors would be is left as it is (a rebuild at each checkpoint
        rewrites only the shards that change). Two calls on the shard's device: `census`, then
        `relayout` when needed.
        """
        census = self.census(i, keep, step, also)
        survivors = int(census.kept.sum())
        used = segment_buckets(survivors, headroom, self.segments)
        if sum(used) < sum(self._initial_used):
            used = self._initial_used
        if survivors == int(census.held.sum()):
            if survivors >= MIN_LOAD * sum(census.sizes):
                return None
            sizes, routes = segment_layout(used, self.segments)
            if census.sizes == sizes and np.array_equal(census.routes, routes):
                return None
        return self.relayout(i, used, keep, step, also)

    def relayout(
        self, i: int, used: list[int], keep: Keep | None = None, step: int = 0, also: tuple = ()
    ) -> tf.Tensor:
        """Lays shard `i` out in segments of `used` buckets, keeping the rows `keep` picks
        at `step` (None: every row); returns the keys of the others (one call on the
        shard's device).

        Streams (module docstring): each old segment's kept rows are copied out, split
        by their new segment, and the old segment is emptied before the next is read;
        then each new segment, largest first, is emptied at its new size and filled. A
        new segment receives its keys in the order the old segments held them, as one
        insert of them all would.
        """
        sizes, routes = segment_layout(used, self.segments)
        run = self.on_shard(("relayout", keep), i, functools.partial(self._relayout, keep), also)
        return run(
            tf.constant(sizes, tf.int64), tf.constant(routes, tf.int64), tf.constant(step, tf.int64)
        )

    def _relayout(self, keep: Keep | None, shard: ShardHandles, others: tuple, sizes, routes, step):
        masks = [None] * self.segments
        if keep is not None:  # the held indices of every segment live only while it decides
            masks = keep(others, [self._held(h) for h in shard.tables], step)
        pieces = [[] for _ in range(self.segments)]  # per new segment, old segment order
        dropped = [tf.zeros([0, KEY_WIDTH], tf.int64)]
        arrived = []  # per old segment: its kept rows per new segment [segments]
        after = []  # the previous old segment emptied: read the next one only then
        for mask, table in zip(masks, shard.tables):
            with tf.control_dependencies(after):
                keys, values, held = self._held(table)
                if mask is not None:  # one op splits the held buckets, order kept
                    gone, held = tf.dynamic_partition(held, tf.cast(mask, tf.int32), 2)
                    dropped.append(tf.gather(keys, gone))
                # Split the kept buckets' indices, then copy each piece's rows once.
                target = _segment_by(routes, tf.gather(keys, held))
                arrived.append(id_counts(target, self.segments))
                moved = [
                    (tf.gather(keys, part), tf.gather(values, part))
                    for part in tf.dynamic_partition(held, target, self.segments)
                ]
                for m, pair in enumerate(moved):
                    pieces[m].append(pair)
            with tf.control_dependencies([t for pair in moved for t in pair] + dropped[-1:]):
                after = [empty_buckets(table, MIN_BUCKETS, self.width, self.value_dtype)]
            del keys, values, held, moved
        with tf.control_dependencies(after):
            after = [tf.raw_ops.AssignVariableOp(resource=shard.routes, value=routes)]
        grown = tf.unstack(_grown(sizes, tf.add_n(arrived)))
        for m, table in enumerate(shard.tables):
            with tf.control_dependencies(after):
                after = [empty_buckets(table, grown[m], self.width, self.value_dtype)]
            for keys, values in pieces[m]:
                with tf.control_dependencies(after):
                    after = [
                        tf.raw_ops.LookupTableInsertV2(table_handle=table, keys=keys, values=values)
                    ]
            pieces[m] = None
        with tf.control_dependencies(after):
            return tf.concat(dropped, 0)

    def on_shard(self, kind, i: int, body: Callable, also: tuple = ()) -> Callable:
        """`body(handles of shard i, (handles of shard i of each table in also), *args)`,
        run on shard `i`'s device: traced once per `kind` for every shard where the shard
        is remote, so its ops reach the PS task as one call, not a round trip each (its
        unplaced ops run where it is called); eager where the shard is local, where
        tracing costs more than it saves. A traced body takes tensors of fixed shapes."""
        handles = (self.handles(i), tuple(t.handles(i) for t in also))
        device = self.placement.device(i)
        if device is None:
            return functools.partial(body, *handles)
        if kind not in self._functions.traced:
            self._functions.traced[kind] = traced(body)
        function = self._functions.traced[kind]

        def run(*args):
            with tf.device(device):
                return function(*handles, *args)

        return run

    def grow(self, watched: list) -> int:
        """Lays out again each shard that the next step's inserts could make double a
        segment, or that holds more buckets than a growth layout would (a segment
        doubled anyway); returns the keys moved (module docstring, "Growth").
        `watched`: this table's part of `Watches.read`.

        A step's inserts are bounded by the largest insert the shard took since the
        last call or the one before (so a short last batch of an epoch does not shrink
        a shard the next full batch would grow again); a shard that took none is left
        alone. Call it between steps only: a step running meanwhile could write a key
        into the segment it left.
        """
        moved = 0
        for i, (largest, held, buckets, shares) in enumerate(watched):
            if largest == 0:
                continue
            step = max(largest, self._watch.previous[i])
            self._watch.previous[i] = largest
            keys = int(held.sum())
            # What one insert of `step` keys may bring each segment: its share and 4 sigma.
            inserts = shares * step + 4 * np.sqrt(shares * step)
            full = np.any(held + inserts > MAX_LOAD * buckets)
            used = grow_buckets(keys, step, self.bucket_bytes, self.segments)
            laid_out = sum(segment_layout(used, self.segments)[0])  # the segments out of use too
            if full or buckets.sum() > max(laid_out, self._initial):
                self.relayout(i, used)
                moved += keys
        return moved

    def reset_shard(self, i: int, keys: int, headroom: int = 0) -> None:
        """Empties shard `i`, its segments sized for `keys` keys and `headroom` more (eager)."""
        sizes, routes = segment_layout(
            segment_buckets(keys, headroom, self.segments), self.segments
        )
        with tf.device(self.placement.device(i)):
            for table, size in zip(self.shards[i], sizes):
                empty_buckets(table.resource_handle, size, self.width, self.value_dtype)
            self.routes[i].assign(routes)

    def segment_sizes(self, i: int) -> list[int]:
        """Buckets of each segment of shard `i` (eager; copies nothing)."""
        with tf.device(self.placement.device(i)):
            return [int(tf.shape(self._buckets(t.resource_handle)[0])[0]) for t in self.shards[i]]

    def num_buckets(self, i: int) -> int:
        """Buckets of shard `i`, all segments (eager; copies nothing)."""
        return sum(self.segment_sizes(i))

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


class _Functions:
    """A table's traced maintenance functions, by kind, one for all its shards
    (`ShardedTable.on_shard`)."""

    def __init__(self):
        self.traced: dict = {}


class _Watch:
    """Per shard of a `ShardedTable`, on its device: the largest insert it took since the
    last read (`Watches.read`).

    Not checkpointed: after a restore the first step's inserts are not foreseen (a
    segment may double once; the next `ShardedTable.grow` lays the shard out again).
    """

    def __init__(self, table: ShardedTable, base: str):
        self.table = table
        self.largest = []
        for i in range(table.num_shards):
            with variables_on(table.placement.device(i)):
                self.largest.append(
                    tf.Variable(
                        tf.constant(0, tf.int64), trainable=False, name=f"{base}_largest_{i}"
                    )
                )
        self.previous = [0] * table.num_shards  # per shard: the largest insert `grow` read last

    def saw(self, i: int, n: tf.Tensor) -> None:
        """Records an insert of `n` keys into shard `i` (in the step; on its device)."""
        self.largest[i].assign(tf.maximum(self.largest[i], n))

    def stats(self) -> list:
        """Per shard, as tensors on its device: (largest insert since the last read, keys of
        each segment, buckets of each segment, each segment's upper route); resets the
        largest insert."""
        table, out = self.table, []
        for i in range(table.num_shards):
            with tf.device(table.placement.device(i)):
                step = self.largest[i].read_value()
                with tf.control_dependencies([step]):
                    self.largest[i].assign(tf.zeros_like(step))
                held = tf.stack([t.size() for t in table.shards[i]])
                buckets = tf.stack([tf.shape(t.export()[0], tf.int64)[0] for t in table.shards[i]])
                out.append((step, held, buckets, table.routes[i].read_value()))
        return out


class Watches:
    """The growth check's reads of several tables (an engine's) in one traced call: one
    trace for them all, and under parameter servers one call per wave, not one per table."""

    def __init__(self, tables: list[ShardedTable]):
        self._read = traced(lambda: [table._watch.stats() for table in tables])

    def read(self) -> list[list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]]:
        """Per table, per shard: (largest insert since the last read, keys of each segment,
        buckets of each segment, each segment's share of the routes); resets the largest
        inserts."""
        out = []
        for shards in self._read():
            out.append([])
            for step, held, buckets, routes in shards:
                bounds = np.concatenate([[0], routes.numpy()])
                out[-1].append((int(step), held.numpy(), buckets.numpy(), np.diff(bounds) / ROUTES))
        return out
