"""`DinAttention` (alias `AttentionUnit`): DIN's local activation unit."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
import tf_keras as keras

from recflow.layers.dnn import DNN, build_sublayer, check_activation, check_units


@keras.saving.register_keras_serializable(package="recflow")
class DinAttention(keras.layers.Layer):
    """Attention pooling of a behaviour sequence against a candidate (DIN).

    For each step `t`, a small MLP scores
    `concat(q, k_t, q - k_t, q * k_t)`; the output is `sum_t w_t * k_t`.
    By default `w_t` is the raw score (the DIN paper uses no softmax); with
    `softmax=True`, `w` is a softmax over the valid steps. Masked steps get
    `w_t = 0`; a row with no valid step gives zeros (never NaN).

    Args:
        hidden_units: hidden sizes of the scoring MLP (default `[80, 40]`).
        activation: hidden activation of the MLP: "sigmoid" (default),
            "dice", or another Keras activation name.
        softmax: normalize the scores with a softmax over the valid steps.
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...).

    Input shape:
        `query`: `[batch, dim]`, the candidate item; `keys`: `[batch, T, dim]`,
        the behaviour sequence; `mask`: bool `[batch, T]`, true at valid steps
        (None: all valid).

        ```
        keys (T=4):   user 0: [i7, i3, i9, pad]   mask: [1, 1, 1, 0]
                      user 1: [i2, pad, pad, pad]       [1, 0, 0, 0]
        ```

    Output shape:
        `[batch, dim]`; with `return_attention_scores=True` also the weights
        `[batch, T]`.

    Example:

    >>> att = DinAttention(hidden_units=[16], softmax=True)
    >>> q, k = tf.ones([2, 8]), tf.ones([2, 4, 8])
    >>> mask = tf.constant([[True, True, True, False], [True, False, False, False]])
    >>> att(q, k, mask=mask).shape
    TensorShape([2, 8])
    """

    def __init__(
        self,
        hidden_units: Sequence[int] = (80, 40),
        activation: str = "sigmoid",
        softmax: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_units = check_units("hidden_units", hidden_units)
        self.activation = check_activation("activation", activation)
        if not isinstance(softmax, bool):
            raise ValueError(f"`softmax` must be a bool. Received: softmax={softmax!r}")
        self.softmax = softmax
        self.mlp = DNN(self.hidden_units, activation=self.activation, output_units=1, name="mlp")

    def build(self, input_shape):
        # Keras passes the shape of the first argument, `query` [batch, dim].
        shape = tf.TensorShape(input_shape)
        if shape.rank != 2 or shape[-1] is None:
            raise ValueError(
                "`DinAttention` expects `query` of shape [batch, dim] with a known dim. "
                f"Received: input_shape={input_shape}"
            )
        build_sublayer(self.mlp, [None, None, 4 * shape[-1]])
        super().build(input_shape)

    def call(self, query, keys, mask=None, training=None, return_attention_scores=False):
        queries = tf.broadcast_to(query[:, tf.newaxis, :], tf.shape(keys))
        features = tf.concat([queries, keys, queries - keys, queries * keys], axis=-1)
        scores = tf.squeeze(self.mlp(features, training=training), axis=-1)  # [B, T]
        if mask is None:
            mask = tf.ones_like(scores, dtype=tf.bool)
        mask = tf.cast(mask, tf.bool)
        if self.softmax:
            # The lowest finite value, not -inf: an all-masked row stays finite.
            scores = tf.where(mask, scores, scores.dtype.min)
            scores = tf.nn.softmax(scores, axis=-1)
        weights = tf.where(mask, scores, tf.zeros_like(scores))
        outputs = tf.einsum("bt,btd->bd", weights, keys)
        if return_attention_scores:
            return outputs, weights
        return outputs

    def compute_mask(self, inputs, mask=None):
        return None  # the time axis is pooled away

    def get_config(self):
        return {
            **super().get_config(),
            "hidden_units": list(self.hidden_units),
            "activation": self.activation,
            "softmax": self.softmax,
        }


AttentionUnit = DinAttention
