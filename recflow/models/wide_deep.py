"""Wide & Deep (Cheng et al. 2016): a linear (wide) part + a DNN (deep) part."""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras

from recflow.layers import DNN
from recflow.models.base import RankingModel
from recflow.models.registry import register_model


@register_model("wide_deep")
class WideDeep(RankingModel):
    """Wide & Deep.

    The wide part is the sum of each sparse feature's first-order weight (a
    dim-1 row in the feature's table, trained by the table's sparse optimizer)
    plus a linear layer on the numeric features; the deep part is a DNN on the
    pooled embeddings (sequences mean-pooled) and the numeric features. The
    logit is their sum.

    Args:
        dnn: DNN options (`hidden_units`, `dropout`, `activation`, `use_batch_norm`, `l2`).
        wide_numeric: include the numeric features in the wide part.
    """

    first_order = True

    def __init__(self, config, dnn: dict | None = None, wide_numeric: bool = True, **kwargs):
        if not isinstance(wide_numeric, bool):
            raise ValueError(
                f"`wide_numeric` must be a bool. Received: wide_numeric={wide_numeric!r}"
            )
        super().__init__(config, **kwargs)
        dnn = dict(dnn or {})
        dnn.setdefault("hidden_units", [256, 128])
        self.dnn = DNN(output_units=1, **dnn)
        self.wide_numeric = wide_numeric
        self.numeric_linear = keras.layers.Dense(1, name="numeric_linear")

    def tower(self, inputs, training=False):
        fields = self.pooled(inputs)
        numeric = self.numeric(inputs)
        wide = self.first_order_logit(inputs)
        if numeric is not None:
            if self.wide_numeric:
                wide += self.numeric_linear(numeric)
            fields.append(numeric)
        return wide + self.dnn(tf.concat(fields, axis=1), training=training)
