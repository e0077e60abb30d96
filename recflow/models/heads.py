"""Task heads, one class per task type: loss, output activation, metrics, serving output.

`heads_for(config)` builds them; `RankingModel` sums their weighted losses and
returns `{head.output: head.activate(logits)}`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tensorflow as tf

from recflow.config.schema import Config, TaskConfig


@dataclass(frozen=True)
class Head:
    """A task head: its label, loss, output activation, metrics and serving output.

    Args:
        name: the tower's output key for multi-task models (and the output name).
        label: the label column.
        weight: the loss weight in a multi-task sum.
    """

    name: str
    label: str
    weight: float = 1.0
    type = ""  # the `task.type` this head implements (class attribute)

    @property
    def output(self) -> str:
        """Name of this head's tensor in the model's output and the serving signature."""
        return self.name

    def logits_of(self, outputs):
        """This head's logits from the tower's output (a tensor, or `{task name: logits}`)."""
        return outputs[self.name] if isinstance(outputs, dict) else outputs

    def loss(self, labels: tf.Tensor, logits) -> tf.Tensor:
        """The mean loss of a batch."""
        raise NotImplementedError

    def activate(self, logits: tf.Tensor) -> tf.Tensor:
        """Logits -> the prediction."""
        return logits

    def export_output(self, logits: tf.Tensor) -> tf.Tensor:
        """The serving output, `[batch, 1]`."""
        return tf.reshape(self.activate(logits), [-1, 1])

    def metric_names(self, task: TaskConfig) -> tuple[str, ...]:
        """The metrics evaluated for this head (`task.metrics` that apply, or the defaults)."""
        return task.metric_names(self.type)


def _flat(labels: tf.Tensor, logits: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    return tf.reshape(tf.cast(labels, tf.float32), [-1]), tf.reshape(logits, [-1])


@dataclass(frozen=True)
class BinaryHead(Head):
    """A click (0/1) head: sigmoid cross-entropy, a probability."""

    type = "binary"

    def loss(self, labels, logits):
        labels, logits = _flat(labels, logits)
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))

    def activate(self, logits):
        return tf.sigmoid(logits)


@dataclass(frozen=True)
class RegressionHead(Head):
    """A real-valued head: mean squared error, the logit itself."""

    type = "regression"

    def loss(self, labels, logits):
        labels, logits = _flat(labels, logits)
        return tf.reduce_mean(tf.square(logits - labels))


@dataclass(frozen=True)
class RetrievalHead(Head):
    """A two-tower head: in-batch softmax over query-candidate dot products
    (`retrieval_loss`); its logits are the tower's `{"query", "candidate"}` embeddings.

    Args:
        temperature: the dot products are divided by it (None: 1).
        logq_correction: correct for in-batch candidate frequency.
    """

    temperature: float | None = None
    logq_correction: bool = True
    type = "retrieval"

    def logits_of(self, outputs):
        return outputs  # {"query": [B, d], "candidate": [B, d]}

    def loss(self, labels, logits):
        return retrieval_loss(
            labels, logits["query"], logits["candidate"], self.temperature, self.logq_correction
        )

    def export_output(self, logits):
        raise NotImplementedError("a retrieval model exports a query and a candidate signature")


HEADS = {cls.type: cls for cls in (BinaryHead, RegressionHead, RetrievalHead)}


def in_batch_candidates(candidate: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Groups a batch's candidates by equal embeddings (relative tolerance 1e-5).

    Returns:
        (ids [B] int64: the row of each candidate's first copy,
         share [B] float32: the fraction of the batch's rows that hold that candidate).
    """
    c = tf.stop_gradient(candidate)
    norm = tf.reduce_sum(tf.square(c), axis=1)
    scale = norm[:, None] + norm[None, :]
    same = scale - 2.0 * tf.matmul(c, c, transpose_b=True) <= 1e-5 * scale
    rows = tf.range(tf.shape(c, out_type=tf.int64)[0])
    ids = tf.reduce_min(tf.where(same, rows[None, :], rows[:, None]), axis=1)
    return ids, tf.reduce_mean(tf.cast(same, tf.float32), axis=1)


@functools.cache
def _retrieval_task(temperature: float | None, logq_correction: bool):
    import tensorflow_recommenders as tfrs

    # No factorized metrics (they need the candidate corpus): recall@K is computed
    # exactly at evaluation. The default loss sums the rows' cross-entropies.
    task = tfrs.tasks.Retrieval(temperature=temperature, remove_accidental_hits=True)

    def loss(query, candidate, weight):
        ids, share = in_batch_candidates(candidate)
        return task(
            query,
            candidate,
            weight,
            candidate_sampling_probability=share if logq_correction else None,
            candidate_ids=ids,
            compute_metrics=False,
            compute_batch_metrics=False,
        )

    # Its own tf.function: AutoGraph converts TFRS's `len(tf.shape(x))` even when the
    # training step around it is traced without AutoGraph.
    return tf.function(loss)


def retrieval_loss(
    labels: tf.Tensor,
    query: tf.Tensor,
    candidate: tf.Tensor,
    temperature: float | None = None,
    logq_correction: bool = True,
) -> tf.Tensor:
    """In-batch softmax loss (TFRS `Retrieval`), mean over the positive rows.

    Row i's candidate is the positive of query i; the batch's other candidates
    are its negatives. Rows with label <= 0 add no loss term of their own but
    still serve as negatives for the other rows. Copies of a row's own candidate
    elsewhere in the batch are not counted as negatives (accidental hits), and with
    `logq_correction` each score is lowered by the log of its candidate's share of
    the batch (Yi et al. 2019), which removes the popularity bias of in-batch
    negatives. Candidates are told apart by their embeddings: equal embeddings, one
    candidate.
    """
    weight = tf.cast(tf.reshape(labels, [-1]) > 0, tf.float32)
    total = _retrieval_task(temperature, bool(logq_correction))(query, candidate, weight)
    return total / tf.maximum(tf.reduce_sum(weight), 1.0)


def heads_for(config: Config) -> list[Head]:
    """The heads of a config's task: one per task of a multi-task config."""
    task = config.task
    if task.type == "multitask":
        return [HEADS[t.type](t.name, t.label, t.weight) for t in task.tasks]
    name = {"binary": "probability", "regression": "prediction", "retrieval": "embeddings"}[task.type]
    return [HEADS[task.type](name, config.data.label[0])]
