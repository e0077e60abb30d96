"""The fixed-cost paths of a job: evaluation, reused exports, phase timing, pipelines
traced without AutoGraph. Behaviour only; speed is measured by scripts/bench_train.py."""

import json

import numpy as np
import pytest
import tensorflow as tf
from conftest import items, sets, small

from recflow.cli import main
from recflow.config import load_config
from recflow.data import generate, make_dataset, records
from recflow.training.timing import PHASES
from recflow.training.trainer import Trainer

# 6 steps of 256 over 3000 rows (two passes in the timing test: a steady second one),
# 700 eval rows (one inference batch); the tests call `Trainer.export` themselves.
SETTINGS = small({
    "data.synthetic": {"rows": 3000, "eval_rows": 700, "seed": 3, "schema": "demo"},
    "data.batch_size": 256,
    "train.epochs": None,
    "train.steps": 6,
    "train.checkpoint_every_steps": None,
    "model.params": {"dnn": {"hidden_units": [16]}},
})
SMALL = items(SETTINGS)


def small_config(tmp_path, *extra):
    return load_config(
        "configs/deepfm_demo.yaml", SMALL + [f"train.model_dir={tmp_path / 'run'}", *extra]
    )


def numpy_auc(labels, scores):
    """P(score of a positive > score of a negative), ties counting one half: every pair."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return (greater + 0.5 * ties) / (pos.size * neg.size)


def test_evaluator_matches_numpy_and_traces_once(tmp_path):
    trainer = Trainer(small_config(tmp_path), verbose=0)
    trainer.fit()
    first = trainer.evaluate()
    second = trainer.evaluate()
    assert first == second
    # One compiled predict function, traced once, serves both passes.
    assert trainer._evaluator._predict.experimental_get_tracing_count() == 1
    assert trainer._evaluator.batch_size >= 16384  # inference-sized batches

    # Independently: the model's scores of the raw eval rows, metrics in numpy.
    columns, _ = generate(trainer.config.data.synthetic, "eval")
    raw = {}
    for f in trainer.config.features:
        values = np.asarray(columns[f.source])
        raw[f.name] = tf.constant(values.astype(np.float32) if f.kind == "numeric" else values)
    p = trainer.model.predict_raw(raw)["probability"].numpy().reshape(-1).astype(np.float64)
    y = np.asarray(columns["click"], np.float64)
    assert first["eval_examples"] == y.size == 700
    assert first["auc"] == pytest.approx(numpy_auc(y, p), abs=2e-6)
    q = np.clip(p, 1e-7, 1 - 1e-7)
    logloss = -np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))
    assert first["logloss"] == pytest.approx(logloss, abs=2e-6)


def test_predict_is_traced_beside_the_first_step_and_a_failed_trace_is_redone(tmp_path):
    trainer = Trainer(small_config(tmp_path, "train.evaluate=true"), verbose=0)
    trainer.fit()
    evaluator = trainer.evaluator()
    evaluator._tracing.join()  # `prepare`'s thread, started before the first step's call
    prepared = evaluator._predict
    assert prepared is not None and prepared.experimental_get_tracing_count() == 1
    first = trainer.evaluate()
    assert evaluator._predict is prepared and prepared.experimental_get_tracing_count() == 1
    # A trace that fails in the thread (here: batches without the model's features) leaves
    # nothing behind; the evaluation traces for its own batches.
    evaluator.prepare(({}, None, None))
    assert trainer.evaluate() == first
    assert evaluator._predict is not prepared


def load_scores(export_dir, raw):
    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    return serve(**raw)["probability"].numpy().reshape(-1)


def test_exporter_reuses_its_module_and_serves_new_weights(tmp_path):
    trainer = Trainer(small_config(tmp_path), verbose=0)
    trainer.fit()
    first_dir = trainer.model_dir.export()
    module = trainer.model_dir._exporter.module
    columns, _ = generate(trainer.config.data.synthetic, "eval")
    raw = {}
    for f in trainer.config.features:
        values = np.asarray(columns[f.source][:64])
        raw[f.name] = tf.constant(values.astype(np.float32) if f.kind == "numeric" else values)
    before = trainer.model.predict_raw(raw)["probability"].numpy().reshape(-1)
    np.testing.assert_allclose(load_scores(first_dir, raw), before, rtol=1e-5, atol=1e-6)

    # Train on: new rows and new dense weights, then export again with the same module.
    step = tf.function(trainer.model.train_step, autograph=False)
    for batch in trainer.dataset("train", epochs=1, shuffle=False).take(4):
        step(batch)
    second_dir = trainer.model_dir.export()
    assert trainer.model_dir._exporter.module is module  # built once, refreshed
    assert second_dir.endswith("/10") and first_dir.endswith("/6")
    after = trainer.model.predict_raw(raw)["probability"].numpy().reshape(-1)
    assert np.max(np.abs(after - before)) > 1e-4  # the weights did move
    np.testing.assert_allclose(load_scores(second_dir, raw), after, rtol=1e-5, atol=1e-6)
    # The first version still serves what it saved.
    np.testing.assert_allclose(load_scores(first_dir, raw), before, rtol=1e-5, atol=1e-6)
    served_step = tf.saved_model.load(second_dir).global_step
    assert int(served_step) == 10


def test_metrics_json_has_phase_timing(tmp_path):
    model_dir = tmp_path / "run"
    args = ["train", "configs/deepfm_demo.yaml", "--model-dir", str(model_dir), "--quiet"]
    args += sets({**SETTINGS, "train.epochs": 2, "train.steps": None, "export.at_end": True})
    assert main(args) == 0
    metrics = json.loads((model_dir / "metrics.json").read_text())
    timing = metrics["timing"]
    assert set(PHASES) <= set(timing)
    for phase in PHASES:
        assert isinstance(timing[phase], float) and timing[phase] >= 0.0
    assert timing["trace"] > 0.0 and timing["train"] > 0.0 and timing["export"] > 0.0
    assert timing["trace"] <= timing["train"]  # the step is traced inside the training loop
    # CPU seconds per phase: startup holds the imports (this test process's, so far).
    assert set(timing["cpu"]) == set(PHASES)
    assert all(isinstance(v, float) and v >= 0.0 for v in timing["cpu"].values())
    assert timing["cpu"]["startup"] > 0.0 and timing["cpu"]["train"] > 0.0
    # Two passes over 3000 rows: the rate of the second pass is known.
    assert metrics["examples"] == 6000
    assert timing["steady_examples_per_sec"] > 0.0


def test_pipeline_map_functions_are_not_converted(tmp_path, monkeypatch):
    from tensorflow.python.autograph.impl import api

    converted = []
    convert = api._convert_actual
    monkeypatch.setattr(
        api, "_convert_actual", lambda entity, *a, **k: converted.append(entity) or convert(entity, *a, **k)
    )
    # A CSV pipeline (parse map) and the trainer's transform map over it.
    config = small_config(tmp_path)
    columns, _ = generate(config.data.synthetic, "train")
    from recflow.data.writer import write_columns

    path = tmp_path / "train.csv"
    write_columns(str(path), {k: np.asarray(v)[:500] for k, v in columns.items()}, "csv", labels=["click"])
    config = small_config(tmp_path, "data.format=csv", f"data.train={path}")
    trainer = Trainer(config, verbose=0)
    ds = trainer.dataset("train", epochs=1, shuffle=True)
    rows = sum(int(tf.shape(labels["click"])[0]) for _, labels, _ in ds)
    assert rows == 500
    assert converted == []

    # `finish` maps a function as written: Python control flow on a tensor cannot trace.
    with pytest.raises((TypeError, tf.errors.OperatorNotAllowedInGraphError)):
        records.finish(tf.data.Dataset.range(4).batch(2), lambda x: x if tf.reduce_sum(x) > 0 else -x)


def test_block_shuffle_is_a_seeded_permutation(tmp_path):
    config = small_config(tmp_path)
    data = config.data

    def order(seed):
        d = type(data)(**{**data.__dict__, "seed": seed, "batch_size": 64, "shuffle_buffer": 400})
        ds = records.batched(tf.data.Dataset.range(1000), d, shuffle=True, epochs=1)
        batches = [b.numpy() for b in ds]
        assert [len(b) for b in batches] == [64] * 15 + [40]  # full batches across blocks
        return np.concatenate(batches)

    a, b = order(1), order(1)
    np.testing.assert_array_equal(a, b)  # seeded: the same order again
    assert sorted(a.tolist()) == list(range(1000))  # every record once
    assert not np.array_equal(a, np.arange(1000)) and not np.array_equal(a, order(2))
    # Blocks of 50 records (shuffle_buffer // 8) shuffled in a window of 8 blocks: the first
    # batch (two blocks) comes from the first 9 blocks.
    assert a[:64].max() < 450


def test_parse_traced_once_serves_other_files_and_names_them(tmp_path, monkeypatch):
    """A run's pipelines share one trace of the parse function (and the trainer's one
    trace of its transforms), and a reused parse still names the file it reads."""
    from recflow.data.writer import write_columns

    columns, _ = generate(small_config(tmp_path).data.synthetic, "train")
    rows = {k: np.asarray(v)[:300] for k, v in columns.items()}
    paths = [tmp_path / f"part-{i}.csv" for i in range(3)]
    for path in paths:
        write_columns(str(path), rows, "csv", labels=["click"])
    lines = paths[2].read_text().splitlines()
    label = lines[0].split(",").index("click")
    fields = lines[7].split(",")
    fields[label] = "not-a-label"
    lines[7] = ",".join(fields)  # line 8 of part-2.csv
    paths[2].write_text("\n".join(lines) + "\n")
    config = small_config(
        tmp_path, "data.format=csv", f"data.train={paths[0]}", "data.on_bad_record=fail"
    )
    trainer = Trainer(config, verbose=0)
    traced = []
    function = tf.function
    monkeypatch.setattr(
        records.tf, "function", lambda fn, **k: traced.append(fn.__name__) or function(fn, **k)
    )
    first = trainer.dataset("train", epochs=1, shuffle=False)
    assert sum(int(tf.shape(labels["click"])[0]) for _, labels, _ in first) == 300
    assert traced == ["parse", "fn"]  # the parse function and the transforms, once each
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"{paths[2]}: line 8: "):
        for _ in trainer.dataset("train", epochs=1, shuffle=False, files=paths[1:]):
            pass
    assert traced == ["parse", "fn"]  # two other files: the same traces


def test_pipelines_run_without_model_based_autotuning(tmp_path):
    """Its optimizer thread stalled the end of an iterator (see `records.options`): off in
    the training, evaluation and raw pipelines alike. The static rewrites stay on there (a
    checkpoint's input position names the rewritten graph's nodes); only pipelines that are
    never checkpointed (a PS chunk's) go `without_rewrites`."""
    trainer = Trainer(small_config(tmp_path), verbose=0)
    for ds in (
        trainer.epoch_dataset(0),
        trainer.dataset("eval", epochs=1),
        make_dataset(trainer.config, "train", epochs=1),
    ):
        assert ds.options().autotune.enabled is False
        assert ds.options().experimental_optimization.apply_default_optimizations is not False
        chunk = records.without_rewrites(ds)
        assert chunk.options().experimental_optimization.apply_default_optimizations is False
        assert chunk.options().autotune.enabled is False
