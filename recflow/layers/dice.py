"""`Dice`: the data-adaptive activation of DIN (Zhou et al., 2018)."""

from __future__ import annotations

import numbers

import tensorflow as tf
import tf_keras as keras


@keras.saving.register_keras_serializable(package="recflow")
class Dice(keras.layers.Layer):
    """Data-adaptive activation: a PReLU whose switch point follows the data.

    `p = sigmoid(BN(x))`, `out = p * x + (1 - p) * alpha * x`, where `BN` is a
    batch normalization over the last axis without scale or center, and
    `alpha` is a trainable per-channel weight initialised to 0. In training
    `BN` uses the batch statistics, in inference its moving averages.

    Args:
        epsilon: positive float added to the variance in `BN`.
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...).

    Input shape:
        Tensor `[batch, ..., dim]` (e.g. `[B, D]` or `[B, T, D]`), `dim` known.

    Output shape:
        Same as the input.

    Example:

    >>> Dice()(tf.ones([2, 5, 8]), training=True).shape
    TensorShape([2, 5, 8])
    """

    def __init__(self, epsilon: float = 1e-9, **kwargs):
        super().__init__(**kwargs)
        if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or epsilon <= 0:
            raise ValueError(f"`epsilon` must be a positive float. Received: epsilon={epsilon!r}")
        self.epsilon = float(epsilon)
        self.batch_norm = keras.layers.BatchNormalization(
            axis=-1, epsilon=self.epsilon, center=False, scale=False, name="batch_norm",
            dtype=self.dtype_policy,
        )  # fmt: skip

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if input_shape.rank is None or input_shape.rank < 2 or input_shape[-1] is None:
            raise ValueError(
                "`Dice` expects a tensor of rank >= 2 with a known last dimension. "
                f"Received: input_shape={input_shape}"
            )
        with tf.name_scope(self.batch_norm.name):
            self.batch_norm.build(input_shape)
        self.alpha = self.add_weight(
            name="alpha", shape=(input_shape[-1],), initializer="zeros", trainable=True
        )
        super().build(input_shape)

    def call(self, inputs, training=None):
        p = tf.sigmoid(self.batch_norm(inputs, training=training))
        return p * inputs + (1.0 - p) * self.alpha * inputs

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}
