"""Raw values -> int64 ids -> table keys.

A table key is a non-negative int64: bits 55..62 hold the slot of the logical
table inside its physical table, bits 0..54 the id. Strings are hashed with
TensorFlow's stable 64-bit fingerprint; int64 ids are used as they are (their
low 55 bits). Keys are never negative, so -1 and -2 are free to mark empty and
deleted buckets of a `DenseHashTable`.
"""

from __future__ import annotations

import tensorflow as tf

ID_BITS = 55
ID_MASK = (1 << ID_BITS) - 1
MAX_SLOTS = 1 << (63 - ID_BITS)  # 256 logical tables per physical table
EMPTY_KEY = -1
DELETED_KEY = -2


def string_ids(values: tf.Tensor) -> tf.Tensor:
    """Stable 55-bit ids of strings (the fingerprint64 of each string, masked)."""
    return tf.strings.to_hash_bucket_fast(values, 1 << ID_BITS)


def int_ids(values: tf.Tensor) -> tf.Tensor:
    """55-bit ids of int64 values."""
    return tf.bitwise.bitwise_and(tf.cast(values, tf.int64), ID_MASK)


def encode(ids: tf.Tensor, slot: int) -> tf.Tensor:
    """Puts the slot of a logical table into the high bits of 55-bit ids."""
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot must be in [0, {MAX_SLOTS}). Received: slot={slot}")
    if slot == 0:
        return ids
    return tf.bitwise.bitwise_or(ids, tf.constant(slot << ID_BITS, tf.int64))


def slot_of(keys):
    """The slot of encoded keys (numpy or tensor)."""
    return keys >> ID_BITS
