"""Sparse optimizers applied to the unique rows of one step, and their registry.

A sparse optimizer is one class: its hyperparameters (`config_class`, a frozen
dataclass of the config schema), the slots it keeps beside each embedding in the
same packed table row (`num_slots` blocks of `dim` floats, `initial_slots`), its
update (`apply`, pure tensor math on `[n, dim]` blocks) and what an export serves
of a row (`serving_rows`). `register_sparse_optimizer("name")` makes it
`optimizer: {type: name}`; a class of the user's own module is also usable
unregistered as `type: "package.module:ClassName"`.

Formulas follow the Keras / TF dense versions (Adam's bias correction uses the
global step, as TF's sparse "lazy" Adam does).
"""

from __future__ import annotations

from typing import ClassVar

import tensorflow as tf

from recflow.config import model_module
from recflow.config.convert import register_choice
from recflow.config.schema import (
    AdagradConfig,
    AdamConfig,
    FtrlConfig,
    OptimizerConfig,
    OptimizerSpec,
    SGDConfig,
)

_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {}


def register_sparse_optimizer(name: str):
    """Class decorator: makes a `SparseOptimizer` subclass available as `optimizer: {type: name}`.

    The class's `config_class` becomes the schema of that `optimizer` mapping.
    """

    def wrap(cls):
        # checked on a copy first: nothing is registered unless its config class is too
        model_module.register(dict(_OPTIMIZERS), name, cls, SparseOptimizer, "sparse optimizer")
        register_choice(OptimizerSpec, name, cls.config_class)
        _OPTIMIZERS[name] = cls
        return cls

    return wrap


def optimizer_class(type_name: str) -> type[SparseOptimizer]:
    """The class of an optimizer `type` (a registered name or `module:ClassName`)."""
    if type_name in _OPTIMIZERS:
        return _OPTIMIZERS[type_name]
    return model_module.import_class(type_name, "optimizer.type", SparseOptimizer)


def make_optimizer(config: OptimizerConfig) -> SparseOptimizer:
    return optimizer_class(config.type)(config)


class SparseOptimizer:
    """Base of the sparse optimizers.

    Args:
        config: an instance of the class's `config_class` (its fields are the keys
            of the config's `optimizer` mapping; `type` and `learning_rate` are required).

    A subclass sets `config_class` and `num_slots` and implements `apply`; it
    overrides `initial_slots` when new slots are not zeros and `serving_rows`
    when an export should serve something other than the trained embedding.
    """

    config_class: ClassVar[type] = SGDConfig
    num_slots: ClassVar[int] = 0

    def __init__(self, config):
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {config!r}")
        self.config = config
        self.learning_rate = config.learning_rate

    def initial_slots(self, n: tf.Tensor, dim: int) -> tf.Tensor:
        """Slots of new rows: `[n, num_slots * dim]`."""
        return tf.zeros([n, self.num_slots * dim])

    def apply(self, emb: tf.Tensor, slots: tf.Tensor, grad: tf.Tensor, step: tf.Tensor):
        """Returns the updated `(emb, slots)` of the step's rows.

        Args:
            emb: `[n, dim]` embeddings.
            slots: `[n, num_slots * dim]` slots.
            grad: `[n, dim]` gradients (a row looked up twice has its gradients summed).
            step: the 1-based global step, int64 scalar.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `apply`")

    def serving_rows(self, emb: tf.Tensor, slots: tf.Tensor) -> tf.Tensor:
        """What an export (and a delta) serves of rows `[n, dim]`: the embedding itself."""
        return emb


@register_sparse_optimizer("sgd")
class SGD(SparseOptimizer):
    config_class = SGDConfig

    def apply(self, emb, slots, grad, step):
        return emb - self.learning_rate * grad, slots


@register_sparse_optimizer("adagrad")
class Adagrad(SparseOptimizer):
    config_class = AdagradConfig
    num_slots = 1

    def initial_slots(self, n, dim):
        return tf.fill([n, dim], self.config.initial_accumulator_value)

    def apply(self, emb, slots, grad, step):
        acc = slots + tf.square(grad)
        emb = emb - self.learning_rate * grad / (tf.sqrt(acc) + self.config.epsilon)
        return emb, acc


@register_sparse_optimizer("adam")
class Adam(SparseOptimizer):
    config_class = AdamConfig
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


@register_sparse_optimizer("ftrl")
class Ftrl(SparseOptimizer):
    """FTRL-proximal (McMahan et al. 2013), as `tf.raw_ops.ApplyFtrlV2`."""

    config_class = FtrlConfig
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

