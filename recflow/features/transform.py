"""Raw columns (the serving form of DESIGN.md section 6) -> model-ready features.

The same function runs in the training input pipeline and inside the exported
serving graph, so training and serving can never disagree on hashing,
splitting or normalization.

Output of `transform`, per feature name:

    categorical  int64 ids            [B]
    multi_hot    int64 ids, ragged    [B, (n)]
    sequence     int64 ids, ragged    [B, (<= max_len)]   (first max_len items)
    numeric      float32              [B, 1]                (normalized)
"""

from __future__ import annotations

import tensorflow as tf

from recflow.config.schema import (
    BucketizeNormalizer,
    Config,
    Feature,
    LogNormalizer,
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


def sparse_ids(feature: Feature, raw: tf.Tensor) -> tf.Tensor | tf.RaggedTensor:
    """Hashes / splits one sparse column into ids."""
    if feature.kind == "categorical":
        if feature.dtype == "string":
            raw = tf.strings.strip(raw)
        return _ids(raw, feature.dtype)
    tokens = tf.strings.split(raw, sep=feature.separator)
    tokens = tf.ragged.boolean_mask(tokens, tf.strings.length(tokens) > 0)
    if isinstance(feature, SequenceFeature):
        tokens = tokens[:, : feature.max_len]
    return tf.ragged.map_flat_values(_ids, tokens, feature.dtype)


def normalize(feature: NumericFeature, raw: tf.Tensor) -> tf.Tensor:
    """Fills missing (NaN) values with the default and applies the normalizer."""
    x = tf.cast(raw, tf.float32)
    x = tf.where(tf.math.is_nan(x), tf.constant(feature.default, tf.float32), x)
    norm = feature.normalizer
    if isinstance(norm, LogNormalizer):
        x = tf.math.log1p(tf.maximum(x, 0.0))
    elif isinstance(norm, StandardNormalizer):
        x = (x - norm.mean) / norm.std
    elif isinstance(norm, BucketizeNormalizer):
        bucket = tf.raw_ops.Bucketize(input=x, boundaries=list(norm.boundaries))
        x = tf.cast(bucket, tf.float32) / float(len(norm.boundaries))
    return tf.reshape(x, [-1, 1])


def transform(config: Config, raw: dict) -> dict:
    """Applies every feature's transform to a dict of raw columns."""
    out = {}
    for feature in config.features:
        column = raw[feature.name]
        if feature.kind == "numeric":
            out[feature.name] = normalize(feature, column)
        else:
            out[feature.name] = sparse_ids(feature, column)
    return out
