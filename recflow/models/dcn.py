"""DCN-v2 (Wang et al. 2021): explicit feature crosses (`Cross` layers) + a DNN."""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras

from recflow.layers import DNN, Cross
from recflow.layers.dnn import check_positive_int
from recflow.models.base import RankingModel
from recflow.models.registry import register_model


@register_model("dcn")
class DCN(RankingModel):
    """DCN-v2.

    `x0` is the concatenation of the pooled embeddings (sequences mean-pooled)
    and the numeric features; `num_cross_layers` cross layers compute
    `x_{l+1} = x0 * (W x_l + b) + x_l`. With `structure: parallel` (default) the
    cross output and a DNN on `x0` are concatenated into a final linear layer;
    with `structure: stacked` the DNN runs on the cross output.

    Args:
        num_cross_layers: number of stacked `Cross` layers.
        projection_dim: low-rank size of each cross kernel (`W = U V`); None
            for a full-rank kernel.
        structure: "parallel" or "stacked".
        dnn: DNN options (`hidden_units`, `dropout`, `activation`, `use_batch_norm`, `l2`).
    """

    def __init__(
        self,
        config,
        num_cross_layers: int = 3,
        projection_dim: int | None = None,
        structure: str = "parallel",
        dnn: dict | None = None,
        **kwargs,
    ):
        num_cross_layers = check_positive_int("num_cross_layers", num_cross_layers)
        if projection_dim is not None:
            projection_dim = check_positive_int("projection_dim", projection_dim)
        if structure not in ("parallel", "stacked"):
            raise ValueError(
                f"`structure` must be 'parallel' or 'stacked'. Received: structure={structure!r}"
            )
        super().__init__(config, **kwargs)
        self.structure = structure
        self.cross_layers = [
            Cross(projection_dim=projection_dim, name=f"cross_{i}") for i in range(num_cross_layers)
        ]
        dnn = dict(dnn or {})
        dnn.setdefault("hidden_units", [256, 128])
        if structure == "stacked":
            self.dnn = DNN(output_units=1, **dnn)
            self.output_layer = None
        else:
            self.dnn = DNN(**dnn)
            self.output_layer = keras.layers.Dense(1, name="output")

    def tower(self, inputs, training=False):
        fields = self.pooled(inputs)
        numeric = self.numeric(inputs)
        if numeric is not None:
            fields.append(numeric)
        x0 = tf.concat(fields, axis=1)
        x = x0
        for cross in self.cross_layers:
            x = cross(x0, x)
        if self.output_layer is None:
            return self.dnn(x, training=training)
        return self.output_layer(tf.concat([x, self.dnn(x0, training=training)], axis=1))
