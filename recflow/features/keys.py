"""Raw values -> int64 ids -> table keys, and back.

An id is 55 bits: strings are hashed with TensorFlow's stable 64-bit
fingerprint (masked), int64 values keep their low 55 bits. A table key packs
the slot of a logical table inside its physical table (8 bits) with the id,
`slot << 55 | id`, and then mixes that 63-bit value with a bijection (a
splitmix64-style finalizer restricted to 63 bits). Mixing makes small dense ids
(0, 1, 2, ...) and the slots of a fused table spread over every bit, so the
buckets of a `DenseHashTable` (which hashes an int64 key to itself) and the
shards of a placement stay even. `decode` inverts the mix exactly.

Keys are never negative, so -1 and -2 are free to mark the empty and deleted
buckets of a `DenseHashTable`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

ID_BITS = 55
ID_MASK = (1 << ID_BITS) - 1
MAX_SLOTS = 1 << (63 - ID_BITS)  # 256 logical tables per physical table
EMPTY_KEY = -1
DELETED_KEY = -2
# Version of the key format, kept in checkpoints: 2 = mixed keys (1 had `slot << 55 | id` as is).
KEY_FORMAT = 2

_BITS = 63
_MASK = (1 << _BITS) - 1
# splitmix64's multipliers, reduced to 63 bits (still odd, so invertible mod 2**63).
_MULTIPLIERS = (0xBF58476D1CE4E5B9 & _MASK, 0x94D049BB133111EB & _MASK)
_SHIFTS = (30, 27, 31)


def _inverse_mod_2_64(c: int) -> int:
    inverse = c  # Newton's iteration doubles the correct low bits each round
    for _ in range(6):
        inverse = (inverse * (2 - c * inverse)) & ((1 << 64) - 1)
    return inverse


_INVERSES = tuple(_inverse_mod_2_64(c) & _MASK for c in _MULTIPLIERS)


def string_ids(values: tf.Tensor) -> tf.Tensor:
    """Stable 55-bit ids of strings (the fingerprint64 of each string, masked)."""
    return tf.strings.to_hash_bucket_fast(values, 1 << ID_BITS)


def int_ids(values: tf.Tensor) -> tf.Tensor:
    """55-bit ids of int64 values."""
    return tf.bitwise.bitwise_and(tf.cast(values, tf.int64), ID_MASK)


def _mix(x: tf.Tensor) -> tf.Tensor:
    """The 63-bit bijection on non-negative int64 (computed in uint64, which wraps)."""
    x = tf.bitcast(x, tf.uint64)
    mask = tf.constant(_MASK, tf.uint64)

    def xorshift(v, s):
        return tf.bitwise.bitwise_xor(v, tf.bitwise.right_shift(v, tf.constant(s, tf.uint64)))

    x = xorshift(x, _SHIFTS[0])
    x = tf.bitwise.bitwise_and(x * tf.constant(_MULTIPLIERS[0], tf.uint64), mask)
    x = xorshift(x, _SHIFTS[1])
    x = tf.bitwise.bitwise_and(x * tf.constant(_MULTIPLIERS[1], tf.uint64), mask)
    x = xorshift(x, _SHIFTS[2])
    return tf.bitcast(x, tf.int64)


def encode(ids: tf.Tensor, slot: int) -> tf.Tensor:
    """Table keys of 55-bit ids read through logical table `slot`."""
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot must be in [0, {MAX_SLOTS}). Received: slot={slot}")
    if slot:
        ids = tf.bitwise.bitwise_or(ids, tf.constant(slot << ID_BITS, tf.int64))
    return _mix(ids)


def encode_parts(parts: list[tf.Tensor], slots: list[int]) -> tf.Tensor:
    """Table keys of several id vectors, `parts[i]` read through logical table `slots[i]`,
    concatenated: `concat([encode(p, s) for p, s in zip(parts, slots)])` in one mix."""
    for slot in slots:
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot must be in [0, {MAX_SLOTS}). Received: slot={slot}")
    if len(parts) == 1:
        return encode(parts[0], slots[0])
    ids = tf.concat(parts, axis=0)
    if any(slots):
        bits = tf.constant([s << ID_BITS for s in slots], tf.int64)
        sizes = tf.stack([tf.size(p, out_type=tf.int64) for p in parts])
        ids = tf.bitwise.bitwise_or(ids, tf.repeat(bits, sizes))
    return _mix(ids)


def _unxorshift(y: np.ndarray, s: int) -> np.ndarray:
    x = y.copy()
    for _ in range(_BITS // s + 1):
        x = y ^ (x >> np.uint64(s))
    return x


def decode(keys) -> tuple[np.ndarray, np.ndarray]:
    """Table keys (numpy or eager tensor) -> (slot, 55-bit id), both int64 numpy arrays."""
    x = np.asarray(keys, np.int64).astype(np.uint64)
    mask = np.uint64(_MASK)
    with np.errstate(over="ignore"):
        x = _unxorshift(x, _SHIFTS[2])
        x = (x * np.uint64(_INVERSES[1])) & mask
        x = _unxorshift(x, _SHIFTS[1])
        x = (x * np.uint64(_INVERSES[0])) & mask
        x = _unxorshift(x, _SHIFTS[0])
    x = x.astype(np.int64)
    return x >> ID_BITS, x & ID_MASK


def slot_of(keys) -> np.ndarray:
    """The logical-table slot of table keys (numpy)."""
    return decode(keys)[0]
