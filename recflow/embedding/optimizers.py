"""Sparse optimizers applied to the unique rows of one step.

Each optimizer is pure tensor math on `[n, dim]` blocks: the embedding, its
slots (packed beside it in the same table row) and the gradient. Formulas
follow the Keras / TF dense versions (Adam's bias correction uses the global
step, as TF's sparse "lazy" Adam does).
"""

from __future__ import annotations

import tensorflow as tf

from recflow.config.schema import (
    AdagradConfig,
    AdamConfig,
    FtrlConfig,
    OptimizerConfig,
    SGDConfig,
)


class SparseOptimizer:
    """Base: `num_slots` slot blocks of width `dim` live beside each embedding."""

    num_slots = 0

    def __init__(self, config: OptimizerConfig):
        self.config = config
        self.learning_rate = config.learning_rate

    def initial_slots(self, n: tf.Tensor, dim: int) -> tf.Tensor:
        """Slots of new rows: `[n, num_slots * dim]`."""
        return tf.zeros([n, self.num_slots * dim])

    def apply(self, emb, slots, grad, step):
        """Returns the updated `(emb, slots)`; `step` is the 1-based global step."""
        raise NotImplementedError


class SGD(SparseOptimizer):
    def apply(self, emb, slots, grad, step):
        return emb - self.learning_rate * grad, slots


class Adagrad(SparseOptimizer):
    num_slots = 1

    def initial_slots(self, n, dim):
        return tf.fill([n, dim], self.config.initial_accumulator_value)

    def apply(self, emb, slots, grad, step):
        acc = slots + tf.square(grad)
        emb = emb - self.learning_rate * grad / (tf.sqrt(acc) + self.config.epsilon)
        return emb, acc


class Adam(SparseOptimizer):
    num_slots = 2

    def apply(self, emb, slots, grad, step):
        c = self.config
        m, v = tf.split(slots, 2, axis=1)
        m = c.beta_1 * m + (1.0 - c.beta_1) * grad
        v = c.beta_2 * v + (1.0 - c.beta_2) * tf.square(grad)
        t = tf.cast(step, tf.float32)
        lr = self.learning_rate * tf.sqrt(1.0 - tf.pow(c.beta_2, t)) / (1.0 - tf.pow(c.beta_1, t))
        emb = emb - lr * m / (tf.sqrt(v) + c.epsilon)
        return emb, tf.concat([m, v], axis=1)


class Ftrl(SparseOptimizer):
    """FTRL-proximal (McMahan et al. 2013), as `tf.raw_ops.ApplyFtrlV2`."""

    num_slots = 2  # accumulator n, linear z

    def initial_slots(self, n, dim):
        acc = tf.fill([n, dim], self.config.initial_accumulator_value)
        return tf.concat([acc, tf.zeros([n, dim])], axis=1)

    def apply(self, emb, slots, grad, step):
        c = self.config
        acc, z = tf.split(slots, 2, axis=1)
        power = -c.learning_rate_power
        acc_new = acc + tf.square(grad)
        sigma = (tf.pow(acc_new, power) - tf.pow(acc, power)) / self.learning_rate
        z = z + grad - sigma * emb
        quadratic = (c.beta + tf.pow(acc_new, power)) / self.learning_rate + 2.0 * c.l2
        emb = tf.where(tf.abs(z) > c.l1, (tf.sign(z) * c.l1 - z) / quadratic, tf.zeros_like(z))
        return emb, tf.concat([acc_new, z], axis=1)


_BY_TYPE = {SGDConfig: SGD, AdagradConfig: Adagrad, AdamConfig: Adam, FtrlConfig: Ftrl}


def make_optimizer(config: OptimizerConfig) -> SparseOptimizer:
    return _BY_TYPE[type(config)](config)
