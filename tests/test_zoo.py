"""The model zoo: every model trains from its config, runs with any config, and DIN's
attention beats mean pooling on data whose label depends on the history."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from recflow import metrics
from recflow.config import config_from_dict, load_config
from recflow.data import generate
from recflow.errors import ConfigError
from recflow.models import build_model, registered_models
from recflow.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
ZOO = ("deepfm", "din", "wide_deep", "dcn", "mmoe")
# Not conftest's SMALL: each zoo config at a size where its model learns (AUC > 0.6).
SMALL = [
    "data.synthetic.rows=20000",
    "data.synthetic.eval_rows=3000",
    "data.batch_size=256",
    "train.epochs=null",
]


def train(config, seed: int = 0) -> dict:
    """Trains, evaluates and exports with fixed seeds; returns the metrics."""
    keras.utils.set_random_seed(seed)
    return Trainer(config, verbose=0).run()


def load(name: str, tmp_path, *overrides: str, run: str | None = None):
    model_dir = tmp_path / (run or name)
    return load_config(str(CONFIGS / f"{name}.yaml"), [f"train.model_dir={model_dir}", *overrides])


# ----------------------------------------------------------------------------- each model from its config


def test_zoo_registers_every_model():
    assert set(ZOO) <= set(registered_models())


@pytest.mark.parametrize(
    "name, steps",
    [("wide_deep", 60), ("dcn", 60), ("din", 80)],
)
def test_model_trains_from_its_config(name, steps, tmp_path):
    config = load(name, tmp_path, *SMALL, f"train.steps={steps}")
    assert config.model.type == name
    result = train(config)
    assert result["steps"] == steps
    assert result["auc"] > 0.6, result
    assert result["auc"] < result["oracle_auc"] + 0.02, result
    assert (tmp_path / name / "export" / str(steps) / "saved_model.pb").is_file()


def test_mmoe_trains_from_its_config(tmp_path):
    config = load("mmoe", tmp_path, *SMALL, "train.steps=100")
    assert config.task.type == "multitask" and len(config.task.tasks) == 2
    result = train(config)
    assert result["ctr/auc"] > 0.6, result
    # The age head beats the best constant, the mean age (whose mse is the variance).
    ages = np.asarray(generate(config.data.synthetic, "eval")[0]["age"])
    assert result["age/mse"] < 0.8 * ages.var(), (result, ages.var())


def write_two_label_csv(path: Path, rows: int, seed: int) -> dict:
    """Rows whose click depends on the item and whose buy on the click, the user and the price.

    Returns the oracle AUC of each label (the AUC of its true probabilities).
    """
    hidden = np.random.default_rng(0)  # the same effects in every file
    item_effect = hidden.normal(0, 1.5, 50)
    user_effect = hidden.normal(0, 1.5, 40)
    rng = np.random.default_rng(seed)
    truth = {"click": ([], []), "buy": ([], [])}
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "hist_items", "price", "click", "buy"])
        for _ in range(rows):
            user, item = rng.integers(0, 40), rng.integers(0, 50)
            hist = "|".join(f"i{k}" for k in rng.integers(0, 50, rng.integers(0, 6)))
            price = rng.lognormal(2.0, 0.5)
            p_click = 1 / (1 + np.exp(-(item_effect[item] - 1.0)))
            p_buy_if_click = 1 / (1 + np.exp(-(user_effect[user] - 0.5 * np.log(price))))
            click = int(rng.random() < p_click)
            buy = int(click and rng.random() < p_buy_if_click)
            writer.writerow([user, f"i{item}", hist, f"{price:.3f}", click, buy])
            for name, p, y in (("click", p_click, click), ("buy", p_click * p_buy_if_click, buy)):
                truth[name][0].append(y)
                truth[name][1].append(p)
    return {name: metrics.auc(y, p) for name, (y, p) in truth.items()}


def test_mmoe_two_binary_tasks(tmp_path):
    write_two_label_csv(tmp_path / "train.csv", 6000, seed=1)
    oracle = write_two_label_csv(tmp_path / "eval.csv", 2000, seed=2)
    config = config_from_dict(
        {
            "data": {
                "format": "csv",
                "train": str(tmp_path / "train.csv"),
                "eval": str(tmp_path / "eval.csv"),
                "label": ["click", "buy"],
                "batch_size": 128,
            },
            "features": [
                {"name": "user_id", "kind": "categorical", "dtype": "int64"},
                {"name": "item_id", "kind": "categorical", "table": "item"},
                {"name": "hist_items", "kind": "sequence", "max_len": 5, "table": "item"},
                {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
            ],
            "tables": {"item": {"dim": 8}},
            "model": {
                "type": "mmoe",
                "params": {"num_experts": 3, "expert_units": [16], "tower": {"hidden_units": [8]}},
            },
            "task": {
                "type": "multitask",
                "tasks": [
                    {"name": "ctr", "label": "click", "type": "binary"},
                    {"name": "cvr", "label": "buy", "type": "binary", "weight": 2.0},
                ],
            },
            "train": {
                "model_dir": str(tmp_path / "run"),
                "steps": 150,
                "optimizer": {"type": "adam", "learning_rate": 0.01},
                "sparse_optimizer": {"type": "adagrad", "learning_rate": 0.2},
            },
        }
    )
    result = train(config)
    assert result["eval_examples"] == 2000
    assert result["ctr/auc"] > max(0.65, oracle["click"] - 0.05), (result, oracle)
    assert result["cvr/auc"] > max(0.65, oracle["buy"] - 0.08), (result, oracle)
    assert {"ctr/logloss", "cvr/logloss"} <= set(result)

    serve = tf.saved_model.load(result["export"]).signatures["serving_default"]
    out = serve(
        user_id=tf.constant([1, 2], tf.int64),
        item_id=tf.constant(["i1", "i2"]),
        hist_items=tf.constant(["i3|i4", ""]),
        price=tf.constant([5.0, 9.0]),
    )
    assert set(out) == {"ctr", "cvr"}
    assert out["ctr"].shape == (2, 1) and out["cvr"].shape == (2, 1)


# ----------------------------------------------------------------------------- any model, any config


def synthetic_features(schema: str) -> list[dict]:
    """Up to 3 numeric and 6 sparse features of a synthetic schema, every sequence included."""
    from recflow.data.synthetic import columns, label_columns

    numeric, sparse = [], []
    for name, kind in columns(schema).items():
        if name in label_columns(schema):
            continue
        if kind == "float":
            numeric.append({"name": name, "kind": "numeric", "normalizer": {"type": "log1p"}})
        elif name.startswith("hist_"):
            sparse.append({"name": name, "kind": "sequence", "max_len": 10})
        elif name == "tags":
            sparse.append({"name": name, "kind": "multi_hot"})
        else:
            sparse.append({"name": name, "kind": "categorical", "dtype": kind})
    return sparse[:6] + numeric[:3]


def predict_one_batch(raw: dict) -> np.ndarray:
    from recflow.data import make_dataset
    from recflow.features.transform import transform

    config = config_from_dict(raw)
    features, _, _ = next(iter(make_dataset(config, "eval", epochs=1)))
    return build_model(config)(transform(config, features), training=False)


@pytest.mark.parametrize("schema", ["demo", "sequence", "criteo"])
@pytest.mark.parametrize("model", ["wide_deep", "dcn", "mmoe", "din"])
def test_models_run_with_any_config(schema, model):
    """Sequences are mean-pooled (DIN attends one); configs with and without numerics work."""
    from recflow.data.synthetic import label_columns

    features = synthetic_features(schema)
    params = {}
    if model == "din":
        if schema == "criteo":
            pytest.skip("no sequence feature to attend")
        # item_id and hist_items share the item table; other sequences are mean-pooled.
        for f in features:
            if f["name"] in ("item_id", "hist_items"):
                f["table"] = "item"
        params = {"attention": {"query": "item_id", "keys": "hist_items", "hidden_units": [8]}}
    raw = {
        "data": {
            "format": "synthetic",
            "synthetic": {"rows": 64, "eval_rows": 16, "schema": schema},
            "label": label_columns(schema)[0],
        },
        "features": features,
        "tables": {"item": {"dim": 8}} if model == "din" else {},
        "model": {"type": model, "params": params},
    }
    p = predict_one_batch(raw)["probability"].numpy()
    assert p.shape == (16, 1)
    assert np.all((p > 0) & (p < 1))


# ----------------------------------------------------------------------------- DIN


def din_config(tmp_path, **attention):
    return {
        "data": {
            "format": "synthetic",
            "synthetic": {"rows": 64, "eval_rows": 16, "schema": "sequence"},
            "label": "label",
        },
        "features": [
            {"name": "user_id", "kind": "categorical", "dtype": "int64"},
            {"name": "item_id", "kind": "categorical", "table": "item"},
            {"name": "category", "kind": "categorical"},
            {"name": "hist_items", "kind": "sequence", "max_len": 20, "table": "item"},
        ],
        "tables": {"item": {"dim": 8}},
        "model": {"type": "din", "params": {"attention": attention}},
        "train": {"model_dir": str(tmp_path)},
    }


@pytest.mark.parametrize(
    "attention, message",
    [
        ({"query": "item", "keys": "hist_items"}, "attention.query: no feature 'item'"),
        ({"query": "item_id", "keys": "hist"}, "attention.keys: no feature 'hist'"),
        ({"keys": "hist_items"}, "attention.query: required"),
        ({"query": "category", "keys": "hist_items"}, "must share a table"),
        ({"query": "item_id", "keys": "category"}, "expected a sequence feature"),
        (
            {"query": "hist_items", "keys": "hist_items"},
            "expected a categorical or multi_hot feature",
        ),
        ({"query": "item_id", "keys": "hist_items", "units": [4]}, "unknown key 'units'"),
        ({"query": "item_id", "keys": "hist_items", "hidden_units": [-1]}, "hidden_units"),
        ({"query": "item_id", "keys": "hist_items", "activation": "nope"}, "activation"),
    ],
)
def test_din_config_errors(tmp_path, attention, message):
    config = config_from_dict(din_config(tmp_path, **attention))
    with pytest.raises(ConfigError) as info:
        build_model(config)
    text = str(info.value)
    assert text.startswith("model.params"), text
    assert message in text, text
    assert "\n" not in text


def test_din_needs_attention(tmp_path):
    raw = din_config(tmp_path)
    raw["model"]["params"] = {}
    with pytest.raises(ConfigError, match=r"model\.params.*din needs `attention"):
        build_model(config_from_dict(raw))


def test_din_ignores_padded_steps(tmp_path):
    """What sits at masked steps of the attended sequence does not change the logit."""
    config = config_from_dict(din_config(tmp_path, query="item_id", keys="hist_items"))
    model = build_model(config)
    rng = np.random.default_rng(0)
    batch, steps, dim = 4, 20, 8
    lengths = np.array([0, 1, 5, 20])
    mask = np.arange(steps)[None, :] < lengths[:, None]
    inputs = {
        name: tf.constant(rng.normal(size=(batch, dim)), tf.float32)
        for name in ("user_id", "item_id", "category")
    }
    keys = rng.normal(size=(batch, steps, dim))
    garbage = np.where(mask[:, :, None], keys, rng.normal(size=keys.shape) * 10)
    logits = []
    for values in (keys, garbage):
        inputs.update(
            {"hist_items": tf.constant(values, tf.float32), "hist_items/mask": tf.constant(mask)}
        )
        logits.append(model.tower(inputs).numpy())
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(logits[0]))


COMPARISON = [
    "data.synthetic.rows=40000",
    "data.synthetic.eval_rows=10000",
    "data.batch_size=256",
    "data.shuffle=true",
    "data.seed=1",
    "train.epochs=null",
    "train.steps=200",
]


def test_din_beats_mean_pooled_deepfm(tmp_path):
    """On the "sequence" set the click depends on whether the candidate's category is in the
    history; attention finds the matching steps that mean pooling blurs."""
    din = load("din", tmp_path, *COMPARISON)
    deepfm = load(
        "din",
        tmp_path,
        *COMPARISON,
        "model.type=deepfm",
        "model.params={dnn: {hidden_units: [64, 32]}}",
        run="deepfm",
    )
    din_auc = train(din, seed=1)["auc"]
    deepfm_auc = train(deepfm, seed=1)["auc"]
    assert din_auc > deepfm_auc + 0.01, (din_auc, deepfm_auc)


# ----------------------------------------------------------------------------- the docs


def readme_model_source() -> str:
    """The user model the docs show (docs/models.md): the python block defining TwoLayer."""
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class TwoLayer(" in b]
    assert blocks, "docs/models.md: no python block defines TwoLayer"
    return blocks[0]


def test_readme_user_model(tmp_path, monkeypatch):
    source = readme_model_source()
    assert "class TwoLayer(RankingModel)" in source
    (tmp_path / "readme_two_layer.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(
        str(CONFIGS / "deepfm_demo.yaml"),
        [
            f"train.model_dir={tmp_path / 'run'}",
            *SMALL,
            "train.steps=60",
            "model={type: 'readme_two_layer:TwoLayer', params: {hidden: 32}}",
        ],
    )
    result = train(config)
    assert result["auc"] > 0.6, result
