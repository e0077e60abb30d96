"""A chunk of training steps in one traced loop, as a parameter-server worker runs it.

`train_chunk` trains every batch of an iterator (a split's chunk) inside one
`tf.while_loop`, so one `ClusterCoordinator` closure carries many steps. A batch
whose every row was bad is counted and passed over on the worker while the next
batch is fetched: the loop has no branch, so no step sends the parameter servers
the inputs of a branch not taken (TF's runtime still sends those, as dead tensors).

With `prefetch` (`train.prefetch_embeddings`) a step also looks up the next
batch's rows, on the parameter servers while it computes its own, and leaves
them there in a staging slot for the next step (`recflow.embedding.staging`).
Rows that both batches touch are first taken from what the step wrote
(`EmbeddingEngine.refresh`), so a chunk trains exactly as one `train_step` after
another would (docs/distributed.md, "Prefetching embeddings").
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import tensorflow as tf

from recflow.data.records import NONFINITE, TRUNCATED


class ChunkResult(NamedTuple):
    """Totals of one chunk (int64 scalars, `loss` float32)."""

    read: tf.Tensor  # batches read
    steps: tf.Tensor  # steps trained (batches with rows)
    rows: tf.Tensor  # rows trained
    bad: tf.Tensor  # bad rows dropped by the pipeline
    nonfinite: tf.Tensor  # numeric values read as missing
    truncated: tf.Tensor  # multi_hot rows cut to max_values
    loss: tf.Tensor  # the last step's loss (0 when no step ran)
    finite: tf.Tensor  # bool: every loss was finite (the chunk stops at the first that is not)


class Prefetch(NamedTuple):
    """What a prefetching step gets besides its batch (`RankingModel.train_on_rows`)."""

    slot: tf.Tensor  # int64 scalar: the chunk's staging slot
    keys: list  # this batch's `BatchKeys` per table; its rows are staged in `slot`
    following: list  # the next batch's `BatchKeys` (empty after the last batch)
    staged: tf.Tensor  # the token of the write that staged this batch's rows


def train_chunk(
    model,
    iterator,
    prefetch: bool = False,
    applied: tf.Variable | None = None,
    step: Callable | None = None,
    slot: tf.Tensor | None = None,
) -> ChunkResult:
    """Trains `model` on every batch of `iterator` (traced code: call it in a `tf.function`).

    Args:
        model: a `RankingModel`.
        iterator: a `tf.data` iterator of (features, labels, bad-record count).
        prefetch: look the next batch's rows up while a step computes (needs
            `model.embedding.make_staging`).
        applied: counts the rows of each step once its updates are written.
        step: `step(batch, prefetch) -> (loss, staged token or None)`, the model's
            `train_on_rows` in a loop by default; pass one traced function to
            share its trace between chunk functions.
        slot: the staging slot of this chunk (int64 scalar; 0 by default): chunks
            that run at the same time need distinct slots.
    """
    engine = model.embedding
    label = model.config.labels[0]
    step = step or (lambda batch, ahead: model.train_on_rows(batch, ahead, in_loop=True))
    slot = tf.constant(0, tf.int64) if slot is None else slot

    def keys_of(element):  # on the worker: only keys ever reach the loop's variables
        def read():
            return engine.batch_keys(model.split_features(element.get_value()[0])[0])

        return tf.cond(element.has_value(), read, engine.empty_batch_keys)

    def rows_of(batch):
        return tf.shape(batch[1][label], out_type=tf.int64)[0]

    def next_with_rows(counts):
        """The next batch with rows (an Optional), and `counts` plus the batches without
        rows it passed (every row of those was bad: no step), all on the worker.

        `counts`: batches read, bad rows, missing numeric values, rows cut, and the bad
        rows of batches passed (for `model.bad_records`; a step counts its own).
        """

        def empty(element, *_):
            no_rows = lambda: tf.equal(rows_of(element.get_value()), 0)  # noqa: E731
            return tf.cond(element.has_value(), no_rows, lambda: tf.constant(False))

        def skip(element, read, bad, nonfinite, truncated, passed_bad):
            features, _, batch_bad = element.get_value()
            return (
                iterator.get_next_as_optional(),
                read + 1,
                bad + batch_bad,
                nonfinite + features[NONFINITE],
                truncated + features[TRUNCATED],
                passed_bad + batch_bad,
            )

        initial = (iterator.get_next_as_optional(), *counts)
        invariants = tf.nest.map_structure(_any_size, initial)
        element, *counts = tf.while_loop(empty, skip, initial, shape_invariants=invariants)
        return element, tuple(counts)

    def body(steps, rows, loss, finite, element, counts, carried):
        batch = element.get_value()
        features, _, batch_bad = batch
        size = rows_of(batch)
        read, bad, nonfinite, truncated, passed_bad = counts
        counts = (
            read + 1,
            bad + batch_bad,
            nonfinite + features[NONFINITE],
            truncated + features[TRUNCATED],
            passed_bad,
        )
        following, counts = next_with_rows(counts)
        ahead = None
        if prefetch:
            staged, keys = carried
            ahead = Prefetch(slot, keys, keys_of(following), staged)
        step_loss, token = step(batch, ahead)
        step_loss = tf.reshape(tf.cast(step_loss, tf.float32), [])
        if applied is not None:
            with tf.control_dependencies([step_loss]):
                counted = applied.assign_add(size)
            with tf.control_dependencies([counted]):
                step_loss = tf.identity(step_loss)
        return (
            steps + 1,
            rows + size,
            step_loss,
            tf.math.is_finite(step_loss),
            following,
            counts,
            (token, ahead.following) if prefetch else (),
        )

    def more(steps, rows, loss, finite, element, counts, carried):
        return tf.logical_and(element.has_value(), finite)

    zero = tf.constant(0, tf.int64)
    first, counts = next_with_rows((zero,) * 5)
    carried = ()
    if prefetch:
        keys = keys_of(first)
        carried = (engine.stage(slot, engine.lookup(keys)), keys)
    initial = (zero, zero, tf.constant(0.0), tf.constant(True), first, counts, carried)
    invariants = tf.nest.map_structure(_any_size, initial)
    steps, rows, loss, finite, _, counts, _ = tf.while_loop(
        more, body, initial, shape_invariants=invariants
    )
    read, bad, nonfinite, truncated, passed_bad = counts
    with tf.control_dependencies([model.bad_records.assign_add(passed_bad)]):
        read = tf.identity(read)
    return ChunkResult(read, steps, rows, bad, nonfinite, truncated, loss, finite)


def _any_size(value):
    """A loop-variable shape invariant: a tensor may change its size; an Optional keeps its spec."""
    if isinstance(value, tf.Tensor):
        return tf.TensorShape([None] * value.shape.rank)
    return value._type_spec
