"""One transfer per parameter server and direction for a step's per-table tensors.

Under TF's gRPC runtime every tensor that crosses processes is one RecvTensor RPC
(with its serialization on both ends), whatever its size: a fused step of T
physical tables would send each PS task 2T key tensors, receive T embedding
matrices and send T gradients. The engine packs them per PS task instead: keys
and counts in one int64 vector (`send_ints`), embeddings or gradients in one
float32 vector (`pack` where they are made, `unpack` where they are used). In
one process nothing is packed.
"""

from __future__ import annotations

import tensorflow as tf


def send_ints(parts: list[tf.Tensor], device: str) -> list[tf.Tensor]:
    """Integer tensors made here (vectors, or matrices of a static width such as table
    keys [n, 2]), as they arrive on `device` (one int64 transfer)."""
    n = len(parts)
    sizes = tf.stack([tf.size(p, out_type=tf.int64) for p in parts])
    wire = tf.concat([sizes] + [tf.reshape(tf.cast(p, tf.int64), [-1]) for p in parts], 0)
    with tf.device(device):
        pieces = tf.split(wire[n:], tf.reshape(wire[:n], [n]), num=n)
        return [
            tf.reshape(tf.cast(piece, p.dtype), [-1] + p.shape[1:].as_list())
            for piece, p in zip(pieces, parts)
        ]


def pack(tensors: list[tf.Tensor]) -> tf.Tensor:
    """float32 tensors (of any shape) as one vector (call it on the sending device)."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def unpack(flat: tf.Tensor, rows: list[tf.Tensor], widths: list[int]) -> list[tf.Tensor]:
    """The matrices of `pack`, from their row counts as the receiving device knows them
    (call it on that device): only the values cross."""
    sizes = tf.stack([tf.cast(r, tf.int64) * w for r, w in zip(rows, widths)])
    pieces = tf.split(flat, sizes, num=len(widths))
    return [tf.reshape(p, [-1, w]) for p, w in zip(pieces, widths)]
