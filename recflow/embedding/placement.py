"""Shard placement: which shard (parameter server) holds a key."""

from __future__ import annotations

import abc
import contextlib

import tensorflow as tf

from recflow.features.keys import mixed

SHARD_SHIFT = 32  # shards from the high bits of a key, buckets from the low ones


class Placement(abc.ABC):
    """Maps keys to shards and shards to devices."""

    def __init__(self, num_shards: int):
        if num_shards < 1:
            raise ValueError(f"`num_shards` must be a positive integer. Received: {num_shards}")
        self.num_shards = num_shards

    @abc.abstractmethod
    def shard_of(self, keys: tf.Tensor) -> tf.Tensor:
        """int32 shard index [n] of each table key [n, 2]."""

    @abc.abstractmethod
    def device(self, shard: int) -> str | None:
        """The device that holds `shard` (None: the current device)."""


class ModPlacement(Placement):
    """Shard = (mixed >> 32) mod num_shards; shard i on PS task i (or locally).

    `mixed` is the key's mixed id, fmix64(id + slot * GOLDEN) (`recflow.features.keys`),
    even over all 64 bits, so the modulo (floor modulo of the arithmetic shift,
    in [0, num_shards)) spreads keys evenly. It reads the high bits: a shard's
    segments take bits 47..62 and its buckets spread by a hash of the whole key.
    """

    def __init__(self, num_shards: int = 1, ps_devices: list[str] | None = None):
        super().__init__(num_shards)
        if ps_devices is not None and len(ps_devices) != num_shards:
            raise ValueError("`ps_devices` must have one device per shard")
        self.ps_devices = ps_devices

    def shard_of(self, keys: tf.Tensor) -> tf.Tensor:
        high = tf.bitwise.right_shift(mixed(keys), tf.constant(SHARD_SHIFT, keys.dtype))
        return tf.cast(tf.math.floormod(high, self.num_shards), tf.int32)

    def device(self, shard: int) -> str | None:
        return self.ps_devices[shard] if self.ps_devices else None


class _Anchor:
    """What `ParameterServerStrategy` colocates a new variable with: only its device."""

    def __init__(self, device: str):
        self.device = device
        self.name = device


@contextlib.contextmanager
def variables_on(device: str | None):
    """Variables created inside live on `device` (None: where they would anyway).

    `ParameterServerStrategy` places each new variable on the next PS task, round
    robin, whatever the device scope; it does honour a colocation request, which
    is how a shard's variables are kept on its own PS task.
    """
    if device is None:
        yield
        return
    anchor = _Anchor(device)

    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = anchor  # read by the PS strategy, ignored otherwise
        return next_creator(**kwargs)

    with tf.device(device), tf.variable_creator_scope(creator):
        yield
