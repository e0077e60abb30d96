"""MMoE (Ma et al., KDD 2018): shared experts, one softmax gate and one tower per task."""

from __future__ import annotations

import tensorflow as tf

from recflow.layers import DNN, MMoE
from recflow.models.base import RankingModel
from recflow.models.registry import register_model


@register_model("mmoe")
class MMoEModel(RankingModel):
    """Multi-gate mixture of experts for multi-task configs.

    The pooled embeddings (sequences mean-pooled) and numeric features feed
    `num_experts` expert DNNs; each task of `task.tasks` mixes them with its own
    softmax gate and maps the mix to a logit with its own tower DNN. With a
    single-task config the model has one gate and one tower.

    Args:
        num_experts: number of shared experts.
        expert_units: hidden sizes of each expert.
        expert_activation: hidden activation of the experts ("relu", "dice", ...).
        dropout: dropout rate inside the experts.
        tower: options of each task's tower DNN (`hidden_units`, `dropout`,
            `activation`, `use_batch_norm`, `l2`).

    Example config:

        task:
          type: multitask
          tasks:
            - {name: ctr, label: click, type: binary}
            - {name: cvr, label: buy, type: binary, weight: 0.5}
        model: {type: mmoe, params: {num_experts: 4, expert_units: [64, 32]}}

    The tower returns `{task name: logits [B, 1]}`.
    """

    def __init__(
        self,
        config,
        num_experts: int = 4,
        expert_units: list | tuple = (64, 32),
        expert_activation: str = "relu",
        dropout: float = 0.0,
        tower: dict | None = None,
        **kwargs,
    ):
        super().__init__(config, **kwargs)
        self.mmoe = MMoE(
            num_experts=num_experts,
            expert_units=expert_units,
            num_tasks=len(self.heads),
            expert_activation=expert_activation,
            dropout=dropout,
            name="mmoe",
        )
        tower = dict(tower or {})
        tower.setdefault("hidden_units", [16])
        self.towers = [
            DNN(output_units=1, name=f"tower_{head.name}", **tower) for head in self.heads
        ]

    def tower(self, inputs, training=False):
        fields = self.pooled(inputs)
        numeric = self.numeric(inputs)
        if numeric is not None:
            fields.append(numeric)
        mixed = self.mmoe(tf.concat(fields, axis=1), training=training)
        return {
            head.name: tower(x, training=training)
            for head, tower, x in zip(self.heads, self.towers, mixed)
        }
