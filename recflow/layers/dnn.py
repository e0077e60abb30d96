"""`DNN`: a multi-layer perceptron, plus the argument checks the layers share."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import tensorflow as tf
import tf_keras as keras

from recflow.config import limits
from recflow.layers.dice import Dice

# The Keras dtype policies a `DNN` computes in; its weights are float32 in each, so the
# choice is no part of a model's identity (`recflow.models.identity`).
DTYPES = ("float32", "mixed_bfloat16")


def check_positive_int(name: str, value) -> int:
    """Returns `value` as an int, or raises `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def check_units(name: str, value) -> list[int]:
    """Returns `value` as a list of positive ints, or raises `ValueError`."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(
            f"`{name}` must be a list of positive integers. Received: {name}={value!r}"
        )
    try:
        return [check_positive_int(name, u) for u in value]
    except ValueError:
        raise ValueError(
            f"`{name}` must be a list of positive integers. Received: {name}={value!r}"
        ) from None


def check_activation(name: str, value) -> str:
    """Returns `value` if it is "dice" or a Keras activation name."""
    message = f"`{name}` must be 'dice' or a Keras activation name. Received: {name}={value!r}"
    if not isinstance(value, str):
        raise ValueError(message)
    if value != "dice":
        try:
            keras.activations.get(value)
        except ValueError:
            raise ValueError(message) from None
    return value


def check_weights_fit(
    layer: str, hidden_units: Sequence[int], output_units: int | None, in_dim: int | None = None
) -> None:
    """Raises `MemoryLimitError` when the kernels of the `Dense` layers of `hidden_units`
    (then `output_units`) after `in_dim` inputs (1 or more when not known yet) cannot
    fit in this machine's memory.

    Each weight takes 8 bytes in training (its float32 value and gradient); counting
    the kernels only, the bound never refuses a stack that could fit
    (`recflow.config.limits`).
    """
    sizes = [in_dim or 1, *hidden_units, *([output_units] if output_units else [])]
    weights = sum(a * b for a, b in zip(sizes, sizes[1:]))
    reason = limits.beyond_memory(8 * weights)
    if reason is not None:
        inputs = f" after {in_dim} inputs" if in_dim else ""
        raise limits.MemoryLimitError(
            f"layer {layer!r}: `hidden_units` needs {weights:.3g} float32 weights{inputs}, with their gradients "
            f"{reason}. Received: hidden_units={list(hidden_units)!r}"
        )


def build_sublayer(layer: keras.layers.Layer, input_shape) -> None:
    """Builds `layer` under its own name scope, so its weights are named after it."""
    with tf.name_scope(layer.name):
        layer.build(input_shape)


@keras.saving.register_keras_serializable(package="recflow")
class DNN(keras.layers.Layer):
    """Multi-layer perceptron: `Dense -> [BatchNorm] -> activation -> [Dropout]` per layer.

    Args:
        hidden_units: sizes of the hidden layers, e.g. `[256, 128]` (may be
            empty: then only the output layer, if any, is applied).
        activation: hidden activation: a Keras activation name ("relu",
            "sigmoid", ...) or "dice" for `Dice`.
        dropout: dropout rate in `[0, 1)` after each hidden activation; only
            active in training.
        use_batch_norm: batch-normalize each hidden layer before its
            activation (the hidden `Dense` then has no bias).
        l2: L2 penalty (>= 0) on every kernel; 0 for none.
        output_units: if set, a final linear `Dense(output_units)` with no
            activation.
        dtype: "float32" (the default: the global Keras policy), or
            "mixed_bfloat16": the hidden layers compute in bfloat16, their weights
            stay float32 (Keras mixed precision); the output layer computes in
            float32. On CPUs with bfloat16 matrix units (AMX, AVX512-BF16) the
            matmuls run about twice as fast; elsewhere they are emulated and slower.
            (float16 would need loss scaling, which recflow's loop does not do.)
        **kwargs: base `Layer` arguments (`name`, ...).

    Input shape:
        Tensor `[batch, ..., in_dim]`.

    Output shape:
        `[batch, ..., units]` float32: `units` is `output_units` if set, else
        `hidden_units[-1]`, else `in_dim`.

    Example:

    >>> mlp = DNN([64, 32], dropout=0.1, output_units=1)
    >>> mlp(tf.ones([8, 20])).shape
    TensorShape([8, 1])
    """

    _ARGUMENTS = ("hidden_units", "activation", "dropout", "use_batch_norm", "l2", "output_units", "dtype")

    def __init__(
        self,
        hidden_units: Sequence[int],
        activation: str = "relu",
        dropout: float = 0.0,
        use_batch_norm: bool = False,
        l2: float = 0.0,
        output_units: int | None = None,
        **kwargs,
    ):
        try:
            super().__init__(**kwargs)
        except TypeError as e:  # Keras: ('Keyword argument not understood:', 'foo')
            if len(e.args) != 2 or not str(e.args[0]).startswith("Keyword argument not understood"):
                raise
            allowed = ", ".join(self._ARGUMENTS)
            raise TypeError(
                f"unknown argument {e.args[1]!r} of DNN (its arguments: {allowed})"
            ) from None
        if self.dtype_policy.name not in DTYPES:
            raise ValueError(
                f"`dtype` must be one of {', '.join(DTYPES)}. "
                f"Received: dtype={self.dtype_policy.name!r}"
            )
        self.hidden_units = check_units("hidden_units", hidden_units)
        self.activation = check_activation("activation", activation)
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, numbers.Real)
            or not 0 <= dropout < 1
        ):
            raise ValueError(f"`dropout` must be a float in [0, 1). Received: dropout={dropout!r}")
        if not isinstance(use_batch_norm, bool):
            raise ValueError(
                f"`use_batch_norm` must be a bool. Received: use_batch_norm={use_batch_norm!r}"
            )
        if isinstance(l2, bool) or not isinstance(l2, numbers.Real) or l2 < 0:
            raise ValueError(f"`l2` must be a float >= 0. Received: l2={l2!r}")
        if output_units is not None:
            output_units = check_positive_int("output_units", output_units)
        check_weights_fit(self.name, self.hidden_units, output_units)
        self.dropout = float(dropout)
        self.use_batch_norm = use_batch_norm
        self.l2 = float(l2)
        self.output_units = output_units

        regularizer = keras.regularizers.L2(self.l2) if self.l2 > 0 else None
        n = len(self.hidden_units)
        hidden = self.dtype_policy  # the hidden layers compute in the DNN's dtype
        self.dense_layers = [
            keras.layers.Dense(
                u, use_bias=not use_batch_norm, kernel_regularizer=regularizer, name=f"dense_{i}",
                dtype=hidden,
            )  # fmt: skip
            for i, u in enumerate(self.hidden_units)
        ]
        self.norm_layers = (
            [keras.layers.BatchNormalization(name=f"batch_norm_{i}", dtype=hidden) for i in range(n)]
            if use_batch_norm
            else []
        )
        self.activation_layers = [
            Dice(name=f"dice_{i}", dtype=hidden)
            if activation == "dice"
            else keras.layers.Activation(activation, name=f"activation_{i}", dtype=hidden)
            for i in range(n)
        ]
        self.dropout_layers = (
            [keras.layers.Dropout(self.dropout, name=f"dropout_{i}", dtype=hidden) for i in range(n)]
            if self.dropout > 0
            else []
        )
        self.output_layer = (
            keras.layers.Dense(output_units, kernel_regularizer=regularizer, name="output", dtype="float32")
            if output_units is not None
            else None
        )

    def build(self, input_shape):
        shape = tf.TensorShape(input_shape)
        if shape.rank is None or shape.rank < 2 or shape[-1] is None:
            raise ValueError(
                "`DNN` expects a tensor of rank >= 2 with a known last dimension. "
                f"Received: input_shape={input_shape}"
            )
        check_weights_fit(self.name, self.hidden_units, self.output_units, in_dim=int(shape[-1]))
        for i, dense in enumerate(self.dense_layers):
            build_sublayer(dense, shape)
            shape = shape[:-1].concatenate([dense.units])
            if self.norm_layers:
                build_sublayer(self.norm_layers[i], shape)
            build_sublayer(self.activation_layers[i], shape)
        if self.output_layer is not None:
            build_sublayer(self.output_layer, shape)
        super().build(input_shape)

    def call(self, inputs, training=None):
        x = inputs
        for i, dense in enumerate(self.dense_layers):
            x = dense(x)
            if self.norm_layers:
                x = self.norm_layers[i](x, training=training)
            x = self.activation_layers[i](x, training=training)
            if self.dropout_layers:
                x = self.dropout_layers[i](x, training=training)
        if self.output_layer is not None:
            x = self.output_layer(x)
        return tf.cast(x, tf.float32)

    def get_config(self):
        return {
            **super().get_config(),
            "hidden_units": list(self.hidden_units),
            "activation": self.activation,
            "dropout": self.dropout,
            "use_batch_norm": self.use_batch_norm,
            "l2": self.l2,
            "output_units": self.output_units,
        }
