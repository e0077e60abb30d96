"""The dynamic embedding engine: fused lookups, packed rows, sparse updates.

A training step, per physical table (a fused group of logical tables):

    ids of every feature -> encode(slot) -> concat -> unique -> partition by shard
      -> one lookup per shard -> stitch -> [U, width] packed rows
    (tape) gather per feature -> pool / pad -> tower -> loss -> d loss / d emb [U, dim]
    sparse optimizer on [emb | slots] -> pack with (count, last_step) -> one insert per shard

Keys not yet admitted read the default (zero) row and only bump a counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import tensorflow as tf

from recflow.config.schema import Config, Feature, SequenceFeature
from recflow.embedding.optimizers import SparseOptimizer, make_optimizer
from recflow.embedding.placement import ModPlacement, Placement
from recflow.embedding.planner import LINEAR_SUFFIX, PhysicalTable, plan_tables
from recflow.embedding.rows import RowLayout
from recflow.embedding.table import ShardedTable
from recflow.features.keys import encode

LINEAR_OUTPUT = "/linear"  # tower input `<feature>/linear`: first-order weight [B, 1]
MASK_OUTPUT = "/mask"  # tower input `<sequence>/mask`: [B, max_len] bool


class _Use(NamedTuple):
    """One feature reading one logical table of a physical table."""

    output: str
    feature: Feature
    slot: int


@dataclass
class _StepState:
    """What a training step carries from lookup to update, for one physical table."""

    keys: tf.Tensor  # unique keys [U]
    index: tf.Tensor  # position in `keys` of every id, all uses concatenated [N]
    counts: tf.Tensor  # occurrences of each unique key in the batch [U] int32
    emb: tf.Tensor  # rows' embeddings, new rows initialized, untrainable rows zero [U, dim]
    slots: tf.Tensor  # optimizer slots [U, k * dim]
    count: tf.Tensor  # sightings before this step [U] int32
    trainable: tf.Tensor  # admitted rows [U] bool
    new_unadmitted: tf.Tensor | None  # keys that only bump their counter [U] bool


class _Group(tf.Module):
    """One physical table: its storage, optimizer and the features that read it."""

    def __init__(self, spec: PhysicalTable, uses: list[_Use], placement: Placement, seed: int):
        super().__init__(name=spec.name.replace(".", "_"))
        self.spec = spec
        self.uses = uses
        self.seed = seed
        self.optimizer: SparseOptimizer = make_optimizer(spec.optimizer)
        self.layout = RowLayout(spec.dim, self.optimizer.num_slots)
        self.table = ShardedTable(spec.name, self.layout.width, placement)
        admission = spec.admission
        self.min_count = admission.min_count if admission else 1
        # Keys waiting for admission cost one int32 counter, not a row.
        self.counters = (
            ShardedTable(spec.name + "_counts", None, placement, tf.int32)
            if self.min_count > 1
            else None
        )

    def initial_embeddings(self, n: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        init = self.spec.initializer
        shape = tf.stack([n, self.spec.dim])
        seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
        if init.type == "zeros":
            return tf.zeros(shape)
        if init.type == "uniform":
            return tf.random.stateless_uniform(shape, seed, init.minval, init.maxval)
        if init.type == "normal":
            return tf.random.stateless_normal(shape, seed, init.mean, init.stddev)
        return tf.random.stateless_truncated_normal(shape, seed, init.mean, init.stddev)


class EmbeddingEngine(tf.Module):
    """All embedding tables of a model and the fused step around them.

    Args:
        config: the run config.
        placement: shard placement (defaults to one local shard).
        first_order: also give each sparse feature a dim-1 weight, `<name>/linear`.
    """

    def __init__(self, config: Config, placement: Placement | None = None, first_order: bool = False):
        super().__init__(name="embedding")
        self.config = config
        self.placement = placement or ModPlacement(1)
        self.first_order = first_order
        self.plan = plan_tables(config, first_order)
        self.groups = []
        for index, spec in enumerate(self.plan):
            uses = []
            for feature in config.sparse_features:
                for output, logical in self._outputs(feature):
                    if any(t.name == logical for t in spec.logical):
                        uses.append(_Use(output, feature, spec.slot(logical)))
            self.groups.append(_Group(spec, uses, self.placement, seed=config.train.seed * 1000 + index))

    def _outputs(self, feature: Feature):
        yield feature.name, feature.table_name
        if self.first_order:
            yield feature.name + LINEAR_OUTPUT, feature.table_name + LINEAR_SUFFIX

    # ------------------------------------------------------------------ keys and outputs

    @staticmethod
    def _flat_ids(ids) -> tf.Tensor:
        return ids.flat_values if isinstance(ids, tf.RaggedTensor) else ids

    def _keys(self, group: _Group, ids: dict) -> tf.Tensor:
        parts = [encode(self._flat_ids(ids[u.feature.name]), u.slot) for u in group.uses]
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

    def _assemble(self, group: _Group, emb: tf.Tensor, index: tf.Tensor, ids: dict) -> dict:
        """Gathers each use's rows from the unique embeddings and pools / pads them."""
        sizes = [tf.size(self._flat_ids(ids[u.feature.name])) for u in group.uses]
        # One gather for every use of the table (one scatter-add in the backward pass).
        gathered = tf.gather(emb, index)
        pieces = tf.split(gathered, sizes) if len(sizes) > 1 else [gathered]
        out = {}
        for use, values in zip(group.uses, pieces):
            feature_ids = ids[use.feature.name]
            if not isinstance(feature_ids, tf.RaggedTensor):
                out[use.output] = values
                continue
            if isinstance(use.feature, SequenceFeature) and not use.output.endswith(LINEAR_OUTPUT):
                length = use.feature.max_len
                ragged = tf.RaggedTensor.from_row_splits(values, feature_ids.row_splits, validate=False)
                out[use.output] = ragged.to_tensor(shape=[None, length, group.spec.dim])
                out[use.feature.name + MASK_OUTPUT] = tf.sequence_mask(
                    feature_ids.row_lengths(), length
                )
                continue
            combiner = getattr(use.feature, "combiner", "mean")
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
        """Embeddings of every sparse feature, reading rows with `read(group, keys)`.

        Used for evaluation, prediction and serving (no updates).
        """
        out = {}
        for i, group in enumerate(self.groups):
            keys, index = tf.unique(self._keys(group, ids))
            out.update(self._assemble(group, read(i, keys), index, ids))
        return out

    def embed(self, ids: dict) -> dict:
        """Inference lookup on the training tables; unknown keys read zeros."""

        def read(i, keys):
            group = self.groups[i]
            return group.table.lookup(keys)[:, : group.spec.dim]

        return self.embed_with(ids, read)

    # ------------------------------------------------------------------ training step

    def prepare(self, ids: dict, step: tf.Tensor) -> list[_StepState]:
        """Looks up the packed rows of a batch (outside the gradient tape)."""
        states = []
        for group in self.groups:
            keys, index, counts = tf.unique_with_counts(self._keys(group, ids))
            counts = tf.cast(counts, tf.int32)
            rows = group.table.lookup(keys)
            emb, slots, count, _ = group.layout.split(rows)
            exists = count > 0
            n = tf.size(keys)
            new_unadmitted = None
            trainable = tf.ones_like(exists)
            if group.counters is not None:
                seen = group.counters.lookup(keys) + counts
                admitted = seen >= group.min_count
                new_unadmitted = tf.logical_and(tf.logical_not(exists), tf.logical_not(admitted))
                trainable = tf.logical_not(new_unadmitted)
                # A key admitted now carries its earlier sightings into the row.
                count = tf.where(exists, count, seen - counts)
            initial = group.initial_embeddings(n, step)
            emb = tf.where(exists[:, None], emb, initial)
            emb = tf.where(trainable[:, None], emb, tf.zeros_like(emb))
            slots = tf.where(
                exists[:, None], slots, group.optimizer.initial_slots(n, group.spec.dim)
            )
            states.append(
                _StepState(keys, index, counts, emb, slots, count, trainable, new_unadmitted)
            )
        return states

    def embed_step(self, states: list[_StepState], ids: dict) -> dict:
        """Tower inputs from prepared rows (inside the tape; `states[i].emb` watched)."""
        out = {}
        for group, state in zip(self.groups, states):
            out.update(self._assemble(group, state.emb, state.index, ids))
        return out

    def apply(self, states: list[_StepState], grads: list, step: tf.Tensor) -> None:
        """Applies the sparse optimizers and writes each touched row back, once."""
        step32 = tf.cast(step, tf.int32)
        for group, state, grad in zip(self.groups, states, grads):
            grad = tf.zeros_like(state.emb) if grad is None else tf.convert_to_tensor(grad)
            emb, slots = group.optimizer.apply(state.emb, state.slots, grad, step)
            last = tf.fill(tf.shape(state.count), step32)
            rows = group.layout.pack(emb, slots, state.count + state.counts, last)
            if state.new_unadmitted is None:
                group.table.insert(state.keys, rows)
                continue
            group.table.insert(
                tf.boolean_mask(state.keys, state.trainable),
                tf.boolean_mask(rows, state.trainable),
            )
            waiting = state.new_unadmitted
            group.counters.insert(
                tf.boolean_mask(state.keys, waiting),
                tf.boolean_mask(state.count + state.counts, waiting),
            )
            admitted_now = tf.logical_and(state.trainable, state.count < group.min_count)
            group.counters.erase(tf.boolean_mask(state.keys, admitted_now))

    # ------------------------------------------------------------------ lifecycle

    def logical_rows(self, group: _Group, shard: int | None = None):
        """Per logical table of a group: (keys, embeddings, count, last_step), eager."""
        if shard is None:
            keys, rows = group.table.export()
        else:
            keys, rows = group.table.export_shard(shard)
        emb, _, count, last = group.layout.split(rows)
        return keys, emb, count, last
