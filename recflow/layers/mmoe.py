"""`MMoE`: multi-gate mixture of experts (Ma et al., KDD 2018)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import tensorflow as tf
import tf_keras as keras

from recflow.layers.dnn import (
    DNN,
    build_sublayer,
    check_activation,
    check_positive_int,
    check_units,
)


@keras.saving.register_keras_serializable(package="recflow")
class MMoE(keras.layers.Layer):
    """Shared experts mixed per task by softmax gates.

    Each expert is a `DNN(expert_units)`; task `k` gets
    `sum_e softmax(gate_k(x))_e * expert_e(x)`.

    Args:
        num_experts: number of experts.
        expert_units: hidden sizes of each expert, e.g. `[64, 32]` (non-empty).
        num_tasks: number of tasks, i.e. of gates and outputs.
        expert_activation: hidden activation of the experts ("relu" default,
            "dice", or another Keras activation name).
        dropout: dropout rate in `[0, 1)` inside the experts.
        l2: L2 penalty (>= 0) on the expert and gate kernels.
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...).

    Input shape:
        `[batch, in_dim]`.

    Output shape:
        A list of `num_tasks` tensors `[batch, expert_units[-1]]`.

    Example:

    >>> ctr, cvr = MMoE(num_experts=4, expert_units=[32, 16], num_tasks=2)(tf.ones([8, 40]))
    >>> ctr.shape
    TensorShape([8, 16])
    """

    def __init__(
        self,
        num_experts: int,
        expert_units: Sequence[int],
        num_tasks: int,
        expert_activation: str = "relu",
        dropout: float = 0.0,
        l2: float = 0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.expert_units = check_units("expert_units", expert_units)
        if not self.expert_units:
            raise ValueError(
                f"`expert_units` must be a non-empty list. Received: expert_units={expert_units!r}"
            )
        self.num_tasks = check_positive_int("num_tasks", num_tasks)
        self.expert_activation = check_activation("expert_activation", expert_activation)
        if isinstance(l2, bool) or not isinstance(l2, numbers.Real) or l2 < 0:
            raise ValueError(f"`l2` must be a float >= 0. Received: l2={l2!r}")
        self.l2 = float(l2)
        self.experts = [
            DNN(self.expert_units, self.expert_activation, dropout, l2=self.l2, name=f"expert_{i}")
            for i in range(self.num_experts)
        ]
        self.dropout = self.experts[0].dropout
        regularizer = keras.regularizers.L2(self.l2) if self.l2 > 0 else None
        self.gates = [
            keras.layers.Dense(
                self.num_experts, "softmax", kernel_regularizer=regularizer, name=f"gate_{k}"
            )
            for k in range(self.num_tasks)
        ]

    def build(self, input_shape):
        for layer in self.experts + self.gates:
            build_sublayer(layer, input_shape)
        super().build(input_shape)

    def call(self, inputs, training=None):
        experts = tf.stack([e(inputs, training=training) for e in self.experts], axis=-2)
        return [tf.einsum("...e,...eu->...u", gate(inputs), experts) for gate in self.gates]

    def get_config(self):
        return {
            **super().get_config(),
            "num_experts": self.num_experts,
            "expert_units": list(self.expert_units),
            "num_tasks": self.num_tasks,
            "expert_activation": self.expert_activation,
            "dropout": self.dropout,
            "l2": self.l2,
        }
