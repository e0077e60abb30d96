"""Raw columns (their serving form: one raw value per row) -> model-ready features.

The same function runs in the training input pipeline and inside the exported
serving graph, so training and serving can never disagree on hashing,
splitting or normalization. Each feature's kind does its own part
(`recflow.features.kinds`); the built-in kinds give, per feature name:

    categorical  int64 ids            [B]
    multi_hot    int64 ids, ragged    [B, (<= max_values)]  (first max_values items)
    sequence     int64 ids, ragged    [B, (<= max_len)]   (first max_len items)
    numeric      float32              [B, 1]                (normalized)
"""

from __future__ import annotations

import tensorflow as tf

from recflow.config.schema import Config, Feature
from recflow.features.kinds import kind_of


def serving_dtype(feature: Feature) -> tf.DType:
    """The dtype of a feature's raw column in the serving signature."""
    return kind_of(feature).serving_dtype


def sparse_ids(
    feature: Feature, raw: tf.Tensor, counts: dict | None = None
) -> tf.Tensor | tf.RaggedTensor:
    """Hashes / splits one sparse column into ids.

    A multi_hot row keeps its first `max_values` values; with `counts`, the number
    of rows cut is added to `counts["truncated"]`.
    """
    return kind_of(feature).transform(raw, counts)


def transform(config: Config, raw: dict, counts: dict | None = None) -> dict:
    """Applies every feature's transform to a dict of raw columns.

    With `counts`, adds `counts["truncated"]`: multi_hot rows cut to `max_values`.
    """
    return {f.name: kind_of(f).transform(raw[f.name], counts) for f in config.features}
