"""`MaskedMeanPooling`: the mean of a sequence over its valid steps."""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras


@keras.saving.register_keras_serializable(package="recflow")
class MaskedMeanPooling(keras.layers.Layer):
    """Mean over the time axis of the steps where `mask` is true.

    A row with no valid step gives zeros (never NaN). Without a mask this is a
    plain mean over the time axis. A Keras mask carried by `values` (e.g. from
    `Embedding(mask_zero=True)`) is used when no `mask` is passed.

    Args:
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...).

    Input shape:
        `values`: `[batch, T, dim]`; `mask`: bool `[batch, T]` (or 0/1).

    Output shape:
        `[batch, dim]`.

    Example:

    >>> values = tf.constant([[[1.0], [3.0], [9.0]]])  # batch of 1, T=3, dim=1
    >>> mask = tf.constant([[True, True, False]])
    >>> MaskedMeanPooling()(values, mask=mask).numpy()  # (1 + 3) / 2
    array([[2.]], dtype=float32)
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, values, mask=None):
        if mask is None:
            return tf.reduce_mean(values, axis=1)
        weights = tf.cast(mask, values.dtype)[..., tf.newaxis]
        total = tf.reduce_sum(values * weights, axis=1)
        count = tf.reduce_sum(weights, axis=1)
        return tf.math.divide_no_nan(total, count)

    def compute_mask(self, inputs, mask=None):
        return None  # the time axis is pooled away
