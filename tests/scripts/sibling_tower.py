"""A user tower that imports a sibling module: copied next to a config (or into the
working directory) under a test's own name, with `sibling_units.py` beside it."""

import tensorflow as tf
import tf_keras as keras
from sibling_units import UNITS  # a sibling module of the tower imports too

from recflow.models import RankingModel


class Tiny(RankingModel):
    def __init__(self, config, hidden=UNITS, **kwargs):
        super().__init__(config, **kwargs)
        self.hidden = keras.layers.Dense(hidden, activation="relu")
        self.head = keras.layers.Dense(1)

    def tower(self, inputs, training=False):
        x = tf.concat(self.pooled(inputs) + [self.numeric(inputs)], axis=-1)
        return self.head(self.hidden(x))
