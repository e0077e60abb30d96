"""Raw columns (their serving form: one raw value per row) -> model-ready features.

The same function runs in the training input pipeline and inside the exported
serving graph, so training and serving can never disagree on hashing,
splitting or normalization.

Output of `transform`, per feature name:

    categorical  int64 ids            [B]
    multi_hot    int64 ids, ragged    [B, (<= max_values)]  (first max_values items)
    sequence     int64 ids, ragged    [B, (<= max_len)]   (first max_len items)
    numeric      float32              [B, 1]                (normalized)
"""

from __future__ import annotations

import tensorflow as tf

from recflow.config.schema import (
    AutoNormalizer,
    BucketizeNormalizer,
    Config,
    Feature,
    LogNormalizer,
    MultiHotFeature,
    NumericFeature,
    SequenceFeature,
    StandardNormalizer,
)
from recflow.features.keys import int_ids, string_ids


def serving_dtype(feature: Feature) -> tf.DType:
    """The dtype of a feature's raw column in the serving signature."""
    if feature.kind == "numeric":
        return tf.float32
    if feature.kind == "categorical" and feature.dtype == "int64":
        return tf.int64
    return tf.string


def _ids(values: tf.Tensor, dtype: str) -> tf.Tensor:
    if dtype == "string":
        return string_ids(values)
    if values.dtype == tf.string:
        values = tf.strings.to_number(values, tf.int64)
    return int_ids(values)


def sparse_ids(
    feature: Feature, raw: tf.Tensor, counts: dict | None = None
) -> tf.Tensor | tf.RaggedTensor:
    """Hashes / splits one sparse column into ids.

    A multi_hot row keeps its first `max_values` values; with `counts`, the number
    of rows cut is added to `counts["truncated"]`.
    """
    if feature.kind == "categorical":
        if feature.dtype == "string":
            raw = tf.strings.strip(raw)
        return _ids(raw, feature.dtype)
    tokens = tf.strings.split(raw, sep=feature.separator)
    tokens = tf.ragged.boolean_mask(tokens, tf.strings.length(tokens) > 0)
    limit = feature.max_len if isinstance(feature, SequenceFeature) else feature.max_values
    if isinstance(feature, MultiHotFeature) and counts is not None:
        cut = tf.reduce_sum(tf.cast(tokens.row_lengths() > limit, tf.int64))
        counts["truncated"] = counts.get("truncated", 0) + cut
    tokens = tokens[:, :limit]
    return tf.ragged.map_flat_values(_ids, tokens, feature.dtype)


def neutral_default(feature: NumericFeature) -> float | None:
    """The raw value a missing number takes, or None: missing reads as normalized 0
    (the mean, under `standard`)."""
    if feature.default is not None:
        return feature.default
    if isinstance(feature.normalizer, StandardNormalizer):
        return None
    return 0.0


def normalize(feature: NumericFeature, raw: tf.Tensor) -> tf.Tensor:
    """Applies the normalizer; a missing or non-finite value takes the feature's
    `default` (raw units), or without one the neutral value (see `neutral_default`)."""
    x = tf.cast(raw, tf.float32)
    missing = ~tf.math.is_finite(x)
    default = neutral_default(feature)
    x = tf.where(missing, tf.constant(0.0 if default is None else default, tf.float32), x)
    norm = feature.normalizer
    if isinstance(norm, LogNormalizer):
        x = tf.math.log1p(tf.maximum(x, 0.0))
    elif isinstance(norm, StandardNormalizer):
        if norm.log1p:
            x = tf.math.log1p(tf.maximum(x, 0.0))
        x = (x - norm.mean) / norm.std
        if default is None:
            x = tf.where(missing, tf.zeros_like(x), x)
    elif isinstance(norm, BucketizeNormalizer):
        bucket = tf.raw_ops.Bucketize(input=x, boundaries=list(norm.boundaries))
        x = tf.cast(bucket, tf.float32) / float(len(norm.boundaries))
    elif isinstance(norm, AutoNormalizer):
        raise ValueError(
            f"feature '{feature.name}': normalizer 'auto' must be resolved before use "
            "(recflow.features.fit.resolve_auto)"
        )
    return tf.reshape(x, [-1, 1])


def transform(config: Config, raw: dict, counts: dict | None = None) -> dict:
    """Applies every feature's transform to a dict of raw columns.

    With `counts`, adds `counts["truncated"]`: multi_hot rows cut to `max_values`.
    """
    out = {}
    for feature in config.features:
        column = raw[feature.name]
        if feature.kind == "numeric":
            out[feature.name] = normalize(feature, column)
        else:
            out[feature.name] = sparse_ids(feature, column, counts)
    return out
