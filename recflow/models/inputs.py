"""What a model's forward pass takes: its columns, how it reads embedding rows, and
the names of the tower inputs that are not a feature itself.

A tower receives, besides one tensor per feature (named by the feature):

    mask_key(name)    [B, max_len] bool   which positions of sequence `name` hold an id
    linear_key(name)  [B, 1]              first-order weight of sparse feature `name`
                                          (models with `first_order = True`)

Example:
    >>> mask = inputs[mask_key("hist_items")]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tensorflow as tf

from recflow.config.schema import Feature
from recflow.embedding.engine import LINEAR_OUTPUT, MASK_OUTPUT
from recflow.features.transform import serving_dtype


def mask_key(name: str) -> str:
    """The tower input holding the mask of sequence feature `name`."""
    return name + MASK_OUTPUT


def linear_key(name: str) -> str:
    """The tower input holding the first-order weight of sparse feature `name`."""
    return name + LINEAR_OUTPUT


def feature_of(key: str) -> str:
    """The feature a tower input belongs to (`name` for `name`, `mask_key(name)`, `linear_key(name)`)."""
    for suffix in (MASK_OUTPUT, LINEAR_OUTPUT):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def empty_column(feature: Feature, batch: tf.Tensor) -> tf.Tensor:
    """A raw column of `batch` (shape `[1]`) empty values: -1 (int64), "" (string) or
    NaN (float32), in the feature's serving dtype."""
    dtype = serving_dtype(feature)
    value = {tf.int64: tf.constant(-1, tf.int64), tf.string: tf.constant("")}.get(
        dtype, tf.constant(float("nan"))
    )
    return tf.fill(batch, value)


@dataclass(frozen=True)
class Lookup:
    """How a forward pass (`RankingModel.forward`) reads embedding rows, and the form
    of the columns it is given: all that differs between its uses.

    Args:
        embed: sparse ids by feature name -> their tower inputs (embeddings, masks,
            first-order weights); `EmbeddingEngine.embed` reads the training tables.
        raw: the columns are raw (the serving form: one `[B]` tensor per feature,
            DESIGN.md section 6) and the pass runs the feature transforms. A feature
            without a column is looked up as empty (`empty_column`) and left out of
            the tower's inputs (a retrieval signature feeds one tower's features).
            False: the columns are transformed already (the input pipeline's form)
            and every feature has one.

    Example:
        >>> model.forward(raw, lookup=Lookup(model.embedding.embed, raw=True))
    """

    embed: Callable[[dict], dict]
    raw: bool = False
