"""Task heads and their registry: one class per head type owns its loss, output
activation, metrics and export output.

`task.type` (or `task.tasks[i].type`) names a head registered with
`register_head("name")`, or a head of the user's own module as
`"package.module:ClassName"`. `heads_for(config)` builds them; `RankingModel` sums
their weighted losses and returns `{head.output: head.activate(logits)}`; the
evaluator asks each head for its metrics of the collected labels and predictions;
the export serves `head.export_output(logits)` under `head.output`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import tensorflow as tf

from recflow import metrics as metrics_lib
from recflow.config import model_module
from recflow.config.schema import Config, TaskConfig
from recflow.errors import ConfigError

Metric = Callable[[np.ndarray, np.ndarray, "np.ndarray | None"], float]

_HEADS: dict[str, type[Head]] = {}


def register_head(name: str):
    """Class decorator: makes a `Head` subclass available as `task.type: name`."""

    def wrap(cls):
        model_module.register(_HEADS, name, cls, Head, "head")
        return cls

    return wrap


def registered_heads() -> list[str]:
    return sorted(_HEADS)


@dataclass(frozen=True)
class Head:
    """A task head: its label, loss, output activation, metrics and export output.

    Args:
        name: the tower's output key for multi-task models (and the output name).
        label: the label column.
        weight: the loss weight in a multi-task sum.

    A subclass implements `loss`, and overrides `activate` (logits -> prediction)
    when the prediction is not the logit itself. Its class attributes say what it
    evaluates and exports: `output_name` (the output of a single-task model),
    `metrics` (name -> `fn(labels, predictions, groups) -> float` over numpy arrays
    of the whole split) and `default_metrics` (those computed when `task.metrics` is
    not set).
    """

    name: str
    label: str
    weight: float = 1.0

    output_name: ClassVar[str] = "prediction"
    metrics: ClassVar[Mapping[str, Metric]] = {}
    default_metrics: ClassVar[tuple[str, ...]] = ()

    @property
    def output(self) -> str:
        """Name of this head's tensor in the model's output and the serving signature."""
        return self.name

    def logits_of(self, outputs):
        """This head's logits `[B, 1]` from the tower's output (a tensor, or `{task name:
        logits}`).

        Raises:
            ConfigError: (`model.type`) the tower returned no logits for this task, or
                logits of another shape (the loss would broadcast them against the labels).
        """
        task = ""
        if isinstance(outputs, dict):
            if self.name not in outputs:
                raise ConfigError("model.type", f"the tower returned no logits for task {self.name!r} "
                                                f"(it returned {', '.join(map(repr, sorted(outputs)))})")
            outputs, task = outputs[self.name], f" for task {self.name!r}"
        shape = tf.TensorShape(getattr(outputs, "shape", None))
        if shape.rank is not None and (shape.rank != 2 or shape[1] not in (1, None)):
            dims = ", ".join(["batch", *map(str, shape.as_list()[1:])]) if shape.rank else ""
            raise ConfigError("model.type", f"the tower returned logits{task} of shape [{dims}]; "
                                            "expected [batch, 1]")
        return outputs

    def loss(self, labels: tf.Tensor, logits) -> tf.Tensor:
        """The mean loss of a batch: `labels` [B] (or [B, 1]), `logits` [B, 1]."""
        raise NotImplementedError(f"{type(self).__name__} must implement `loss`")

    def activate(self, logits: tf.Tensor) -> tf.Tensor:
        """Logits -> the prediction."""
        return logits

    def export_output(self, logits: tf.Tensor) -> tf.Tensor:
        """The serving output, `[batch, 1]`."""
        return tf.reshape(self.activate(logits), [-1, 1])

    @classmethod
    def accepts_metric(cls, name: str) -> bool:
        """Whether `name` is a metric of this head."""
        return name in cls.metrics

    @classmethod
    def expected_metrics(cls) -> str:
        """The metric names this head accepts, for an error message."""
        return f"one of {sorted(cls.metrics)}"

    def metric_names(self, task: TaskConfig) -> tuple[str, ...]:
        """The metrics evaluated for this head (`task.metrics` that apply, or the defaults)."""
        return tuple(m for m in (task.metrics or self.default_metrics) if self.accepts_metric(m))

    def metric(self, name: str, labels: np.ndarray, predictions: np.ndarray, groups=None) -> float:
        """One metric over a split's labels and predictions (`groups`: the `group_by`
        feature's values, or None)."""
        return float(self.metrics[name](labels, predictions, groups))


