"""Train -> evaluate -> export -> serve without recflow -> predict, and resume."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from recflow.cli import main

SMALL = [
    "data.synthetic={rows: 4000, eval_rows: 1000, seed: 3, schema: demo}",
    "data.batch_size=256",
    "train.epochs=null",
    "train.steps=12",
    "train.checkpoint_every_steps=5",
    "model.params={dnn: {hidden_units: [16]}}",
]


def train(model_dir, *extra):
    args = ["train", "configs/deepfm_demo.yaml", "--model-dir", str(model_dir), "--quiet"]
    for item in SMALL + list(extra):
        args += ["--set", item]
    assert main(args) == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("run")
    train(model_dir)
    return model_dir


def test_model_dir_layout(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    for key in ("auc", "logloss", "examples_per_sec", "steps", "bad_records", "oracle_auc"):
        assert key in metrics
    assert metrics["steps"] == 12
    assert metrics["eval_examples"] == 1000
    assert 0.0 <= metrics["auc"] <= 1.0
    assert (trained / "config.yaml").exists()
    assert os.listdir(trained / "logs")
    checkpoints = sorted(p.name for p in (trained / "checkpoints").iterdir())
    assert "ckpt-12.index" in checkpoints and "ckpt-10.index" in checkpoints
    assert sorted(os.listdir(trained / "export")) == ["12"]  # the version is the step
    assert not [p for p in os.listdir(trained / "export") if p.startswith(".tmp")]


def raw_rows():
    from recflow.config import load_config
    from recflow.data import generate

    config = load_config("configs/deepfm_demo.yaml", SMALL)
    columns, _ = generate(config.data.synthetic, "eval")
    n = 50
    raw = {}
    for feature in config.features:
        values = np.array(columns[feature.source][:n])
        raw[feature.name] = values.astype(np.float32) if feature.kind == "numeric" else values
    raw["item_id"][0] = "never-seen-item"  # unknown ids read the default row
    return config, raw


SERVE_WITHOUT_RECFLOW = textwrap.dedent(
    """
    import sys
    sys.modules["recflow"] = None  # any `import recflow` now fails
    import numpy as np, tensorflow as tf
    export_dir, inputs, out = sys.argv[1:]
    data = np.load(inputs, allow_pickle=True)
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    specs = serve.structured_input_signature[1]
    feed = {k: tf.constant(data[k].tolist() if specs[k].dtype == tf.string else data[k], specs[k].dtype)
            for k in specs}
    np.save(out, serve(**feed)["probability"].numpy())
    """
)


@pytest.fixture(scope="module")
def restored(trained):
    """The trained model, restored from its last checkpoint (step 12)."""
    from recflow.training.trainer import Trainer

    config, _ = raw_rows()
    trainer = Trainer(config, model_dir=str(trained), verbose=0)
    assert trainer.restore() == 12
    return trainer.model


def feed(raw):
    import tensorflow as tf

    return {k: tf.constant(v.tolist() if v.dtype == object else v) for k, v in raw.items()}


def test_export_serves_in_plain_tensorflow_and_matches(trained, restored, tmp_path):
    _, raw = raw_rows()
    np.savez(tmp_path / "inputs.npz", **raw)
    script = tmp_path / "serve.py"
    script.write_text(SERVE_WITHOUT_RECFLOW)
    export_dir = trained / "export" / "12"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run(
        [sys.executable, str(script), str(export_dir), str(tmp_path / "inputs.npz"), str(tmp_path / "out.npy")],
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
    result = subprocess.run(
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
    serve = tf.saved_model.load(str(trained / "export" / "12")).signatures["serving_default"]
    served = serve(**feed(raw))["probability"].numpy().reshape(-1)
    assert served.shape == (50,) and np.ptp(served) > 1e-3  # a trained model, not a constant
    np.testing.assert_allclose(eager, served, rtol=0, atol=1e-6)
    np.testing.assert_allclose(traced["probability"].numpy().reshape(-1), served, rtol=0, atol=1e-6)


def test_resume_continues_to_the_total(trained, tmp_path):
    # `train.steps` is a total: a second run on the same dir goes from 12 to 20.
    model_dir = tmp_path / "resumed"
    train(model_dir, "train.steps=8")
    train(model_dir, "train.steps=20")
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == 20
    # Only steps 9..20 ran: 4000 rows make 15 full batches and one of 160 (step 16).
    assert metrics["examples"] == 11 * 256 + (4000 - 15 * 256)
    assert sorted(os.listdir(model_dir / "export"), key=int) == ["8", "20"]


def test_evaluate_and_export_commands(trained):
    args = ["--model-dir", str(trained)] + [a for s in SMALL for a in ("--set", s)]
    assert main(["evaluate", "configs/deepfm_demo.yaml", *args]) == 0
    assert main(["export", "configs/deepfm_demo.yaml", *args]) == 0
    assert sorted(os.listdir(trained / "export")) == ["12"]  # the same step: replaced


def test_regression_task_exports_prediction(tmp_path):
    model_dir = tmp_path / "reg"
    train(model_dir, "task={type: regression, metrics: [mse, mae]}", "train.steps=4")
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert {"mse", "mae"} <= set(metrics) and "auc" not in metrics
    import tensorflow as tf

    serve = tf.saved_model.load(str(model_dir / "export" / "4")).signatures["serving_default"]
    assert list(serve.structured_outputs) == ["prediction"]


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
