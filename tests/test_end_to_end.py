"""Train -> evaluate -> export -> serve without recflow -> predict, and resume."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import procs
import pytest
from conftest import DEMO, TRAINED, items, sets, small

from recflow.cli import main

SERVE_WITHOUT_RECFLOW = Path(__file__).parent / "scripts" / "serve_without_recflow.py"
# Resume arithmetic: 4000 rows in batches of 256 make 15 full batches and a short one
# of 160 at step 16, which the resumed run's example count must include.
RESUMED = small({"data.synthetic": {"rows": 4000, "eval_rows": 1000, "seed": 3, "schema": "demo"},
                 "data.batch_size": 256, "train.epochs": None}, export=True)


def train(model_dir, overrides):
    args = ["train", DEMO, "--model-dir", str(model_dir), "--quiet", *sets(overrides)]
    assert main(args) == 0


@pytest.fixture(scope="module")
def trained(trained_demo, tmp_path_factory):
    """This module's copy of the session's trained demo (8 steps, checkpoints at 4 and
    8, the export of step 8): its last test evaluates and exports into it."""
    copy = tmp_path_factory.mktemp("end_to_end") / "model"
    shutil.copytree(trained_demo[0], copy)
    return copy


def test_model_dir_layout(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    for key in ("auc", "logloss", "examples_per_sec", "steps", "bad_records", "oracle_auc"):
        assert key in metrics
    assert metrics["steps"] == 8
    assert metrics["eval_examples"] == 256
    assert 0.0 <= metrics["auc"] <= 1.0
    assert (trained / "config.yaml").exists()
    assert os.listdir(trained / "logs")
    checkpoints = sorted(p.name for p in (trained / "checkpoints").iterdir())
    assert "ckpt-8.index" in checkpoints and "ckpt-4.index" in checkpoints
    assert sorted(os.listdir(trained / "export")) == ["8"]  # the version is the step
    assert not [p for p in os.listdir(trained / "export") if p.startswith(".tmp")]


def raw_rows():
    from recflow.config import load_config
    from recflow.data import generate

    config = load_config(DEMO, items(TRAINED))
    columns, _ = generate(config.data.synthetic, "eval")
    n = 50
    raw = {}
    for feature in config.features:
        values = np.array(columns[feature.source][:n])
        raw[feature.name] = values.astype(np.float32) if feature.kind == "numeric" else values
    raw["item_id"][0] = "never-seen-item"  # unknown ids read the default row
    return config, raw


@pytest.fixture(scope="module")
def restored(trained):
    """The trained model, restored from its last checkpoint (step 8)."""
    from recflow.training.trainer import Trainer

    config, _ = raw_rows()
    trainer = Trainer(config, model_dir=str(trained), verbose=0)
    assert trainer.model_dir.restore() == 8
    return trainer.model


def feed(raw):
    import tensorflow as tf

    return {k: tf.constant(v.tolist() if v.dtype == object else v) for k, v in raw.items()}


def test_export_serves_in_plain_tensorflow_and_matches(trained, restored, tmp_path):
    _, raw = raw_rows()
    np.savez(tmp_path / "inputs.npz", **raw)
    export_dir = trained / "export" / "8"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run(
        [sys.executable, str(SERVE_WITHOUT_RECFLOW), str(export_dir), str(tmp_path / "inputs.npz"), str(tmp_path / "out.npy")],
        check=True, env=env, cwd=tmp_path,
    )
    served = np.load(tmp_path / "out.npy").reshape(-1)
    assert served.shape == (50,)

    # The in-process model, restored from the checkpoint, scores the same rows the same way.
    in_process = restored.predict_raw(feed(raw))["probability"].numpy().reshape(-1)
    np.testing.assert_allclose(served, in_process, rtol=1e-5, atol=1e-6)

    # `recflow predict` on the same rows written as CSV.
    import pandas as pd

    frame = pd.DataFrame({k: v for k, v in raw.items()})
    frame.to_csv(tmp_path / "rows.csv", index=False)
    result = procs.run(
        [sys.executable, "-m", "recflow.cli", "predict", str(export_dir), str(tmp_path / "rows.csv")],
        check=True, env=env, capture_output=True, text=True,
    )
    predicted = np.array([float(x) for x in result.stdout.split()])
    np.testing.assert_allclose(predicted, served, atol=2e-6)


def test_call_and_the_serving_signature_agree(trained, restored):
    # One forward pass: `model(features)` on the transformed batch (the training tables,
    # eagerly and traced as the evaluator runs it) and the export's `serving_default` on
    # the raw batch (its own tables) give the same probabilities.
    import tensorflow as tf

    from recflow.features.transform import transform

    config, raw = raw_rows()
    features = transform(config, feed(raw))
    eager = restored(features)["probability"].numpy().reshape(-1)
    traced = tf.function(lambda f: restored(f, training=False), autograph=False)(features)
    serve = tf.saved_model.load(str(trained / "export" / "8")).signatures["serving_default"]
    served = serve(**feed(raw))["probability"].numpy().reshape(-1)
    assert served.shape == (50,) and np.ptp(served) > 1e-3  # a trained model, not a constant
    np.testing.assert_allclose(eager, served, rtol=0, atol=1e-6)
    np.testing.assert_allclose(traced["probability"].numpy().reshape(-1), served, rtol=0, atol=1e-6)


def test_resume_continues_to_the_total(tmp_path):
    # `train.steps` is a total: a second run on the same dir goes from 8 to 20.
    model_dir = tmp_path / "resumed"
    train(model_dir, {**RESUMED, "train.steps": 8})
    train(model_dir, {**RESUMED, "train.steps": 20})
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == 20
    # Only steps 9..20 ran: 4000 rows make 15 full batches and one of 160 (step 16).
    assert metrics["examples"] == 11 * 256 + (4000 - 15 * 256)
    assert sorted(os.listdir(model_dir / "export"), key=int) == ["8", "20"]


def test_evaluate_and_export_commands(trained):
    args = ["--model-dir", str(trained), *sets(TRAINED)]
    assert main(["evaluate", "configs/deepfm_demo.yaml", *args]) == 0
    assert main(["export", "configs/deepfm_demo.yaml", *args]) == 0
    assert sorted(os.listdir(trained / "export")) == ["8"]  # the same step: replaced


def test_regression_task_exports_prediction(tmp_path):
    model_dir = tmp_path / "reg"
    train(model_dir, small({"task": {"type": "regression", "metrics": ["mse", "mae"]}, "train.steps": 4,
                            "train.epochs": None}, export=True, evaluate=True))
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert {"mse", "mae"} <= set(metrics) and "auc" not in metrics
    import tensorflow as tf

    serve = tf.saved_model.load(str(model_dir / "export" / "4")).signatures["serving_default"]
    assert list(serve.structured_outputs) == ["prediction"]


def test_a_run_without_its_end_export_is_complete_and_exports_on_demand(tmp_path, capsys):
    model_dir = tmp_path / "m"
    args = ["train", DEMO, "--model-dir", str(model_dir), "--quiet",
            *sets(small({"train.steps": 2, "train.epochs": None}, evaluate=True))]  # export.at_end: false
    assert main(args) == 0
    assert "export: none (export.at_end: false)" in capsys.readouterr().out
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 and "export" not in metrics and "auc" in metrics
    assert not (model_dir / "export").exists()
    # The run is complete without its export: a rerun trains and writes nothing.
    before = (model_dir / "metrics.json").read_bytes()
    assert main(args) == 0
    assert "already at step 2" in capsys.readouterr().out
    assert (model_dir / "metrics.json").read_bytes() == before and not (model_dir / "export").exists()
    # `recflow export` writes it from the checkpoint.
    assert main(["export", DEMO, "--model-dir", str(model_dir), *args[5:]]) == 0
    assert os.listdir(model_dir / "export") == ["2"]


def test_a_run_without_its_evaluation_is_complete_and_evaluates_on_demand(tmp_path, capsys):
    model_dir = tmp_path / "m"
    args = ["train", DEMO, "--model-dir", str(model_dir), "--quiet",
            *sets(small({"train.steps": 2, "train.epochs": None}))]  # train.evaluate: false
    assert main(args) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    assert "auc" not in summary and summary.endswith("step 2  bad_records 0"), summary
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["examples"] == 256
    assert not {"auc", "logloss", "oracle_auc", "eval_examples", "eval_split"} & set(metrics)
    assert metrics["timing"]["eval"] == 0.0
    assert main(args) == 0  # complete: a rerun trains and evaluates nothing
    assert "already at step 2" in capsys.readouterr().out
    # `recflow evaluate` computes the metrics from the checkpoint and adds them.
    assert main(["evaluate", *args[1:4], *args[5:]]) == 0
    assert capsys.readouterr().out.startswith("auc ")
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["eval_examples"] == 256 and 0 <= metrics["auc"] <= 1


def test_plan_shows_physical_tables(capsys):
    assert main(["plan", "configs/deepfm_demo.yaml"]) == 0
    out = capsys.readouterr().out
    # user, item, category, city and tags agree on everything but item's optimizer config:
    # the demo's item table sets adagrad explicitly, equal to the default, so all fuse.
    assert "physical tables: 2" in out and "logical tables: 10" in out
    # Slots follow the features sorted by name, whatever the order of the config's lines.
    assert "4:user (user_id)" in out and "2:item (hist_items, item_id)" in out
    assert "item.linear" in out
    capsys.readouterr()
    assert main(["plan", "configs/deepfm_demo.yaml", "--ps", "4", "--set", "embedding.fusion=false"]) == 0
    out = capsys.readouterr().out
    assert "physical tables: 10" in out and "(mixed id >> 32) mod 4" in out and "~250,000 keys" in out