def _flat(labels: tf.Tensor, logits: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    return tf.reshape(tf.cast(labels, tf.float32), [-1]), tf.reshape(logits, [-1])


def _pointwise(fn) -> Metric:
    return lambda labels, predictions, groups: fn(labels, predictions)


@register_head("binary")
@dataclass(frozen=True)
class BinaryHead(Head):
    """A click (0/1) head: sigmoid cross-entropy, a probability."""

    output_name = "probability"
    metrics = {
        "auc": _pointwise(metrics_lib.auc),
        "logloss": _pointwise(metrics_lib.logloss),
        "gauc": metrics_lib.gauc,
        "accuracy": _pointwise(metrics_lib.accuracy),
    }
    default_metrics = ("auc", "logloss")

    def loss(self, labels, logits):
        labels, logits = _flat(labels, logits)
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))

    def activate(self, logits):
        return tf.sigmoid(logits)


@register_head("regression")
@dataclass(frozen=True)
class RegressionHead(Head):
    """A real-valued head: mean squared error, the logit itself."""

    metrics = {
        "mse": _pointwise(metrics_lib.mse),
        "mae": _pointwise(metrics_lib.mae),
        "rmse": _pointwise(metrics_lib.rmse),
    }
    default_metrics = ("mse",)

    def loss(self, labels, logits):
        labels, logits = _flat(labels, logits)
        return tf.reduce_mean(tf.square(logits - labels))


_RECALL = re.compile(r"recall@[1-9][0-9]*")


@register_head("retrieval")
@dataclass(frozen=True)
class RetrievalHead(Head):
    """A two-tower head: in-batch softmax over query-candidate dot products
    (`retrieval_loss`); its logits are the tower's `{"query", "candidate"}` embeddings.
    Its metrics (`recall@K`) are computed by the retrieval evaluation against every
    distinct candidate of the split (`RetrievalModel`).

    Args:
        temperature: the dot products are divided by it (None: 1).
        logq_correction: correct for in-batch candidate frequency.
    """

    temperature: float | None = None
    logq_correction: bool = True
    output_name = "embeddings"
    default_metrics = ("recall@10",)

    def logits_of(self, outputs):
        return outputs  # {"query": [B, d], "candidate": [B, d]}

    def loss(self, labels, logits):
        return retrieval_loss(
            labels, logits["query"], logits["candidate"], self.temperature, self.logq_correction
        )

    def export_output(self, logits):
        raise NotImplementedError("a retrieval model exports a query and a candidate signature")

    @classmethod
    def accepts_metric(cls, name):
        return isinstance(name, str) and name.isascii() and _RECALL.fullmatch(name) is not None

    @classmethod
    def expected_metrics(cls):
        return "'recall@K' with K a positive integer"

    def metric(self, name, labels, predictions, groups=None):
        raise NotImplementedError("recall@K is computed by the retrieval evaluation")


def in_batch_candidates(candidate: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Groups a batch's candidates by equal embeddings: a squared distance at most 1e-5 of
    the sum of their squared norms (a cosine of 0.99999 or more: the tolerance the
    matmul form's rounding needs; two distinct candidates that close count as one).

    Returns:
        (ids [B] int64: the row of each candidate's first copy,
         share [B] float32: the fraction of the batch's rows that hold that candidate).
    """
    c = tf.stop_gradient(candidate)
    norm = tf.reduce_sum(tf.square(c), axis=1)
    scale = norm[:, None] + norm[None, :]
    same = scale - 2.0 * tf.matmul(c, c, transpose_b=True) <= 1e-5 * scale
    # The rows as floats (exact below 2**24): oneDNN logs an error line for an integer reduce.
    rows = tf.range(tf.cast(tf.shape(c)[0], tf.float32))
    ids = tf.cast(tf.reduce_min(tf.where(same, rows[None, :], rows[:, None]), axis=1), tf.int64)
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


def head_class(type_name: str, path: str = "task.type") -> type[Head]:
    """The head class of a task type: a registered name or `module:ClassName`."""
    if model_module.is_class_path(type_name):
        return model_module.import_class(type_name, path, Head)
    if type_name not in _HEADS:
        raise ConfigError(
            path, f"no head {type_name!r} (registered: {', '.join(registered_heads())}; "
            "or 'package.module:ClassName')"
        )
    return _HEADS[type_name]


def heads_for(config: Config) -> list[Head]:
    """The heads of a config's task: one per task of a multi-task config.

    Raises:
        ConfigError: an unknown head, or a `task.metrics` entry that no head computes.
    """
    task = config.task
    if task.type == "multitask":
        heads = [
            head_class(t.type, f"task.tasks[{i}].type")(t.name, t.label, t.weight)
            for i, t in enumerate(task.tasks)
        ]
    else:
        cls = head_class(task.type)
        heads = [cls(cls.output_name, config.data.label[0])]
    for i, metric in enumerate(task.metrics or ()):
        if not any(h.accepts_metric(metric) for h in heads):
            kinds = {type(h) for h in heads}
            if len(kinds) == 1:
                expected = next(iter(kinds)).expected_metrics()
            else:
                expected = f"one of {sorted({m for k in kinds for m in k.metrics})}"
            raise ConfigError(f"task.metrics[{i}]", f"expected {expected}, got {metric!r}")
    return heads
