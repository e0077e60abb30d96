"""A chunk of training steps in one traced loop, as a parameter-server worker runs it.

`train_chunk` trains every batch of an iterator (a split's chunk) inside one
`tf.while_loop`, so one `ClusterCoordinator` closure carries many steps.

With `prefetch` (`train.prefetch_embeddings`) a step first issues the lookups of
the next batch's rows, then computes and writes its own; under parameter servers
those lookups overlap the step's forward and backward pass. Rows that both
batches touch are then taken from what the step wrote
(`EmbeddingEngine.refresh`), so a chunk trains exactly as one `train_step` after
another would (README "Prefetching embeddings").
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import tensorflow as tf

from recflow.data.pipeline import NONFINITE, TRUNCATED


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


def train_chunk(
    model,
    iterator,
    prefetch: bool = False,
    applied: tf.Variable | None = None,
    step: Callable | None = None,
) -> ChunkResult:
    """Trains `model` on every batch of `iterator` (traced code: call it in a `tf.function`).

    Args:
        model: a `RankingModel`.
        iterator: a `tf.data` iterator of (features, labels, bad-record count).
        prefetch: look the next batch's rows up while a step computes.
        applied: counts the rows of each step once its updates are written.
        step: `step(batch, fetched) -> (loss, written)`, the model's
            `train_on_rows` in a loop by default; pass one traced function to
            share its trace between chunk functions.
    """
    engine = model.embedding
    label = model.config.labels[0]
    step = step or (lambda batch, fetched: model.train_on_rows(batch, fetched, in_loop=True))

    def fetch(element):
        def read():
            features = element.get_value()[0]
            return engine.fetch(model.split_features(features)[0])

        return tf.cond(element.has_value(), read, engine.empty_fetched)

    def body(read, steps, rows, bad, nonfinite, truncated, loss, finite, element, *fetched):
        batch = element.get_value()
        features, labels, batch_bad = batch
        size = tf.shape(labels[label], out_type=tf.int64)[0]
        following = iterator.get_next_as_optional()
        ahead = [fetch(following)] if prefetch else []  # issued before this step writes

        def train():
            step_loss, written = step(batch, fetched[0] if prefetch else None)
            step_loss = tf.reshape(tf.cast(step_loss, tf.float32), [])
            if applied is not None:
                with tf.control_dependencies([step_loss]):
                    counted = applied.assign_add(size)
                with tf.control_dependencies([counted]):
                    step_loss = tf.identity(step_loss)
            refreshed = [engine.refresh(ahead[0], written)] if prefetch else []
            return (steps + 1, step_loss, *refreshed)

        def skip():  # every row of the batch was bad: no step
            with tf.control_dependencies([model.bad_records.assign_add(batch_bad)]):
                return tf.nest.map_structure(tf.identity, (steps, loss, *ahead))

        new_steps, new_loss, *refreshed = tf.cond(size > 0, train, skip)
        return (
            read + 1,
            new_steps,
            rows + size,
            bad + batch_bad,
            nonfinite + features[NONFINITE],
            truncated + features[TRUNCATED],
            new_loss,
            tf.math.is_finite(new_loss),
            following,
            *refreshed,
        )

    def more(*state):
        element, finite = state[8], state[7]
        return tf.logical_and(element.has_value(), finite)

    zero = tf.constant(0, tf.int64)
    first = iterator.get_next_as_optional()
    initial = (zero,) * 6 + (tf.constant(0.0), tf.constant(True), first)
    initial += (fetch(first),) if prefetch else ()
    invariants = tf.nest.map_structure(_any_size, initial)
    out = tf.while_loop(more, body, initial, shape_invariants=invariants)
    return ChunkResult(*out[:8])


def _any_size(value):
    """A loop-variable shape invariant: a tensor may change its size; an Optional keeps its spec."""
    if isinstance(value, tf.Tensor):
        return tf.TensorShape([None] * value.shape.rank)
    return value._type_spec
