"""Evaluation at inference speed: exact metrics over a split.

One compiled predict function per evaluator (no gradient graph, no AutoGraph),
traced on the first pass and reused by every later pass; batches of
`max(data.batch_size, EVAL_BATCH)` rows, read and transformed by the input
pipeline in parallel with the model.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import tensorflow as tf

from recflow import data as data_lib
from recflow import metrics as metrics_lib
from recflow.config.schema import SequenceFeature
from recflow.data.records import finish
from recflow.features.transform import transform
from recflow.models.base import RetrievalModel

logger = logging.getLogger(__name__)

EVAL_BATCH = 16384  # rows per evaluation batch (at least the training batch)


class Evaluator:
    """Computes a model's metrics over the eval split (the train split when there is none).

    Args:
        config: the run config.
        model: the model to evaluate (its current weights, each call).
        transformed: `dataset -> dataset` applying the feature transforms to raw
            batches (the trainer's input map); raw batches are transformed here without it.
        batch_size: rows per batch; default `max(data.batch_size, EVAL_BATCH)`.
    """

    def __init__(self, config, model, transformed=None, batch_size: int | None = None):
        self.model = model
        self.batch_size = batch_size or max(config.data.batch_size, EVAL_BATCH)
        data = dataclasses.replace(config.data, batch_size=self.batch_size)
        self.config = dataclasses.replace(config, data=data)
        self._transformed = transformed or (lambda ds: _transform(self.config, ds))
        self._predict = None  # the compiled predict function, built on the first pass
        self._tracing: threading.Thread | None = None  # `prepare`'s

    @property
    def split(self) -> str:
        data = self.config.data
        return "eval" if (data.eval or data.format == "synthetic") else "train"

    def _predict_fn(self, spec, fn):
        if self._predict is None or self._predict.input_signature[0] != spec:
            self._predict = tf.function(fn, input_signature=[spec], autograph=False)
        return self._predict

    def _ranking(self, features):
        return self.model(features, training=False)

    def prepare(self, spec) -> None:
        """Traces the predict function for batches of `spec` (transformed batches, as the
        training step takes) in a thread, ahead of the first `evaluate`: started while the
        training step's first call builds its kernels without the GIL, the trace overlaps
        it (the bench's 1-epoch job: evaluation 1.44-1.46 -> 1.17-1.19 s, training
        0.1-0.2 s longer). A trace that fails, or batches of another spec, are traced
        again by `evaluate`, where an error is raised.

        The thread is not a daemon: a run that fails while it traces exits once the trace
        is done. A daemon thread still inside TensorFlow's C++ code when the interpreter
        tears down is ended by `pthread_exit`, whose unwinding a C++ `catch (...)` there
        swallows: the process aborted (exit 134) after printing the run's error."""
        if isinstance(self.model, RetrievalModel):  # it predicts from raw columns
            return

        def trace():
            try:
                self._predict_fn(spec[0], self._ranking).get_concrete_function()
            except Exception:  # noqa: BLE001 - `evaluate` traces again and raises it there
                self._predict = None

        self._tracing = threading.Thread(target=trace, name="recflow-eval-trace")
        self._tracing.start()

    def evaluate(self) -> dict:
        """Exact metrics over the split; `eval_split`, `eval_examples`, `eval_bad_records`,
        and `eval_metrics`: the names of the metrics computed (`<head>/<metric>` for each
        head of a multi-task model), in order.

        Raises:
            DataError: the split's bad rows exceed `data.max_bad_fraction` of its rows read.
        """
        if self._tracing is not None:
            self._tracing.join()
            self._tracing = None
        if isinstance(self.model, RetrievalModel):
            return self._evaluate_retrieval()
        config, model, split = self.config, self.model, self.split
        dataset = self._transformed(data_lib.make_dataset(config, split, epochs=1, shuffle=False))
        predict = self._predict_fn(dataset.element_spec[0], self._ranking)
        group_by = config.task.group_by
        labels = {h.label: [] for h in model.heads}
        preds = {h.output: [] for h in model.heads}
        groups, bad = [], 0
        for features, batch_labels, batch_bad in dataset:
            out = predict(features)
            for head in model.heads:
                labels[head.label].append(batch_labels[head.label].numpy())
                preds[head.output].append(out[head.output].numpy().reshape(-1))
            if group_by:
                groups.append(np.asarray(features[group_by]).reshape(-1))
            bad += int(batch_bad)
        rows = sum(y.size for y in labels[model.heads[0].label])
        self.check_bad_rows(rows, bad)
        result = {"eval_split": split, "eval_examples": 0, "eval_metrics": []}
        g = np.concatenate(groups) if groups else None
        for head in model.heads:
            y = np.concatenate(labels[head.label]) if labels[head.label] else np.zeros(0)
            p = np.concatenate(preds[head.output]) if preds[head.output] else np.zeros(0)
            result["eval_examples"] = int(y.size)
            if head.label in config.binary_labels and y.size and (y == y[0]).all():
                _warn_one_class(config, head.label, split, y)
            prefix = "" if len(model.heads) == 1 else f"{head.name}/"
            if not head.metric_names(config.task) and head.metrics:
                _warn_no_metric(config, head)
            for name in head.metric_names(config.task):
                value = head.metric(name, y, p, g) if y.size else float("nan")
                result[prefix + name] = value  # full precision: an mse of 4e-05 keeps its digits
                result["eval_metrics"].append(prefix + name)
        result["eval_bad_records"] = bad
        return result

    def _evaluate_retrieval(self) -> dict:
        """recall@K: each positive row's query against every distinct candidate of the split.

        Candidates are deduplicated by what the candidate tower reads: each candidate
        feature's ids after the transform (a multi_hot's as a set with its repeats, as its
        pooling reads them; `a|b`, `b|a` and ` a | b ` are one candidate, which scored
        as two ties with each other by their raw texts), and numbers after normalizing.
        `eval_candidates` is their number (a random ranking scores K / eval_candidates).
        """
        config, model, split = self.config, self.model, self.split
        head = model.heads[0]
        dataset = data_lib.make_dataset(config, split, epochs=1, shuffle=False)  # raw columns
        predict = self._predict_fn(
            dataset.element_spec[0],
            lambda raw: model(transform(config, raw), training=False)[head.output],
        )
        queries, candidates, labels, bad = [], [], [], 0
        columns = {name: [] for name in model.candidate_features}
        for raw, batch_labels, batch_bad in dataset:
            out = predict(raw)
            queries.append(out["query"].numpy())
            candidates.append(out["candidate"].numpy())
            labels.append(batch_labels[head.label].numpy().reshape(-1))
            features = transform(config, raw)
            for name, values in columns.items():
                values.append(_candidate_keys(features[name], config.feature(name)))
            bad += int(batch_bad)
        y = np.concatenate(labels) if labels else np.zeros(0)
        self.check_bad_rows(y.size, bad)
        positive = y > 0
        result = {"eval_split": split, "eval_examples": int(y.size)}
        result["eval_queries"] = int(positive.sum())
        index, first = np.zeros(0, np.int64), np.zeros(0, np.int64)
        if y.size:
            index, first = metrics_lib.distinct_rows([np.concatenate(c) for c in columns.values()])
        result["eval_candidates"] = int(first.size)
        result["eval_metrics"] = list(head.metric_names(config.task))
        if positive.any():
            q, c = np.concatenate(queries)[positive], np.concatenate(candidates)[first]
        for name in head.metric_names(config.task):
            k = int(name.partition("@")[2])
            value = metrics_lib.recall_at_k(q, c, index[positive], k) if positive.any() else np.nan
            result[name] = float(value)
        result["eval_bad_records"] = bad
        return result


    def check_bad_rows(self, examples: int, bad: int) -> None:
        """Raises DataError when the split's bad rows exceed `data.max_bad_fraction` of the
        rows read, naming the first one (training's check, `pipeline.check_bad_fraction`)."""
        data, split = self.config.data, self.split
        if not bad:
            return
        files = None if data.format == "synthetic" else data_lib.sources.expand(getattr(data, split), f"data.{split}")
        data_lib.pipeline.check_bad_fraction(self.config, examples, bad, files, f"data.{split}", "the evaluation")


def _candidate_keys(column, feature) -> np.ndarray:
    """One hashable key a row of a transformed candidate column: its value(s), a
    multi_hot's ids sorted (pooling reads them in no order), a sequence's in order."""
    if not isinstance(column, tf.RaggedTensor):
        return column.numpy()
    keys = np.empty(column.nrows(), object)
    ordered = isinstance(feature, SequenceFeature)
    keys[:] = [tuple(row if ordered else sorted(row)) for row in column.to_list()]
    return keys


def _warn_no_metric(config, head) -> None:
    """`task.metrics` lists none of a head's metrics (a multi-task model's other heads take
    them all): the head is not evaluated."""
    logger.warning(
        "task.metrics %s: task %r computes none of them, so it reports no metric (its metrics: %s)",
        list(config.task.metrics), head.name, ", ".join(sorted(head.metrics)),
    )


def _warn_one_class(config, label: str, split: str, y: np.ndarray) -> None:
    """A binary label whose every row of the split is one class: AUC is undefined, and when
    `data.positive` maps the label, its values most likely match none of the column's."""
    mapped = config.data.positive.get(label)
    hint = (
        f"; data.positive maps {list(mapped)} to 1: do they match the column's values?"
        if mapped is not None
        else ""
    )
    logger.warning(
        "label %r is %g in all %d %s rows: AUC is undefined%s", label, y[0], y.size, split, hint
    )


def _transform(config, ds):
    fn = lambda raw, labels, bad: (transform(config, raw), labels, bad)  # noqa: E731
    return finish(ds, fn)
