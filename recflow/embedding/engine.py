"""The dynamic embedding engine: fused lookups, packed rows, sparse updates.

A training step, per physical table (the logical tables fused into it):

    ids of every feature -> concat -> (slot, mixed id) -> unique -> partition by shard
      -> one lookup per shard -> stitch -> [U, width] packed rows
    (tape) gather per feature -> pool / pad -> tower -> loss -> d loss / d emb [U, dim]
    sparse optimizer on [emb | slots] -> pack with (count, last_step) -> one insert per shard

Keys not yet admitted read the default (zero) row and only bump a counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import tensorflow as tf

from recflow.config.schema import Config, Feature
from recflow.embedding import wire
from recflow.embedding.optimizers import SparseOptimizer, make_optimizer
from recflow.embedding.placement import ModPlacement, Placement
from recflow.embedding.plan import plan_tables
from recflow.embedding.planner import LINEAR_SUFFIX, PhysicalTable
from recflow.embedding.rows import RowLayout
from recflow.embedding.staging import Staging
from recflow.embedding.table import ShardedTable, ShardHandles, Watches, id_counts, masked
from recflow.errors import RecflowError
from recflow.features.keys import (
    KEY_FORMAT,
    KEY_WIDTH,
    decode,
    encode,
    raw_keys,
    unique,
    unique_ids,
)

LINEAR_OUTPUT = "/linear"  # tower input `<feature>/linear`: first-order weight [B, 1]
MASK_OUTPUT = "/mask"  # tower input `<sequence>/mask`: [B, max_len] bool
COUNTER_WIDTH = 2  # an admission counter: [sightings, last step seen] int32
_KEY_FORMAT_NAME = "/embedding/key_format/.ATTRIBUTES/VARIABLE_VALUE"


class _Use(NamedTuple):
    """One feature reading one logical table of a physical table."""

    output: str
    feature: Feature
    slot: int


class ShardRows(NamedTuple):
    """One shard's part of a batch's keys and their rows, on the shard's device."""

    keys: tf.Tensor  # table keys [U_s, 2] int64
    counts: tf.Tensor  # occurrences in the batch [U_s] int32
    rows: tf.Tensor  # packed rows [U_s, width]; a missing key reads count 0
    seen: tf.Tensor  # admission sightings before this batch [U_s] int32 (zeros without admission)


class BatchKeys(NamedTuple):
    """A batch's unique keys of one physical table (`EmbeddingEngine.batch_keys`)."""

    keys: tf.Tensor  # unique table keys [U, 2]
    index: tf.Tensor  # position in `keys` of every id, all uses concatenated [N]
    counts: tf.Tensor  # occurrences in the batch [U] int32


class Fetched(NamedTuple):
    """A batch's unique keys of one physical table and their rows as read (`EmbeddingEngine.fetch`)."""

    keys: tf.Tensor  # unique table keys [U, 2]
    index: tf.Tensor  # position in `keys` of every id, all uses concatenated [N]
    shards: list  # per shard: ShardRows of its keys, in `ShardedTable.partition` order


class Written(NamedTuple):
    """What one step wrote to one shard of a physical table (`EmbeddingEngine.apply`)."""

    keys: tf.Tensor  # [U_s, 2]
    rows: tf.Tensor  # packed rows [U_s, width], inserted where `trainable`
    seen: tf.Tensor  # sightings after the step [U_s] int32: a waiting key's counter
    trainable: tf.Tensor  # [U_s] bool: a row was written (else only the counter)


@dataclass
class _ShardStep:
    """What a step carries from lookup to update for one shard (tensors on its device)."""

    keys: tf.Tensor  # [U_s, 2]
    counts: tf.Tensor  # [U_s] int32
    emb: tf.Tensor  # embeddings, new rows initialized, untrainable rows zero [U_s, dim]
    slots: tf.Tensor  # optimizer slots [U_s, k * dim]
    count: tf.Tensor  # sightings before this step [U_s] int32
    trainable: tf.Tensor  # admitted rows [U_s] bool
    new_unadmitted: tf.Tensor | None  # keys that only bump their counter [U_s] bool


@dataclass
class _StepState:
    """What a training step carries from lookup to update, for one physical table.

    Only `emb` (the embeddings of the batch's keys) and the gradient with respect
    to it cross between the worker and the parameter servers; the optimizer slots
    and metadata stay on each shard's device.
    """

    index: tf.Tensor  # position in the unique keys of every id, all uses concatenated [N]
    positions: list  # per shard: positions of its keys in the unique keys
    shards: list  # per shard: _ShardStep
    emb: tf.Tensor  # [U, dim] stitched from the shards (watched by the tape)


