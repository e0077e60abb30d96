"""Process-boundary tests: SIGKILL then resume, and online learning with --follow."""

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import procs
import pytest
import yaml
from conftest import DEMO

import recflow.api as recflow_api
from recflow.cli import main
from recflow.data.writer import write_columns
from recflow.errors import DataError

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")


def recflow(*args, **kwargs):
    return procs.Popen([sys.executable, "-m", "recflow.cli", *args], env=ENV, **kwargs)


def tables_report(model_dir) -> dict:
    """What `recflow tables --json` prints for `model_dir`, per logical table (run in this
    process: what it reads is the model dir, not the process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tables", str(model_dir), "--json"]) == 0
    return json.loads(out.getvalue())["tables"]


def tables(model_dir):
    """Keys per logical table."""
    return {name: t["keys"] for name, t in tables_report(model_dir).items()}


# Killed after the checkpoint of step 32, the resumed run trains 68 more steps, past the
# user ttl of 60: rows idle since before the kill are evicted after the resume.
KILL_STEPS = 100


def kill_config(tmp_path, model_dir):
    overrides = [
        "data.synthetic={rows: 20000, eval_rows: 500, seed: 5, schema: demo}",
        "data.batch_size=32",
        "train.epochs=null",
        f"train.steps={KILL_STEPS}",
        "train.checkpoint_every_steps=16",
        "export.at_end=false",  # the runs are compared by their tables and rows
        "train.evaluate=false",
        "tables.item.admission={min_count: 3}",
        "tables.user.eviction={ttl_steps: 60}",
        "model.params={dnn: {hidden_units: [8]}}",
        f"train.model_dir={model_dir}",
    ]
    return ["train", "configs/deepfm_demo.yaml", "--quiet"] + [a for o in overrides for a in ("--set", o)]


def test_sigkill_after_second_checkpoint_then_resume_matches_uninterrupted(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert recflow(*kill_config(tmp_path, whole)).wait(timeout=600) == 0

    proc = recflow(*kill_config(tmp_path, killed), stdout=subprocess.DEVNULL)
    second = killed / "checkpoints" / "ckpt-32.index"
    deadline = time.time() + 300
    while not second.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "metrics.json").exists()  # it really died mid-run

    assert recflow(*kill_config(tmp_path, killed)).wait(timeout=600) == 0
    done = json.loads((killed / "metrics.json").read_text())
    assert done["steps"] == KILL_STEPS == json.loads((whole / "metrics.json").read_text())["steps"]
    assert tables(killed) == tables(whole)
    assert_same_rows(killed, whole)


def test_a_finished_run_given_more_epochs_trains_exactly_the_new_pass(tmp_path):
    """The final checkpoint holds no input position (no pipeline is built after the last
    pass): the next pass starts at its beginning, as in one run of all the epochs.
    In this process (`recflow train` calls `recflow.api.train`): what the second run
    reads is the model dir."""
    def run(model_dir, epochs):
        settings = [
            "data.synthetic={rows: 2000, eval_rows: 200, seed: 4, schema: demo}",
            "data.batch_size=64", f"train.epochs={epochs}", "train.checkpoint_every_steps=null",
            "model.params={dnn: {hidden_units: [8]}}",
            "export.at_end=false",  # compared by rows
        ]
        recflow_api.train("configs/deepfm_demo.yaml", model_dir=str(model_dir), overrides=settings)
        return json.loads((model_dir / "metrics.json").read_text())

    whole, extended = tmp_path / "whole", tmp_path / "extended"
    assert run(whole, 2)["steps"] == 2 * 32
    assert run(extended, 1)["steps"] == 32
    assert run(extended, 2)["steps"] == 2 * 32
    assert_same_rows(extended, whole)


def test_files_added_mid_epoch_join_at_the_next_epoch_and_are_never_dropped(tmp_path, caplog):
    """A resumed epoch reads on over the files it began with. A file added to data.train
    meanwhile is trained from the next epoch; when the resumed epoch is the run's last,
    the run is refused rather than end without it."""
    assert main(["data", "synth", "--out", str(tmp_path), "--rows", "600"]) == 0
    header, *rows = (tmp_path / "train.csv").read_text().splitlines()
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("\n".join([header, *rows[:400]]) + "\n")
    b.write_text("\n".join([header, *rows[400:]]) + "\n")
    model_dir = tmp_path / "model"

    def train(files, epochs, **more):
        overrides = {
            "data.format": "csv", "data.train": [str(f) for f in files], "data.eval": str(tmp_path / "eval.csv"),
            "data.batch_size": 64, "train.epochs": epochs, "train.checkpoint_every_steps": 3,
            "train.evaluate": False, "export.at_end": False, "model.params": {"dnn": {"hidden_units": [8]}},
            **more,
        }
        return recflow_api.train(DEMO, model_dir=str(model_dir), overrides=overrides)

    assert train([a], 2, **{"train.steps": 3})["steps"] == 3  # 192 of a's 400 rows read
    first = (model_dir / "metrics.json").read_text()
    with pytest.raises(DataError, match=r"the training files changed since the checkpoint was written "
                       r"in epoch 1, the run's last \(new: \S*b\.csv\); .*train\.epochs: 2"):
        train([a, b], 1)
    assert sorted(p.name for p in (model_dir / "checkpoints").glob("*.index")) == ["ckpt-3.index"]
    assert (model_dir / "metrics.json").read_text() == first  # nothing written

    with caplog.at_level(logging.WARNING, logger="recflow"):
        metrics = train([a, b], 2)
    assert f"written in epoch 1 (new: {os.path.realpath(b)}); " in caplog.text
    # Epoch 1: the rest of a; epoch 2: a and b, each row once.
    assert metrics["examples"] == metrics["examples_read"] == (400 - 3 * 64) + 600


def test_a_resume_with_shuffle_changed_starts_its_epoch_over(tmp_path, caplog, monkeypatch):
    """An input position holds the order its epoch began with. Resumed with data.shuffle
    changed, the epoch starts over from its first row (none is dropped), with a warning,
    and its new position is the one a later resume goes on from; a position whose record
    cannot tell is refused in one line, nothing written."""
    assert main(["data", "synth", "--out", str(tmp_path), "--rows", "600"]) == 0
    model_dir = tmp_path / "model"

    def train(shuffle, **more):
        overrides = {
            "data.format": "csv", "data.train": str(tmp_path / "train.csv"),
            "data.eval": str(tmp_path / "eval.csv"), "data.batch_size": 64, "data.shuffle": shuffle,
            "train.epochs": 1, "train.checkpoint_every_steps": 3, "train.evaluate": False,
            "export.at_end": False, "model.params": {"dnn": {"hidden_units": [8]}}, **more,
        }
        return recflow_api.train(DEMO, model_dir=str(model_dir), overrides=overrides)

    assert train(True, **{"train.steps": 3})["steps"] == 3  # 192 of the 600 rows read
    first = (model_dir / "metrics.json").read_text()

    # A checkpoint of an older recflow records no shuffle: its position fails to restore.
    from recflow.training.runner import LocalRunner

    with monkeypatch.context() as patch:
        patch.setattr(LocalRunner, "_resumed_record", lambda self, epoch: {})
        with pytest.raises(DataError, match=r"ckpt-3: its input position does not fit this config's "
                           r"input pipeline \(a data setting that shapes it changed since\)"):
            train(False)
    assert sorted(p.name for p in (model_dir / "checkpoints").glob("*.index")) == ["ckpt-3.index"]
    assert (model_dir / "metrics.json").read_text() == first  # nothing written

    with caplog.at_level(logging.WARNING, logger="recflow"):
        metrics = train(False, **{"train.steps": 8})
    assert "data.shuffle: changed since the checkpoint was written in epoch 1 (it was true)" in caplog.text
    assert metrics["examples"] == metrics["examples_read"] == 5 * 64  # the epoch from its first row
    # Stopped again part way: the new position goes on, in the order it began with.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recflow"):
        metrics = train(False)
    assert "data.shuffle" not in caplog.text
    assert metrics["examples"] == metrics["examples_read"] == 600 - 5 * 64
    assert metrics["steps"] == 3 + 10  # ceil(600 / 64) steps after the first 3


def test_a_position_of_the_other_kind_of_run_is_announced(tmp_path):
    """Local runs and parameter servers keep input positions in their own forms, and neither
    reads on from the other's: a checkpoint written part way through an epoch by the other
    kind is announced (its epoch starts over); one written between epochs is not."""
    import tensorflow as tf

    from recflow.distribute.splits import Split, SplitState
    from recflow.training import checkpoints
    from recflow.training.trainer import _position_of_the_other_kind

    assert main(["data", "synth", "--out", str(tmp_path), "--rows", "600"]) == 0

    def stored(model_dir):  # what `_position_of_the_other_kind` reads of a model dir
        return types.SimpleNamespace(saved_value=lambda name: checkpoints.saved_value(str(model_dir / "checkpoints"), name))

    def train(model_dir, **more):
        overrides = {
            "data.format": "csv", "data.train": str(tmp_path / "train.csv"),
            "data.eval": str(tmp_path / "eval.csv"), "data.batch_size": 64,
            "train.checkpoint_every_steps": 3, "train.evaluate": False, "export.at_end": False,
            "model.params": {"dnn": {"hidden_units": [8]}}, **more,
        }
        recflow_api.train(DEMO, model_dir=str(model_dir), overrides=overrides)
        return stored(model_dir)

    part_way = train(tmp_path / "part", **{"train.epochs": 2, "train.steps": 3})
    assert _position_of_the_other_kind(part_way, local=True) is None
    assert _position_of_the_other_kind(part_way, local=False).startswith(
        "the checkpoint was written by a local run part way through epoch 1; parameter servers "
        "cannot read on from its input position, so the epoch starts over")
    done = train(tmp_path / "done", **{"train.epochs": 1})  # no position after the last pass
    assert _position_of_the_other_kind(done, local=False) is None

    # A parameter-server checkpoint: the split state beside the epoch.
    splits = [Split(0, file="a.csv"), Split(1, file="b.csv")]
    for i, (positions, told) in enumerate([([0, 0], False), ([3, 0], True), ([-1, 2], True)]):
        model_dir = tmp_path / f"ps-{i}"
        state = SplitState(splits, recflow_api.load(DEMO, overrides={"data.format": "synthetic"}).data)
        state.write(positions)
        checkpoint = tf.train.Checkpoint(epoch=tf.Variable(0, dtype=tf.int64), splits=state)
        tf.train.CheckpointManager(checkpoint, str(model_dir / "checkpoints"), 1).save(checkpoint_number=5)
        message = _position_of_the_other_kind(stored(model_dir), local=True)
        assert (message is not None) == told, positions
        if told:
            assert message.startswith("the checkpoint was written under parameter servers part way "
                                      "through epoch 1; a local run cannot read on")
        assert _position_of_the_other_kind(stored(model_dir), local=False) is None


def test_a_run_killed_after_its_final_checkpoint_writes_its_export_and_metrics_on_restart(tmp_path):
    """kill -9 between the final checkpoint and the export/metrics: the restart trains nothing
    and writes what the run still owed; once they exist, a restart writes nothing."""
    model_dir = tmp_path / "run"
    settings = [
        "data.synthetic={rows: 1000, eval_rows: 200, seed: 4, schema: demo}",
        "data.batch_size=100", "train.epochs=1", "train.checkpoint_every_steps=null",
        "model.params={dnn: {hidden_units: [8]}}", f"train.model_dir={model_dir}",
    ]
    args = ["train", "configs/deepfm_demo.yaml", "--quiet"] + [a for o in settings for a in ("--set", o)]
    assert recflow(*args, stdout=subprocess.DEVNULL).wait(timeout=600) == 0
    first = json.loads((model_dir / "metrics.json").read_text())
    # What a kill right after the final checkpoint leaves: no export, no metrics.
    (model_dir / "metrics.json").unlink()
    for version in (model_dir / "export").iterdir():
        subprocess.run(["rm", "-r", str(version)], check=True)

    proc = recflow(*args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == first["steps"] == 10 and metrics["examples"] == 0  # nothing retrained
    assert metrics["auc"] == first["auc"]  # the same model, evaluated
    assert (model_dir / "export" / "10" / "saved_model.pb").exists()

    written = (model_dir / "metrics.json").stat().st_mtime_ns
    proc = recflow(*args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "already at step 10" in out
    assert (model_dir / "metrics.json").stat().st_mtime_ns == written


def assert_same_rows(model_dir, reference):
    """Every logical table holds the same ids, each once, with the same embedding, optimizer
    slots, count and last step."""
    from recflow.training.tables import restore_engine

    got, want = restore_engine(str(model_dir)).logical_rows(), restore_engine(str(reference)).logical_rows()
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        assert np.unique(a.ids).size == a.ids.size, f"{name}: an id held twice"
        ia, ib = np.argsort(a.ids), np.argsort(b.ids)
        np.testing.assert_array_equal(a.ids[ia], b.ids[ib], err_msg=name)
        np.testing.assert_array_equal(a.count[ia], b.count[ib], err_msg=name)
        np.testing.assert_array_equal(a.last_step[ia], b.last_step[ib], err_msg=name)
        np.testing.assert_allclose(a.emb[ia], b.emb[ib], rtol=1e-4, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(a.slots[ia], b.slots[ib], rtol=1e-4, atol=1e-6, err_msg=name)


def stream_file(directory, index, rows=48):
    """File `index` has its own users, so the tables show what was trained."""
    rng = np.random.default_rng(index)
    columns = {
        "click": rng.integers(0, 2, rows),
        "user": (index * 1000 + np.arange(rows) % 12).astype(np.int64),
        "item": np.array([f"i{k}" for k in rng.integers(0, 20, rows)], dtype=object),
    }
    write_columns(str(directory / f"part-{index:03d}.csv"), columns, "csv", labels=["click"])


def wait_for_line(proc, text, timeout=180):
    deadline = time.time() + timeout
    lines = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no line with {text!r}; got {lines}")


def test_follow_trains_every_file_exactly_once_across_a_restart(tmp_path):
    stream, model_dir = tmp_path / "stream", tmp_path / "run"
    stream.mkdir()
    config = {
        "version": 1,
        "data": {"format": "csv", "train": str(stream / "*.csv"), "label": "click",
                 "batch_size": 16, "shuffle": False},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "dim": 4},
            {"name": "item", "kind": "categorical", "dtype": "string", "dim": 4},
        ],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(model_dir), "checkpoint_every_steps": 2},
        "export": {"delta_every_steps": 3},
    }
    path = tmp_path / "stream.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ("train", str(path), "--follow", "--poll-seconds", "0.1")

    proc = recflow(*args, stdout=subprocess.PIPE, text=True)
    for index in range(3):
        stream_file(stream, index)
        wait_for_line(proc, f"part-{index:03d}.csv")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert tables(model_dir)["user"] == 3 * 12

    proc = recflow(*args, stdout=subprocess.PIPE, text=True)
    stream_file(stream, 3)
    wait_for_line(proc, "part-003.csv")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 0

    metrics = json.loads((model_dir / "metrics.json").read_text())
    files = [os.path.basename(f) for f in metrics["files_consumed"]]
    assert files == [f"part-{i:03d}.csv" for i in range(4)]
    assert metrics["steps"] == 4 * 3  # 48 rows per file, batches of 16: each file once
    assert tables(model_dir)["user"] == 4 * 12
    assert sorted(os.listdir(model_dir / "export"), key=int) == ["9", "12"]  # each stop's step
    assert os.listdir(model_dir / "deltas")
