"""Task heads: loss, output activation and serving output name per task."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tensorflow as tf

from recflow.config.schema import Config


@dataclass(frozen=True)
class Head:
    name: str  # the tower's output key for multi-task models
    type: str  # binary | regression | retrieval
    label: str
    weight: float = 1.0
    temperature: float | None = None  # retrieval: softmax over dot products / temperature
    logq_correction: bool = True  # retrieval: correct for in-batch candidate frequency

    @property
    def output(self) -> str:
        """Name of this head's tensor in the serving signature."""
        return self.name

    def loss(self, labels: tf.Tensor, logits) -> tf.Tensor:
        if self.type == "retrieval":  # logits: {"query": [B, d], "candidate": [B, d]}
            return retrieval_loss(
                labels, logits["query"], logits["candidate"], self.temperature, self.logq_correction
            )
        labels = tf.reshape(tf.cast(labels, tf.float32), [-1])
        logits = tf.reshape(logits, [-1])
        if self.type == "binary":
            return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
        return tf.reduce_mean(tf.square(logits - labels))

    def activate(self, logits: tf.Tensor) -> tf.Tensor:
        return tf.sigmoid(logits) if self.type == "binary" else logits


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
    task = config.task
    if task.type == "multitask":
        return [Head(t.name, t.type, t.label, t.weight) for t in task.tasks]
    if task.type == "retrieval":
        return [Head("embeddings", "retrieval", config.data.label[0])]
    name = "probability" if task.type == "binary" else "prediction"
    return [Head(name, task.type, config.data.label[0])]
