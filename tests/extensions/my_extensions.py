"""recflow extensions written as a user writes them, outside the package: a task head,
a sparse optimizer and a feature kind.

docs/models.md ("Extending recflow") shows this code, block for block;
tests/test_extensions.py trains, evaluates and exports with it through the CLI,
naming each class as `my_extensions:ClassName` in the YAML.
"""

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from recflow.config import SparseFeature
from recflow.embedding.optimizers import SparseOptimizer
from recflow.errors import ConfigError
from recflow.features.kinds import FeatureKind, ids
from recflow.models import Head


# [start:head]
def poisson_nll(counts, rates, groups=None) -> float:
    """Mean Poisson negative log-likelihood, without the log(y!) term."""
    return float(np.mean(rates - counts * np.log(rates)))


@dataclass(frozen=True)
class PoissonHead(Head):
    """Counts (clicks per session, views per item): Poisson loss, a rate `exp(logit)`."""

    output_name = "rate"  # the export's output of a single-task model
    metrics = {
        "poisson_nll": poisson_nll,
        "mae": lambda counts, rates, groups: float(np.mean(np.abs(rates - counts))),
    }
    default_metrics = ("poisson_nll",)

    def loss(self, labels, logits):
        counts = tf.reshape(tf.cast(labels, tf.float32), [-1])
        return tf.reduce_mean(tf.nn.log_poisson_loss(counts, tf.reshape(logits, [-1])))

    def activate(self, logits):
        return tf.exp(logits)
# [end:head]


# [start:optimizer]
@dataclass(frozen=True)
class MomentumConfig:
    """The keys of `optimizer: {type: "my_extensions:MomentumSGD", ...}`."""

    type: str = "momentum"
    learning_rate: float = 0.05
    momentum: float = 0.9

    def validate(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("momentum", f"expected a number in [0, 1), got {self.momentum}")


class MomentumSGD(SparseOptimizer):
    """SGD with heavy-ball momentum: v <- momentum * v + g; w <- w - learning_rate * v."""

    config_class = MomentumConfig
    num_slots = 1  # the velocity: one slot block of `dim` floats beside each embedding

    def apply(self, emb, slots, grad, step):
        velocity = self.config.momentum * slots + grad
        return emb - self.learning_rate * velocity, velocity
# [end:optimizer]


# [start:kind]
@dataclass(frozen=True)
class BucketizedFeature(SparseFeature):
    """A number per row, embedded by the bucket it falls in: `x < b[0]` is bucket 0,
    `b[i-1] <= x < b[i]` bucket i, `x >= b[-1]` bucket len(b); a missing number, -1."""

    kind: str = "bucketized"
    boundaries: tuple[float, ...] = ()

    @property
    def read_as(self) -> str:
        return "float"  # the column is read, and served, as float32

    def identity(self) -> dict:
        return {**super().identity(), "boundaries": list(self.boundaries)}

    def validate(self) -> None:
        super().validate()
        if not self.boundaries or list(self.boundaries) != sorted(set(self.boundaries)):
            raise ConfigError("boundaries", "expected strictly increasing numbers")


class Bucketized(FeatureKind):
    config_class = BucketizedFeature

    def transform(self, raw, counts=None):
        x = tf.cast(raw, tf.float32)
        bucket = tf.raw_ops.Bucketize(input=x, boundaries=list(self.feature.boundaries))
        bucket = tf.where(tf.math.is_finite(x), tf.cast(bucket, tf.int64), -1)
        return ids(bucket, "int64")  # one id per row: pooled to [B, dim]
# [end:kind]
