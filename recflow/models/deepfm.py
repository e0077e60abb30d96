"""DeepFM (Guo et al. 2017): first-order weights + FM interactions + a DNN."""

from __future__ import annotations

from collections import defaultdict

import tensorflow as tf
import tf_keras as keras

from recflow.layers import DNN, FM
from recflow.models.base import RankingModel
from recflow.models.registry import register_model


@register_model("deepfm")
class DeepFM(RankingModel):
    """DeepFM.

    Args:
        dnn: DNN options (`hidden_units`, `dropout`, `activation`, `use_batch_norm`, `l2`).
        fm: include the FM (second-order) term.

    Fields of different dims take part in the FM term within their own dim;
    numeric features enter the first-order term and the DNN.
    """

    first_order = True

    def __init__(self, config, dnn: dict | None = None, fm: bool = True, **kwargs):
        super().__init__(config, **kwargs)
        dnn = dict(dnn or {})
        dnn.setdefault("hidden_units", [256, 128])
        self.dnn = DNN(output_units=1, **dnn)
        self.fm = FM() if fm else None
        self.numeric_linear = keras.layers.Dense(1, name="numeric_linear")

    @tf.autograph.experimental.do_not_convert  # plain tensor code: traces as written, fast
    def tower(self, inputs, training=False):
        fields = self.pooled(inputs)
        numeric = self.numeric(inputs)
        logit = self.first_order_logit(inputs)
        if numeric is not None:
            logit += self.numeric_linear(numeric)
        if self.fm is not None:
            by_dim = defaultdict(list)
            for field in fields:
                by_dim[field.shape[-1]].append(field)
            if len(by_dim) == 1 and len(fields) > 1:
                # One dim: the FM's [B, fields, dim] stack, flattened, is the DNN's field
                # input (the same values in the same order as their concat), built once.
                stacked = tf.stack(fields, axis=1)
                logit += self.fm(stacked, training=training)
                fields = [tf.reshape(stacked, [-1, stacked.shape[1] * stacked.shape[2]])]
            else:
                for group in by_dim.values():
                    if len(group) > 1:
                        logit += self.fm(tf.stack(group, axis=1), training=training)
        deep_in = tf.concat(fields + ([numeric] if numeric is not None else []), axis=1)
        return logit + self.dnn(deep_in, training=training)
