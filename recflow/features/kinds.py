"""Feature kinds and their registry: how one kind's raw column becomes model inputs.

A kind is two halves that `register_feature_kind` joins: its config dataclass
(`config_class`, a `recflow.config.schema.Feature` subclass: the keys of the
feature's mapping, and how its column is read, without TensorFlow) and a
`FeatureKind` whose `transform` turns the raw column (its serving form) into the
model's input: int64 ids (`[B]`, or ragged `[B, (n)]` for several per row) for a
sparse kind, float32 `[B, n]` for a dense one. The same transform runs in the input
pipeline and inside the export, so training and serving cannot disagree.

A kind of the user's own module is usable unregistered as
`kind: "package.module:ClassName"`.
"""

from __future__ import annotations

from typing import ClassVar

import tensorflow as tf

from recflow.config import model_module
from recflow.config.convert import register_choice
from recflow.config.schema import (
    AutoNormalizer,
    BucketizeNormalizer,
    CategoricalFeature,
    Feature,
    LogNormalizer,
    MultiHotFeature,
    NumericFeature,
    SequenceFeature,
    StandardNormalizer,
)
from recflow.features.keys import int_ids, string_ids

_KINDS: dict[str, type[FeatureKind]] = {}


def register_feature_kind(name: str):
    """Class decorator: makes a `FeatureKind` subclass available as `kind: name`.

    Its `config_class` (with a `kind` field) becomes the schema of such a feature.
    """

    def wrap(cls):
        # checked on a copy first: nothing is registered unless its config class is too
        model_module.register(dict(_KINDS), name, cls, FeatureKind, "feature kind")
        register_choice(Feature, name, cls.config_class)
        _KINDS[name] = cls
        return cls

    return wrap


def kind_of(feature: Feature) -> FeatureKind:
    """The kind of a feature, bound to it."""
    cls = _KINDS.get(feature.kind)
    if cls is None:
        cls = model_module.import_class(feature.kind, f"feature {feature.name!r} kind", FeatureKind)
    return cls(feature)


class FeatureKind:
    """Base of the feature kinds.

    Args:
        feature: the feature's config, an instance of `config_class`.

    A subclass sets `config_class` and implements `transform`.
    """

    config_class: ClassVar[type] = Feature

    def __init__(self, feature: Feature):
        if not isinstance(feature, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {feature!r}")
        self.feature = feature

    @property
    def serving_dtype(self) -> tf.DType:
        """The dtype of the raw column in the serving signature (from `read_as`)."""
        return {"int64": tf.int64, "string": tf.string, "float": tf.float32}[self.feature.read_as]

    def transform(self, raw: tf.Tensor, counts: dict | None = None):
        """The raw column `[B]` -> the model's input.

        Args:
            raw: `[B]` of `serving_dtype` (a float column holds NaN where a value is missing).
            counts: when given, add rows cut to `value_limit` to `counts["truncated"]`.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `transform`")


def ids(values: tf.Tensor, dtype: str) -> tf.Tensor:
    """Raw ids (strings, or int64 / their decimal text) -> int64 ids (`recflow.features.keys`)."""
    if dtype == "string":
        return string_ids(values)
    if values.dtype == tf.string:
        values = tf.strings.to_number(values, tf.int64)
    return int_ids(values)


@register_feature_kind("categorical")
class Categorical(FeatureKind):
    config_class = CategoricalFeature

    def transform(self, raw, counts=None):
        if self.feature.dtype == "string":
            raw = tf.strings.strip(raw)
        return ids(raw, self.feature.dtype)


class _MultiValued(FeatureKind):
    """Separator-joined ids: a row keeps its first `value_limit` values, each stripped of
    surrounding spaces (as a categorical id is, and as a CSV field is in training: in
    `" x| y "` the ids are `x` and `y` in every reader and in the serving graph)."""

    count_truncated: ClassVar[bool] = False

    def transform(self, raw, counts=None):
        f = self.feature
        tokens = tf.strings.strip(tf.strings.split(raw, sep=f.value_separator))
        tokens = tf.ragged.boolean_mask(tokens, tf.strings.length(tokens) > 0)
        limit = f.value_limit
        if self.count_truncated and counts is not None:
            cut = tf.reduce_sum(tf.cast(tokens.row_lengths() > limit, tf.int64))
            counts["truncated"] = counts.get("truncated", 0) + cut
        return tf.ragged.map_flat_values(ids, tokens[:, :limit], f.dtype)


@register_feature_kind("multi_hot")
class MultiHot(_MultiValued):
    config_class = MultiHotFeature
    count_truncated = True  # a set cut short is data lost: counted as `truncated_rows`


@register_feature_kind("sequence")
class Sequence(_MultiValued):
    config_class = SequenceFeature  # a history keeps its first `max_len` ids by design


@register_feature_kind("numeric")
class Numeric(FeatureKind):
    config_class = NumericFeature

    def transform(self, raw, counts=None):
        return normalize(self.feature, raw)


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
            "(recflow.data.fit.resolve_auto)"
        )
    return tf.reshape(x, [-1, 1])
