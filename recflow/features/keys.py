"""Raw values -> int64 ids -> table keys, and back.

An id is a whole int64: an int64 value as it is, a string's 64-bit FarmHash
fingerprint (`Fingerprint64`, the hash `tf.strings.to_hash_bucket_fast` reduces)
bit-cast to int64. Nothing is masked: two distinct int64 ids of a feature never
share a row, over the whole int64 range.

A table key is a pair of int64s, `(slot, mixed)`: `slot` is the logical table
inside its physical table (>= 0) and `mixed = fmix64(id + slot * GOLDEN)`, where
fmix64 is MurmurHash3's 64-bit finalizer, a bijection on 64 bits. For one slot,
id -> mixed is a bijection, so distinct (slot, id) pairs always get distinct
keys and `decode` recovers the id exactly. A `DenseHashTable` with vector keys
(key shape [2], from its `empty_key`) holds them; `(-1, -1)` and `(-2, -2)`,
impossible since slots are >= 0, mark its empty and deleted buckets.

Mixing spreads small dense ids (0, 1, 2, ...) of every slot over all 64 bits of
`mixed`, which the shard placement and a shard's segments read (even shards and
segments), and it lets `unique_ids` find a batch's distinct keys with one
1-D unique over `mixed` (a 2-D unique is ~10x slower here).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

KEY_WIDTH = 2  # (slot, mixed id)
EMPTY_KEY = (-1, -1)
DELETED_KEY = (-2, -2)
# Logical tables per physical table: a bound on one fused chain for the planner. The key
# itself takes any slot in [0, 2**63): it is a whole int64 column.
MAX_SLOTS = 256
# Version of the key format, kept in checkpoints. 1: `slot << 55 | id`; 2: a 63-bit mix of
# that (ids cut to 55 bits); 3: (slot, fmix64(id + slot * GOLDEN)), every int64 id exact.
KEY_FORMAT = 3

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: each slot's offset is a multiple of it
_MULTIPLIERS = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)  # fmix64's (odd: invertible mod 2**64)
_SHIFT = 33  # x ^ (x >> 33) is its own inverse on 64 bits


def _inverse_mod_2_64(c: int) -> int:
    inverse = c  # Newton's iteration doubles the correct low bits each round
    for _ in range(6):
        inverse = (inverse * (2 - c * inverse)) & ((1 << 64) - 1)
    return inverse


_INVERSES = tuple(_inverse_mod_2_64(c) for c in _MULTIPLIERS)


def string_ids(values: tf.Tensor) -> tf.Tensor:
    """Stable 64-bit ids of strings (rank 1): their `Fingerprint64`, bit-cast to int64."""
    return tf.reshape(tf.bitcast(tf.fingerprint(values), tf.int64), [-1])


def int_ids(values: tf.Tensor) -> tf.Tensor:
    """Ids of int64 values: the values themselves."""
    return tf.cast(values, tf.int64)


def _uint(value: int) -> tf.Tensor:
    return tf.constant(value, tf.uint64)


def _xorshift(x: tf.Tensor) -> tf.Tensor:
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _uint(_SHIFT)))


def _mix(ids: tf.Tensor, slots: tf.Tensor) -> tf.Tensor:
    """fmix64(id + slot * GOLDEN) on int64 tensors (computed in uint64, which wraps)."""
    x = tf.bitcast(ids, tf.uint64) + tf.bitcast(slots, tf.uint64) * _uint(_GOLDEN)
    x = _xorshift(x)
    x = _xorshift(x * _uint(_MULTIPLIERS[0]))
    x = _xorshift(x * _uint(_MULTIPLIERS[1]))
    return tf.bitcast(x, tf.int64)


def _unmix(mixed: tf.Tensor, slots: tf.Tensor) -> tf.Tensor:
    """The inverse of `_mix` for known slots: the ids."""
    x = _xorshift(tf.bitcast(mixed, tf.uint64))
    x = _xorshift(x * _uint(_INVERSES[1]))
    x = _xorshift(x * _uint(_INVERSES[0]))
    return tf.bitcast(x - tf.bitcast(slots, tf.uint64) * _uint(_GOLDEN), tf.int64)


def _check_slot(slot: int) -> None:
    if not 0 <= slot < 2**63:
        raise ValueError(f"slot must be a non-negative int64. Received: slot={slot}")


def encode(ids: tf.Tensor, slot: int) -> tf.Tensor:
    """Table keys [n, 2] of int64 ids [n] read through logical table `slot`."""
    _check_slot(slot)
    slots = tf.fill(tf.shape(ids), tf.constant(slot, tf.int64))
    return tf.stack([slots, _mix(ids, slots)], axis=1)


def mixed(keys: tf.Tensor) -> tf.Tensor:
    """The mixed ids [n] of table keys [n, 2]: even over all 64 bits (placement, segments)."""
    return columns(keys)[1]


def columns(keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(slots [n], mixed ids [n]) of table keys [n, 2], also of an unknown shape: one op
    (eagerly 25 us, against about 100 for each column sliced out)."""
    slots, mixed_ids = tf.unstack(keys, num=KEY_WIDTH, axis=1)
    return slots, mixed_ids


