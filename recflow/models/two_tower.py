"""Two-tower retrieval (DSSM, Huang et al. 2013; YouTube DNN, Covington et al. 2016).

A query tower and a candidate tower map their own features to L2-normalized
embeddings; a pair scores their dot product. Trained with an in-batch softmax
(TFRS `Retrieval`): each positive row's candidate is its query's target, the
batch's other candidates are negatives. Used with `task.type: retrieval`:

    model:
      type: two_tower
      params:
        query_features: [user_id, city, age]
        candidate_features: [item_id, category, tags]
        hidden_units: [64]
        output_dim: 32
        temperature: 0.1
"""

from __future__ import annotations

import tensorflow as tf

from recflow.layers import DNN
from recflow.layers.dnn import check_positive_int
from recflow.models.base import RetrievalModel
from recflow.models.registry import register_model


@register_model("two_tower")
class TwoTower(RetrievalModel):
    """Two-tower retrieval model.

    Args:
        query_features: features of the query (user, context) tower.
        candidate_features: features of the candidate (item) tower; disjoint from
            `query_features`, and together they cover every feature.
        hidden_units: hidden layer sizes of each tower's DNN.
        output_dim: embedding size of both towers.
        temperature: softmax temperature of the loss (the embeddings are unit
            vectors, so scores lie in [-1, 1]; a small temperature sharpens them).
        logq_correction: correct the in-batch softmax for candidate popularity
            (`recflow.models.heads.retrieval_loss`).
        dropout: dropout rate of the hidden layers.
        activation: hidden activation.

    Each tower: its sparse features' pooled embeddings (sequences mean-pooled)
    and its numeric features, concatenated -> DNN -> `output_dim` -> L2 norm.
    """

    def __init__(
        self,
        config,
        query_features,
        candidate_features,
        hidden_units=(64,),
        output_dim: int = 32,
        temperature: float | None = 0.1,
        logq_correction: bool = True,
        dropout: float = 0.0,
        activation: str = "relu",
        **kwargs,
    ):
        output_dim = check_positive_int("output_dim", output_dim)
        super().__init__(
            config, query_features, candidate_features, temperature, logq_correction, **kwargs
        )
        options = dict(hidden_units=hidden_units, output_units=output_dim, dropout=dropout)
        self.query_dnn = DNN(activation=activation, name="query_dnn", **options)
        self.candidate_dnn = DNN(activation=activation, name="candidate_dnn", **options)

    def _encode(self, dnn: DNN, inputs: dict, training: bool) -> tf.Tensor:
        numeric = self.numeric(inputs)
        x = tf.concat(self.pooled(inputs) + ([numeric] if numeric is not None else []), axis=1)
        return tf.math.l2_normalize(dnn(x, training=training), axis=-1)

    def query_tower(self, inputs, training=False):
        return self._encode(self.query_dnn, inputs, training)

    def candidate_tower(self, inputs, training=False):
        return self._encode(self.candidate_dnn, inputs, training)