class _PhysicalTable(tf.Module):
    """One physical table: its rows, admission counters, optimizer and the features that read it."""

    def __init__(
        self,
        spec: PhysicalTable,
        uses: list[_Use],
        placement: Placement,
        seed: int,
        batch_size: int,
    ):
        super().__init__(name=spec.name.replace(".", "_"))
        self.spec = spec
        self.uses = uses
        self.seed = seed
        # Every key of the table has slot 0: a 1-D unique over mixed ids is exact on its own.
        self.one_slot = len(spec.logical) == 1
        self.optimizer: SparseOptimizer = make_optimizer(spec.optimizer)
        self.layout = RowLayout(spec.dim, self.optimizer.num_slots)
        shards = placement.num_shards
        # Room for one step's keys (each use reads about one id per example) after a rebuild.
        self.step_keys = -(-batch_size * len(uses) // shards)
        expected = -(-sum(t.expected_keys or 0 for t in spec.logical) // shards)
        self.rows = ShardedTable(
            spec.name, self.layout.width, placement, expected_keys=expected, headroom=self.step_keys
        )
        admission = spec.admission
        self.min_count = admission.min_count if admission else 1
        # A key waiting for admission costs one counter, [sightings, last step seen], not a row.
        self.counters = (
            ShardedTable(spec.name + "_counts", COUNTER_WIDTH, placement, tf.int32)
            if self.min_count > 1
            else None
        )

    def initial_embeddings(self, n: tf.Tensor, step: tf.Tensor, shard: int = 0) -> tf.Tensor:
        init = self.spec.initializer
        shape = tf.stack([n, self.spec.dim])
        seed = tf.stack(
            [tf.constant(self.seed + 1_000_003 * shard, tf.int64), tf.cast(step, tf.int64)]
        )
        if init.type == "zeros":
            return tf.zeros(shape)
        if init.type == "uniform":
            return tf.random.stateless_uniform(shape, seed, init.minval, init.maxval)
        if init.type == "normal":
            return tf.random.stateless_normal(shape, seed, init.mean, init.stddev)
        return tf.random.stateless_truncated_normal(shape, seed, init.mean, init.stddev)

    # ------------------------------------------------------------------ lifecycle

    def _keep(self, count: tf.Tensor, last: tf.Tensor, step: tf.Tensor, slots: tf.Tensor | None = None) -> tf.Tensor:
        """Which rows survive the eviction policy at `step` (on the shard's device).

        `max_keys` bounds each logical table: with `slots` (each row's logical slot, in a
        fused table), the most frequent rows of each slot are kept, not of the whole shard,
        where one table's frequent ids would push another's rows out."""
        keep = tf.ones_like(count, tf.bool)
        policy = self.spec.eviction
        if policy is None:
            return keep
        if policy.ttl_steps is not None:
            keep = last > tf.cast(step, tf.int32) - policy.ttl_steps
        if policy.max_keys is not None:
            # Each shard keeps its share of max_keys, rounded down (the table never holds
            # more; at least one row a shard): least frequent, then oldest, out first.
            limit = max(policy.max_keys // self.rows.num_shards, 1)
            score = tf.bitwise.bitwise_or(
                tf.bitwise.left_shift(tf.cast(count, tf.int64), 32), tf.cast(last, tf.int64)
            )
            score = tf.where(keep, score, -1)
            top = tf.argsort(score, direction="DESCENDING", stable=True)
            if slots is None:
                top = top[:limit]
            else:  # grouped by slot, by score within one: a row's rank in its slot
                top = tf.gather(top, tf.argsort(tf.gather(slots, top), stable=True))
                grouped = tf.gather(slots, top)
                rank = tf.range(tf.size(top, out_type=tf.int64)) - tf.searchsorted(grouped, grouped, out_type=tf.int64)
                top = masked(top, rank < limit)
            top = masked(top, tf.gather(keep, top))
            keep = tf.scatter_nd(top[:, None], tf.ones_like(top, tf.bool), tf.shape(keep))
        return keep

    def _keep_rows(self, others: tuple, segments: list, step: tf.Tensor) -> list:
        """The rows of each segment that survive eviction at `step` (a `Keep`): decided
        over the whole shard from two int32 columns per row (sightings, last step)."""
        meta = self.layout.dim + self.layout.slots_width
        columns = [tf.gather(values[:, meta : meta + 2], held) for _, values, held in segments]
        count, last = tf.unstack(tf.bitcast(tf.concat(columns, 0), tf.int32), axis=1)
        slots = None if self.one_slot else tf.concat([tf.gather(k[:, 0], held) for k, _, held in segments], 0)
        return tf.split(self._keep(count, last, step, slots), tf.stack([tf.shape(c)[0] for c in columns]))

    def _keep_counters(self, others: tuple, segments: list, step: tf.Tensor) -> list:
        """The admission counters that stay (a `Keep`; `others`: the rows' shard handles):
        those of keys still without a row and, with a ttl, seen within it."""
        keys = [tf.gather(k, held) for k, _, held in segments]
        live = self.rowless(others[0], tf.concat(keys, 0))
        ttl = self.spec.eviction.ttl_steps if self.spec.eviction else None
        if ttl is not None:
            # A counter's values are (sightings, last step): one unstack, not a slice.
            last = tf.concat(
                [tf.gather(tf.unstack(v, num=COUNTER_WIDTH, axis=1)[1], held) for _, v, held in segments],
                0,
            )
            live = tf.logical_and(live, last > tf.cast(step, tf.int32) - ttl)
        return tf.split(live, tf.stack([tf.shape(k)[0] for k in keys]))

    def rebuild_shard(self, shard: int, step: int) -> tf.Tensor | None:
        """Applies eviction and drops stale counters by rebuilding the shard; returns the
        keys of the rows evicted (None when the rows were left as they are).

        Runs on the shard's device (its PS task): no row leaves it. The rows and the
        admission counters (admitted keys leave theirs behind) are each laid out again
        when some go or their load fell below `MIN_LOAD`, streaming segment by segment
        (`ShardedTable.rebuild_shard`).
        """
        if self.counters is not None:
            self.counters.rebuild_shard(
                shard, self._keep_counters, self.step_keys, step, also=(self.rows,)
            )
        keep = self._keep_rows if self.spec.eviction is not None else None
        return self.rows.rebuild_shard(shard, keep, self.step_keys, step)

    def rowless(self, rows: ShardHandles, keys: tf.Tensor, chunk: int = 1 << 16) -> tf.Tensor:
        """Which of `keys` have no row in the shard of `rows` (its handles), looked up
        `chunk` keys at a time: traced, in a while_loop; eager, in a Python loop (an eager
        while_loop and its TensorArray cost about 1 ms more a call)."""
        count = self.layout.dim + self.layout.slots_width  # the row's count column

        def rowless_part(part: tf.Tensor) -> tf.Tensor:
            return tf.bitcast(self.rows.find(rows, part)[:, count], tf.int32) <= 0

        if tf.executing_eagerly():
            n = int(keys.shape[0])
            if n == 0:
                return tf.zeros([0], tf.bool)
            if n <= chunk:  # no slice (an eager slice costs about 100 us) and no concat
                return rowless_part(keys)
            return tf.concat([rowless_part(keys[s : s + chunk]) for s in range(0, n, chunk)], 0)
        n = tf.shape(keys)[0]

        def body(start, found):
            return start + chunk, found.write(found.size(), rowless_part(keys[start : start + chunk]))

        found = tf.TensorArray(tf.bool, size=0, dynamic_size=True, infer_shape=False)
        found = found.write(0, tf.zeros([0], tf.bool))  # a concat of no parts fails
        _, found = tf.while_loop(lambda start, _: start < n, body, (tf.constant(0), found))
        return tf.reshape(found.concat(), [-1])

    def counts(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """Per logical table, keys with a row and keys waiting for admission on shard
        `shard` (one call on its device; keys only: a count never copies a table's rows)."""
        also = (self.counters,) if self.counters is not None else ()
        held, waiting = self.rows.on_shard("counts", shard, self._counts, also)()
        return held.numpy(), waiting.numpy()

    def _counts(self, rows: ShardHandles, others: tuple):
        n = len(self.spec.logical)
        held = id_counts(tf.concat([self.rows.bucket_slots(h) for h in rows.tables], 0), n)
        if not others:
            return held, tf.zeros([n], tf.int64)
        counted = tf.concat([self.counters.held_keys(h) for h in others[0].tables], 0)
        waiting = masked(counted, self.rowless(rows, counted))
        return held, id_counts(tf.gather(waiting, 0, axis=1), n)


class LogicalRows(NamedTuple):
    """What one logical table holds (numpy): raw ids and their rows' parts."""

    ids: np.ndarray  # raw int64 ids (a string's fingerprint), the slot removed [n] int64
    emb: np.ndarray  # [n, dim]
    slots: np.ndarray  # optimizer slots [n, k * dim]
    count: np.ndarray  # sightings [n] int32
    last_step: np.ndarray  # [n] int32


class EmbeddingEngine(tf.Module):
    """All embedding tables of a model and the fused step around them.

    The engine owns the storage format: training, `recflow tables`, export,
    deltas and eviction all read and change tables through its methods.

    Args:
        config: the run config.
        placement: shard placement (defaults to one local shard).
        first_order: also give each sparse feature a dim-1 weight, `<name>/linear`.
    """

    def __init__(
        self, config: Config, placement: Placement | None = None, first_order: bool = False
    ):
        super().__init__(name="embedding")
        self.config = config
        self.placement = placement or ModPlacement(1)
        self.first_order = first_order
        self.plan = plan_tables(config, first_order)
        # Checkpointed, so a checkpoint with keys in another format is refused (`check_checkpoint`).
        self.key_format = tf.Variable(
            KEY_FORMAT, dtype=tf.int64, trainable=False, name="key_format"
        )
        self.physical_tables = []
        for index, spec in enumerate(self.plan):
            uses = []
            for feature in config.sparse_features:
                for output, logical in self._outputs(feature):
                    if any(t.name == logical for t in spec.logical):
                        uses.append(_Use(output, feature, spec.slot(logical)))
            seed = config.train.seed * 1000 + index
            self.physical_tables.append(
                _PhysicalTable(spec, uses, self.placement, seed, config.data.batch_size)
            )
        self._watches = None  # the growth check's reads, traced at its first call (`grow`)

    def _outputs(self, feature: Feature):
        yield feature.name, feature.table_name
        if self.first_order:
            yield feature.name + LINEAR_OUTPUT, feature.table_name + LINEAR_SUFFIX

    # ------------------------------------------------------------------ keys and outputs

    @staticmethod
    def _flat_ids(ids) -> tf.Tensor:
        return ids.flat_values if isinstance(ids, tf.RaggedTensor) else ids

    def _unique_keys(self, table: _PhysicalTable, ids: dict):
        """(distinct table keys [U, 2], position in them of every id [N], counts [U]) of the
        ids of every use of `table`, concatenated."""
        parts = [self._flat_ids(ids[u.feature.name]) for u in table.uses]
        return unique_ids(parts, [u.slot for u in table.uses])

    def _assemble(self, table: _PhysicalTable, emb: tf.Tensor, index: tf.Tensor, ids: dict) -> dict:
        """Gathers each use's rows from the unique embeddings and pools / pads them."""
        sizes = [tf.size(self._flat_ids(ids[u.feature.name])) for u in table.uses]
        # One gather for every use of the table (one scatter-add in the backward pass).
        gathered = tf.gather(emb, index)
        pieces = tf.split(gathered, sizes) if len(sizes) > 1 else [gathered]
        out = {}
        for use, values in zip(table.uses, pieces):
            feature_ids = ids[use.feature.name]
            if not isinstance(feature_ids, tf.RaggedTensor):
                out[use.output] = values
                continue
            length = use.feature.sequence_length
            if length is not None and not use.output.endswith(LINEAR_OUTPUT):
                ragged = tf.RaggedTensor.from_row_splits(
                    values, feature_ids.row_splits, validate=False
                )
                out[use.output] = ragged.to_tensor(shape=[None, length, table.spec.dim])
                out[use.feature.name + MASK_OUTPUT] = tf.sequence_mask(
                    feature_ids.row_lengths(), length
                )
                continue
            combiner = use.feature.pooling
            total = tf.math.unsorted_segment_sum(
                values, feature_ids.value_rowids(), feature_ids.nrows()
            )
            n = tf.maximum(tf.cast(feature_ids.row_lengths(), tf.float32), 1.0)[:, None]
            if combiner == "mean":
                total = total / n
            elif combiner == "sqrtn":
                total = total / tf.sqrt(n)
            out[use.output] = total
        return out

    def embed_with(self, ids: dict, read: Callable[[int, tf.Tensor], tf.Tensor]) -> dict:
        """Embeddings of every sparse feature, reading rows with `read(table index, keys)`.

        Used for evaluation, prediction and serving (no updates).
        """
        out = {}
        for i, (table, (keys, index, _)) in enumerate(zip(self.physical_tables, self.batch_keys(ids))):
            out.update(self._assemble(table, read(i, keys), index, ids))
        return out

    def embed(self, ids: dict) -> dict:
        """Inference lookup on the training tables; unknown keys read zeros."""

        def read(i, keys):
            table = self.physical_tables[i]
            return table.rows.lookup(keys)[:, : table.spec.dim]

        return self.embed_with(ids, read)

    # ------------------------------------------------------------------ training step

    def batch_keys(self, ids: dict) -> list[BatchKeys]:
        """A batch's unique keys per physical table, with their counts (on this device).

        Tables read by the same features under the same slots have the same keys (a
        table's first-order companion: `<feature>/linear`): they share one unique."""
        out, found = [], {}
        for table in self.physical_tables:
            uses = tuple((use.feature.name, use.slot) for use in table.uses)
            if uses not in found:
                found[uses] = BatchKeys(*self._unique_keys(table, ids))
            out.append(found[uses])
        return out

    def empty_batch_keys(self) -> list[BatchKeys]:
        """What `batch_keys` returns for a batch with no ids."""
        none = tf.zeros([0], tf.int32)
        keys = tf.zeros([0, KEY_WIDTH], tf.int64)
        return [BatchKeys(keys, none, none)] * len(self.physical_tables)

    def fetch(self, ids: dict) -> list[Fetched]:
        """Looks up the packed rows (and admission counters) of a batch's keys.

        The only reads of a training step: a step that prefetches looks up the
        next batch's keys while it computes (`refresh` then brings those rows up
        to date with the step's writes). The rows stay on their shards' devices.
        """
        return self.lookup(self.batch_keys(ids))

    def lookup(self, batch_keys: list[BatchKeys]) -> list[Fetched]:
        """`fetch` for keys already made unique (`batch_keys`)."""
        # Static key width (a loop variable's keys have [None, None]) for the wire.
        batch_keys = [b._replace(keys=tf.reshape(b.keys, [-1, KEY_WIDTH])) for b in batch_keys]
        split = [table.rows.partition(b.keys) for table, b in zip(self.physical_tables, batch_keys)]
        shards = [[] for _ in self.physical_tables]
        for i in range(self.placement.num_shards):
            keys, counts = [], []
            for b, (positions, parts) in zip(batch_keys, split):
                keys.append(parts[i])
                counts.append(b.counts if positions[i] is None else tf.gather(b.counts, positions[i]))
            device = self.placement.device(i)
            if device is not None:  # one transfer to the PS task
                arrived = wire.send_ints(keys + counts, device)
                keys, counts = arrived[: len(keys)], arrived[len(keys) :]
            with tf.device(device):
                for t, table in enumerate(self.physical_tables):
                    rows = table.rows.lookup_shard(i, keys[t])
                    if table.counters is None:
                        seen = tf.zeros_like(counts[t])
                    else:
                        seen = table.counters.lookup_shard(i, keys[t])[:, 0]
                    shards[t].append(ShardRows(keys[t], counts[t], rows, seen))
        return [Fetched(b.keys, b.index, parts) for b, parts in zip(batch_keys, shards)]

    # ------------------------------------------------------------------ prefetch staging

    def make_staging(self, slots: int) -> None:
        """Creates `slots` staging slots for prefetched rows on each shard's device (eager;
        see `recflow.embedding.staging`). Not checkpointed."""
        widths = [table.layout.width for table in self.physical_tables]
        # A plain object: its variables stay out of `variables` and checkpoints.
        self._staging = Staging(ShardRows, widths, self.placement, slots)

    def stage(self, slot: tf.Tensor, fetched: list[Fetched], after=None) -> tf.Tensor:
        """Keeps `fetched`'s rows in staging `slot` on their shards (once `after` is done);
        returns the token `staged` waits for."""
        return self._staging_slots().write(slot, fetched, after)

    def staged(self, slot: tf.Tensor, batch_keys: list[BatchKeys], after: tf.Tensor) -> list[Fetched]:
        """The rows of `batch_keys` last `stage`d in `slot`, read after its token `after`."""
        shards = self._staging_slots().read(slot, after)
        return [Fetched(b.keys, b.index, parts) for b, parts in zip(batch_keys, shards)]

    def _staging_slots(self) -> Staging:
        staging = getattr(self, "_staging", None)
        if staging is None:
            raise RuntimeError("prefetching needs `EmbeddingEngine.make_staging` first")
        return staging

    def refresh(self, fetched: list[Fetched], written: list[list[Written]]) -> list[Fetched]:
        """`fetched` as if read after the writes of `written` (the previous step's).

        A key of both batches takes the row (or, while it waits for admission,
        the sightings) the previous step wrote, so prefetching never loses or
        misses this process's own updates. Runs on each shard's device; no table
        is read.
        """
        out = []
        for table, f, table_written in zip(self.physical_tables, fetched, written):
            shards = []
            one_slot = table.one_slot
            for i, (part, w) in enumerate(zip(f.shards, table_written)):
                with tf.device(self.placement.device(i)):
                    shards.append(_refreshed(part, w, one_slot))
            out.append(f._replace(shards=shards))
        return out

    def prepare(self, ids: dict, step: tf.Tensor) -> list[_StepState]:
        """Looks up the packed rows of a batch (outside the gradient tape)."""
        return self.states(self.fetch(ids), step)

    def states(self, fetched: list[Fetched], step: tf.Tensor) -> list[_StepState]:
        """The step's rows from fetched ones: new rows initialized, waiting keys zero.

        Computed on each shard's device; only the embeddings leave it (one transfer
        per PS task).
        """
        tables = self.physical_tables
        positions = [t.rows.partition(f.keys)[0] for t, f in zip(tables, fetched)]  # as `lookup`
        dims = [t.spec.dim for t in tables]
        shards = [[] for _ in tables]
        embs = [[] for _ in tables]
        for i in range(self.placement.num_shards):
            device = self.placement.device(i)
            with tf.device(device):
                steps = [self._shard_step(t, f.shards[i], step, i) for t, f in zip(tables, fetched)]
                if device is not None:
                    flat = wire.pack([s.emb for s in steps])
            arrived = [s.emb for s in steps]
            if device is not None:  # here: the part sizes as this device knows them
                sizes = [_part_size(f.keys, p[i]) for f, p in zip(fetched, positions)]
                arrived = wire.unpack(flat, sizes, dims)
            for t, (s, emb) in enumerate(zip(steps, arrived)):
                shards[t].append(s)
                embs[t].append(emb)
        return [
            _StepState(f.index, p, parts, t.rows.stitch(p, e))
            for t, f, p, parts, e in zip(tables, fetched, positions, shards, embs)
        ]

    @staticmethod
    def _shard_step(table: _PhysicalTable, part: ShardRows, step: tf.Tensor, shard: int):
        emb, slots, count, _ = table.layout.split(part.rows)
        exists = count > 0
        n = tf.size(part.counts)
        new_unadmitted = None
        trainable = tf.ones_like(exists)
        if table.counters is not None:
            # A key's counter is stale once it has a row: `exists` wins then.
            seen = part.seen + part.counts
            admitted = seen >= table.min_count
            new_unadmitted = tf.logical_and(tf.logical_not(exists), tf.logical_not(admitted))
            trainable = tf.logical_not(new_unadmitted)
            # A key admitted now carries its earlier sightings into the row.
            count = tf.where(exists, count, seen - part.counts)
        # Random initial values for the new rows only (in a later step most rows exist).
        new = tf.where(tf.logical_not(exists))
        emb = tf.tensor_scatter_nd_update(
            emb, new, table.initial_embeddings(tf.size(new, tf.int32), step, shard)
        )
        emb = tf.where(trainable[:, None], emb, tf.zeros_like(emb))
        slots = tf.where(exists[:, None], slots, table.optimizer.initial_slots(n, table.spec.dim))
        return _ShardStep(part.keys, part.counts, emb, slots, count, trainable, new_unadmitted)

    def embed_step(self, states: list[_StepState], ids: dict) -> dict:
        """Tower inputs from prepared rows (inside the tape; `states[i].emb` watched)."""
        out = {}
        for table, state in zip(self.physical_tables, states):
            out.update(self._assemble(table, state.emb, state.index, ids))
        return out

    def apply(self, states: list[_StepState], grads: list, step: tf.Tensor) -> list[list[Written]]:
        """Applies the sparse optimizers and writes each touched row back, once.

        Each shard's update runs on its device: only the gradients travel there.
        Nothing is erased: a waiting key's counter is left behind when it gets
        its row, and dropped by the next `rebuild`. Returns what was written per
        table and shard, for `refresh`.
        """
        tables = self.physical_tables
        grads = [
            tf.zeros_like(state.emb) if grad is None else tf.convert_to_tensor(grad)
            for state, grad in zip(states, grads)
        ]
        written = [[] for _ in tables]
        for i in range(self.placement.num_shards):
            device = self.placement.device(i)
            parts = [
                g if s.positions[i] is None else tf.gather(g, s.positions[i])
                for s, g in zip(states, grads)
            ]
            if device is not None:
                flat = wire.pack(parts)  # here: one transfer to the PS task
            with tf.device(device):
                if device is not None:
                    sizes = [tf.size(s.shards[i].counts) for s in states]
                    parts = wire.unpack(flat, sizes, [t.spec.dim for t in tables])
                for t, (table, state, grad) in enumerate(zip(tables, states, parts)):
                    written[t].append(self._apply_shard(table, state.shards[i], grad, step, i))
        return written

    @staticmethod
    def _apply_shard(table, part: _ShardStep, grad, step, shard: int) -> Written:
        emb, slots = table.optimizer.apply(part.emb, part.slots, grad, step)
        seen = part.count + part.counts
        last = tf.fill(tf.shape(seen), tf.cast(step, tf.int32))  # cast here: no round trip
        rows = table.layout.pack(emb, slots, seen, last)
        if part.new_unadmitted is None:
            table.rows.insert_shard(shard, part.keys, rows)
        else:  # one split of the keys, in order: rows where trainable, counters elsewhere
            waiting, trainable = tf.dynamic_partition(
                tf.range(tf.size(part.trainable)), tf.cast(part.trainable, tf.int32), 2
            )
            table.rows.insert_shard(
                shard, tf.gather(part.keys, trainable), tf.gather(rows, trainable)
            )
            table.counters.insert_shard(
                shard,
                tf.gather(part.keys, waiting),
                tf.gather(tf.stack([seen, last], axis=1), waiting),
            )
        return Written(part.keys, rows, seen, part.trainable)

    # ------------------------------------------------------------------ restore (eager)

    def restore(self, checkpoint: tf.train.Checkpoint, path: str):
        """Restores `checkpoint` (a `tf.train.Checkpoint` that holds this engine) from
        `path`, its tables first emptied to their least size; returns the load status.

        A restore imports the saved bucket arrays as the tables' own (no copy), but
        reads all of them before it imports any: the empty arrays a table was created
        with, sized for its `expected_keys`, would still be alive beside them (measured:
        peak 1.7x-1.9x the restored tables, `scripts/bench_memory.py`). Emptied first,
        the peak is the restored tables. A shard the checkpoint does not hold (one
        saved with fewer shards) stays empty until `recflow.embedding.reshard` fills it.
        """
        for table in self.physical_tables:
            for part in filter(None, (table.rows, table.counters)):
                for shard in range(part.num_shards):
                    part.reset_shard(shard, 0)
        return checkpoint.restore(path)

    # ------------------------------------------------------------------ lifecycle (between steps)

    def grow(self) -> dict[str, int]:
        """Lays out again, keeping every row, the shards whose next step's inserts could
        double a segment (`ShardedTable.grow`); returns the keys moved per physical table
        (only tables that moved some). Between steps only (after a PS wave's join)."""
        if self._watches is None:
            self._watches = Watches([part for _, part in self._growing()])
        moved = {}
        for (name, part), watched in zip(self._growing(), self._watches.read()):
            n = part.grow(watched)
            if n:
                moved[name] = moved.get(name, 0) + n
        return moved

    def _growing(self) -> list[tuple[str, ShardedTable]]:
        """(physical table name, its rows or counters) of every hash table the engine holds."""
        return [
            (table.spec.name, part)
            for table in self.physical_tables
            for part in (table.rows, table.counters)
            if part is not None
        ]

    def rebuild(self, step: int) -> dict[str, int]:
        """Evicts (`ttl_steps`, `max_keys`) and drops stale admission counters at `step`.

        Each shard of a table with an eviction or admission policy is rebuilt
        from its survivors on its own device, sized to them, segment by segment.
        Returns the rows evicted per physical table.
        """
        return self.rebuild_tracked(step)[0]

    def rebuild_tracked(self, step: int) -> tuple[dict[str, int], dict[str, np.ndarray]]:
        """`rebuild`, and the raw ids each logical table lost (sorted, int64; only tables
        that lost some)."""
        evicted, ids = {}, {}
        for table in self.physical_tables:
            if table.spec.eviction is None and table.counters is None:
                continue
            found = [table.rebuild_shard(shard, step) for shard in range(table.rows.num_shards)]
            found = [k.numpy() for k in found if k is not None]
            keys = np.concatenate(found) if found else np.zeros([0, KEY_WIDTH], np.int64)
            evicted[table.spec.name] = int(keys.shape[0])
            slots, raw = decode(keys)
            for slot, logical in enumerate(table.spec.logical):
                mine = raw[slots == slot]
                if mine.size:
                    ids[logical.name] = np.unique(mine)
        return evicted, ids

    def serving_rows(self, index: int) -> tuple[tf.Tensor, tf.Tensor]:
        """((slot, raw id) pairs [n, 2], embeddings) of physical table `index`: what an
        export serves."""
        table = self.physical_tables[index]
        keys, rows = table.rows.export()
        emb, slots, _, _ = table.layout.split(rows)
        return raw_keys(keys), table.optimizer.serving_rows(emb, slots)

    def logical_rows(self) -> dict[str, LogicalRows]:
        """Every row, per logical table, with raw ids (numpy)."""
        out = {}
        for table in self.physical_tables:
            keys, rows = (t.numpy() for t in table.rows.export())
            slots, ids = decode(keys)
            emb, opt, count, last = table.layout.split_numpy(rows)
            for slot, logical in enumerate(table.spec.logical):
                pick = slots == slot
                out[logical.name] = LogicalRows(
                    ids[pick], emb[pick], opt[pick], count[pick], last[pick]
                )
        return out

    def load_rows(self, name: str, rows: LogicalRows, keep_slots: bool = True) -> int:
        """Inserts `rows` (of another model) into logical table `name` of this new,
        empty engine, as last seen at step 0; returns the rows inserted.

        `keep_slots` False starts the optimizer slots as the optimizer initializes them.
        """
        table = next(t for t in self.physical_tables if any(x.name == name for x in t.spec.logical))
        n = int(rows.ids.size)
        if n == 0:
            return 0
        slot = table.spec.slot(name)
        keys = encode(tf.constant(rows.ids, tf.int64), slot)
        emb = tf.constant(rows.emb, tf.float32)
        slots = (
            tf.constant(rows.slots, tf.float32)
            if keep_slots
            else table.optimizer.initial_slots(tf.constant(n), table.spec.dim)
        )
        count = tf.constant(rows.count, tf.int32)
        values = table.layout.pack(emb, slots, count, tf.zeros([n], tf.int32))
        table.rows.insert(keys, values)
        return n

    def updated_rows(self, since_step: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per logical table: (raw ids, served embeddings) of rows updated after `since_step`."""
        optimizers = {t.name: p.optimizer for p in self.physical_tables for t in p.spec.logical}
        out = {}
        for name, rows in self.logical_rows().items():
            fresh = rows.last_step > since_step
            served = optimizers[name].serving_rows(rows.emb[fresh], rows.slots[fresh])
            out[name] = (rows.ids[fresh], np.asarray(served, np.float32))
        return out

    def table_stats(self) -> dict[str, dict]:
        """Per logical table: keys with a row, waiting keys, row bytes and keys per shard."""
        stats = {}
        for table in self.physical_tables:
            counts = [table.counts(shard) for shard in range(table.rows.num_shards)]
            per_shard = np.stack([held for held, _ in counts], axis=1)  # [logical, shards]
            waiting = sum(w for _, w in counts)
            row_bytes = table.rows.bucket_bytes
            for slot, logical in enumerate(table.spec.logical):
                keys = int(per_shard[slot].sum())
                stats[logical.name] = {
                    "keys": keys,
                    "waiting_keys": int(waiting[slot]),
                    "bytes": keys * row_bytes,
                    "shards": per_shard[slot].tolist(),
                    "physical_table": table.spec.name,
                }
        return stats


def _part_size(keys: tf.Tensor, position: tf.Tensor | None) -> tf.Tensor:
    """Rows of a shard's part of `keys` (all of them when there is one shard)."""
    return tf.shape(keys)[0] if position is None else tf.size(position)


def _refreshed(part: ShardRows, written: Written, one_slot: bool) -> ShardRows:
    """`part` with the rows and counters `written` holds for the keys they share."""
    n = tf.size(written.seen)
    # The written keys are distinct and come first, so they take ids 0..n-1 in order;
    # a key of `part` that was written gets its position there, any other an id >= n.
    _, ids = unique(tf.concat([written.keys, part.keys], 0), one_slot)
    source = tf.minimum(ids[n:], n)  # n: one padding entry, never a match
    match = source < n
    written_row = tf.logical_and(
        match, tf.gather(tf.concat([written.trainable, [False]], 0), source)
    )
    rows = tf.concat(
        [written.rows, tf.zeros([1, tf.shape(written.rows)[1]], written.rows.dtype)], 0
    )
    seen = tf.concat([written.seen, [0]], 0)
    return part._replace(
        rows=tf.where(written_row[:, None], tf.gather(rows, source), part.rows),
        seen=tf.where(
            tf.logical_and(match, tf.logical_not(written_row)), tf.gather(seen, source), part.seen
        ),
    )


def check_checkpoint(path: str) -> None:
    """Refuses, in one line, a checkpoint whose table keys are in another format."""
    reader = tf.train.load_checkpoint(path)
    names = reader.get_variable_to_shape_map()
    if not any("/embedding/" in n for n in names):
        return
    stored = [n for n in names if n.endswith(_KEY_FORMAT_NAME)]
    found = int(reader.get_tensor(stored[0])) if stored else 1  # format 1 had no variable
    if found < KEY_FORMAT:
        raise RecflowError(
            f"{path}: the model dir was written with 55-bit table keys (key format {found}), "
            "which this recflow cannot read (it keys rows by the whole int64 id); retrain it "
            "into a fresh model dir"
        )
    if found > KEY_FORMAT:
        raise RecflowError(
            f"{path}: written by a newer recflow (key format {found}, this one reads "
            f"{KEY_FORMAT}); use that version"
        )