def unique_ids(parts: list[tf.Tensor], slots: list[int]):
    """The distinct table keys of several id vectors, `parts[i]` read through logical table
    `slots[i]`: `unique_with_counts(concat([encode(p, s) for p, s in zip(parts, slots)]))`,
    without building the keys of every id (only the distinct ones)."""
    for slot in slots:
        _check_slot(slot)
    ids = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
    if len(set(slots)) == 1:
        column = tf.constant(slots[0], tf.int64)
        values, index, counts = tf.unique_with_counts(_mix(ids, column))
        return tf.stack([tf.fill(tf.shape(values), column), values], axis=1), index, counts
    column = slot_column(parts, slots)
    return _unique(column, _mix(ids, column))


def slot_column(parts: list[tf.Tensor], slots: list[int]) -> tf.Tensor:
    """The slot of every id of `concat(parts)`, `slots[i]` for those of `parts[i]` [n] int64.

    Each id takes the slot of the first part that ends after it: a handful of ops, where
    `tf.repeat` of the slots by the part sizes builds about 50 (each traced function that
    reads several logical tables had a few of them)."""
    ends = tf.cumsum(tf.stack([tf.size(p, out_type=tf.int64) for p in parts]))
    part = tf.raw_ops.UpperBound(
        sorted_inputs=ends[None], values=tf.range(ends[-1])[None], out_type=tf.int64
    )
    return tf.gather(tf.constant(slots, tf.int64), tf.reshape(part, [-1]))


def unique_with_counts(keys: tf.Tensor, one_slot: bool = False):
    """(distinct keys [U, 2], position in them of each key [n] int32, counts [U] int32).

    Args:
        keys: table keys [n, 2].
        one_slot: every key has the same slot (a physical table of one logical table).
    """
    if one_slot:  # the mixed id is a bijection of the id: a 1-D unique is exact
        values, index, counts = tf.unique_with_counts(mixed(keys))
        return tf.stack([keys[: tf.size(values), 0], values], axis=1), index, counts
    return _unique(*columns(keys))


def _unique(column: tf.Tensor, mixed_ids: tf.Tensor):
    """`unique_with_counts` of the keys `(column[i], mixed_ids[i])`, slots of several tables.

    One 1-D unique over the mixed ids finds the distinct keys: for one slot the
    mixed id is a bijection of the id, so it is exact. Keys of several slots can
    share a mixed id (for random ids, two given keys with probability 2**-64), so
    every key's slot is compared with its group's; a mismatch (never seen in
    practice) redoes the unique over whole keys, which is exact and ~10x slower.
    Either way the distinct keys come in the order of their first occurrence.
    """
    values, index, counts = tf.unique_with_counts(mixed_ids)
    slots = tf.math.unsorted_segment_max(column, index, tf.size(values))
    exact = tf.reduce_all(tf.equal(tf.gather(slots, index), column))

    def whole_keys():
        keys = tf.stack([column, mixed_ids], axis=1)
        y, idx, count = tf.raw_ops.UniqueWithCountsV2(x=keys, axis=[0])
        return tf.reshape(y, [-1, KEY_WIDTH]), idx, count

    return tf.cond(exact, lambda: (tf.stack([slots, values], axis=1), index, counts), whole_keys)


def unique(keys: tf.Tensor, one_slot: bool = False):
    """(distinct keys [U, 2], position in them of each key [n] int32); see `unique_with_counts`."""
    distinct, index, _ = unique_with_counts(keys, one_slot)
    return distinct, index


def raw_keys(keys: tf.Tensor) -> tf.Tensor:
    """Table keys [n, 2] -> (slot, raw id) pairs [n, 2] (what an export's tables hold)."""
    slots, mixed_ids = columns(keys)
    return tf.stack([slots, _unmix(mixed_ids, slots)], axis=1)


def decode(keys) -> tuple[np.ndarray, np.ndarray]:
    """Table keys [n, 2] (numpy or eager tensor) -> (slot, raw id), both int64 numpy arrays."""
    keys = tf.reshape(tf.convert_to_tensor(np.asarray(keys, np.int64)), [-1, KEY_WIDTH])
    raw = raw_keys(keys).numpy()
    return raw[:, 0], raw[:, 1]


def slot_of(keys) -> np.ndarray:
    """The logical-table slot of table keys [n, 2] (numpy)."""
    return np.asarray(keys, np.int64).reshape(-1, KEY_WIDTH)[:, 0]
