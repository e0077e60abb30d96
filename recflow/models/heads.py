"""Task heads: loss, output activation and serving output name per task."""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from recflow.config.schema import Config


@dataclass(frozen=True)
class Head:
    name: str  # the tower's output key for multi-task models
    type: str  # binary | regression
    label: str
    weight: float = 1.0

    @property
    def output(self) -> str:
        """Name of this head's tensor in the serving signature."""
        return self.name

    def loss(self, labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        labels = tf.reshape(tf.cast(labels, tf.float32), [-1])
        logits = tf.reshape(logits, [-1])
        if self.type == "binary":
            return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
        return tf.reduce_mean(tf.square(logits - labels))

    def activate(self, logits: tf.Tensor) -> tf.Tensor:
        return tf.sigmoid(logits) if self.type == "binary" else logits


def heads_for(config: Config) -> list[Head]:
    task = config.task
    if task.type == "multitask":
        return [Head(t.name, t.type, t.label, t.weight) for t in task.tasks]
    name = "probability" if task.type == "binary" else "prediction"
    return [Head(name, task.type, config.data.label[0])]
