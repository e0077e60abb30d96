"""Names of the tower inputs that are not a feature itself.

A tower receives, besides one tensor per feature (named by the feature):

    mask_key(name)    [B, max_len] bool   which positions of sequence `name` hold an id
    linear_key(name)  [B, 1]              first-order weight of sparse feature `name`
                                          (models with `first_order = True`)

Example:
    >>> mask = inputs[mask_key("hist_items")]
"""

from __future__ import annotations

from recflow.embedding.engine import LINEAR_OUTPUT, MASK_OUTPUT


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
