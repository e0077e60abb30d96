"""DIN (Zhou et al. 2018): attention of a behaviour sequence against the candidate + a DNN."""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from recflow.layers import DNN, DinAttention, MaskedMeanPooling
from recflow.models.base import RankingModel
from recflow.models.inputs import mask_key
from recflow.models.registry import register_model

_UNIT_KEYS = ("query", "keys", "hidden_units", "activation", "softmax")


@dataclass(frozen=True)
class _Unit:
    query: str
    keys: str


@register_model("din")
class DIN(RankingModel):
    """Deep Interest Network.

    Each attention unit scores every valid step of a sequence feature (`keys`)
    against a candidate feature (`query`) that shares its embedding table, and
    pools the sequence with those weights (`DinAttention`). The pooled
    sequences, every other sparse feature (other sequences mean-pooled) and the
    numeric features feed a DNN.

    Args:
        attention: one unit, or a list of units, each a mapping with
            `query` (a categorical or multi_hot feature), `keys` (a sequence
            feature on the same table), and optionally `hidden_units`
            (default `[80, 40]`), `activation` ("sigmoid" default, "dice", or a Keras name)
            and `softmax` (default false, as in the paper).
        dnn: DNN options (`hidden_units`, `dropout`, `activation`, `use_batch_norm`, `l2`).

    Example config:

        model:
          type: din
          params:
            attention: {query: item_id, keys: hist_items, hidden_units: [32, 16]}
            dnn: {hidden_units: [64, 32], activation: dice}
    """

    def __init__(
        self, config, attention: dict | list | None = None, dnn: dict | None = None, **kwargs
    ):
        units, options = _parse_attention(config, attention)
        super().__init__(config, **kwargs)
        self.units = units
        self.attention = [
            DinAttention(**opts, name=f"attention_{i}") for i, opts in enumerate(options)
        ]
        dnn = dict(dnn or {})
        dnn.setdefault("hidden_units", [200, 80])
        self.dnn = DNN(output_units=1, **dnn)
        self.mean_pooling = MaskedMeanPooling(name="mean_pooling")

    def tower(self, inputs, training=False):
        attended = {unit.keys for unit in self.units}
        fields = []
        for feature in self.config.sparse_features:
            if feature.name in attended:
                continue
            value = inputs[feature.name]
            if feature.sequence_length is not None:
                value = self.mean_pooling(value, mask=inputs[mask_key(feature.name)])
            fields.append(value)
        for unit, attention in zip(self.units, self.attention):
            mask = inputs[mask_key(unit.keys)]
            fields.append(
                attention(inputs[unit.query], inputs[unit.keys], mask=mask, training=training)
            )
        numeric = self.numeric(inputs)
        if numeric is not None:
            fields.append(numeric)
        return self.dnn(tf.concat(fields, axis=1), training=training)


def _parse_attention(config, attention) -> tuple[list[_Unit], list[dict]]:
    """Checks `model.params.attention`; returns the units and their layer options."""
    if attention is None:
        raise ValueError(
            "din needs `attention: {query: <feature>, keys: <sequence feature>}`; "
            "the two features must share a table"
        )
    specs = attention if isinstance(attention, (list, tuple)) else [attention]
    if not specs:
        raise ValueError("`attention` must name at least one {query, keys} unit")
    names = {f.name: f for f in config.features}
    units, options, seen = [], [], set()
    for i, spec in enumerate(specs):
        where = "attention" if isinstance(attention, dict) else f"attention[{i}]"
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: expected a mapping with `query` and `keys`, got {spec!r}")
        unknown = sorted(set(spec) - set(_UNIT_KEYS))
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r} (expected: {', '.join(_UNIT_KEYS)})"
            )
        for key in ("query", "keys"):
            if key not in spec:
                raise ValueError(f"{where}.{key}: required")
            if spec[key] not in names:
                raise ValueError(f"{where}.{key}: no feature {spec[key]!r}")
        query, keys = names[spec["query"]], names[spec["keys"]]
        if not query.is_sparse or query.sequence_length is not None:
            raise ValueError(
                f"{where}.query: feature {query.name!r} is {query.kind}; expected a categorical or multi_hot feature"
            )
        if not keys.is_sparse or keys.sequence_length is None:
            raise ValueError(
                f"{where}.keys: feature {keys.name!r} is {keys.kind}; expected a sequence feature"
            )
        if query.table_name != keys.table_name:
            raise ValueError(
                f"{where}: query {query.name!r} (table {query.table_name!r}) and keys {keys.name!r} "
                f"(table {keys.table_name!r}) must share a table; set `table:` on both features"
            )
        if keys.name in seen:
            raise ValueError(f"{where}.keys: {keys.name!r} is attended twice")
        seen.add(keys.name)
        units.append(_Unit(query.name, keys.name))
        options.append({k: spec[k] for k in ("hidden_units", "activation", "softmax") if k in spec})
    return units, options
