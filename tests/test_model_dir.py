"""The model dir's building blocks: writer lock, stale temps, checkpoint
verification and fallback, index rebuild, stale deltas, YAML node bound,
portable export config."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

from recflow.config.loader import NodeLimitError, load_config, safe_load
from recflow.errors import RecflowError
from recflow.exporter.saved_model import portable_config
from recflow.training import checkpoints, lock
from recflow.training.deltas import set_aside_stale_deltas

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


# ----------------------------------------------------------------------------- lock


def test_second_writer_is_refused_with_the_holders_pid(tmp_path):
    with lock.writer_lock(str(tmp_path), "train"):
        with pytest.raises(RecflowError) as e:
            with lock.writer_lock(str(tmp_path), "export"):
                pass
        assert f"pid {os.getpid()}" in str(e.value) and "recflow train" in str(e.value)
        assert "\n" not in str(e.value)
    with lock.writer_lock(str(tmp_path), "export"):  # released at the end of the block
        pass


def test_lock_of_a_killed_holder_is_free(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "scripts", "hold_writer_lock.py"), str(tmp_path)],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RecflowError, match=f"pid {holder.pid}"):
        with lock.writer_lock(str(tmp_path), "train"):
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with lock.writer_lock(str(tmp_path), "train"):
        pass


def test_model_dir_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(RecflowError, match="existing file, not a directory"):
        lock.ensure_dir(str(path))


# ----------------------------------------------------------------------------- stale temps


def test_stale_temps_are_removed_and_nothing_else(tmp_path):
    stale = ["checkpoints/ckpt-7_temp/part-0", "export/.tmp-abc/saved_model.pb",
             "deltas/.tmp-x/manifest.json", ".tmp-123", "config.yaml.tmp-4242"]
    kept = ["checkpoints/ckpt-5.index", "export/5/saved_model.pb", "deltas/5/manifest.json",
            "config.yaml", "metrics.json", "deltas/.stale-5/10/manifest.json"]
    for rel in stale + kept:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    removed = lock.remove_stale_temps(str(tmp_path))
    assert removed == sorted(["checkpoints/ckpt-7_temp", "export/.tmp-abc", "deltas/.tmp-x",
                              ".tmp-123", "config.yaml.tmp-4242"])
    assert all((tmp_path / rel).exists() for rel in kept)
    assert not any((tmp_path / rel).exists() for rel in stale)


# ----------------------------------------------------------------------------- checkpoints


def three_checkpoints(directory):
    """ckpt-1, ckpt-2, ckpt-3 of one variable holding 1.0, 2.0, 3.0 (repeated)."""
    v = tf.Variable(tf.zeros([64]))
    ckpt = tf.train.Checkpoint(v=v)
    manager = tf.train.CheckpointManager(ckpt, str(directory), max_to_keep=5)
    for step in (1, 2, 3):
        v.assign(tf.fill([64], float(step)))
        manager.save(checkpoint_number=step)
    return str(directory)


def restored_value(prefix):
    return float(tf.train.load_checkpoint(prefix).get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE")[0])


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip(path):
    data = bytearray(open(path, "rb").read())
    for i in range(0, len(data), 5):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def empty(path):
    open(path, "w").close()


@pytest.mark.parametrize(
    "damage, suffix",
    [(truncate, ".data-00000-of-00001"), (flip, ".data-00000-of-00001"), (empty, ".index")],
    ids=["truncated data", "flipped bytes", "empty index"],
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage, suffix):
    d = three_checkpoints(tmp_path / "ck")
    damage(os.path.join(d, "ckpt-3" + suffix))
    with caplog.at_level(logging.WARNING):
        good = checkpoints.readable_checkpoint(d)
    assert good == os.path.join(d, "ckpt-2") and restored_value(good) == 2.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ckpt-3.index" in warnings[0] and "ckpt-3.data-00000-of-00001" in warnings[0]
    checkpoints.repair_checkpoints(d, good)
    assert tf.train.latest_checkpoint(d) == good
    assert sorted(os.listdir(os.path.join(d, ".damaged"))) == ["ckpt-3.data-00000-of-00001", "ckpt-3.index"]


def test_no_readable_checkpoint_names_the_files(tmp_path):
    d = three_checkpoints(tmp_path / "ck")
    for step in (1, 2, 3):
        truncate(os.path.join(d, f"ckpt-{step}.data-00000-of-00001"))
    with pytest.raises(RecflowError) as e:
        checkpoints.readable_checkpoint(d)
    message = str(e.value)
    assert "no readable checkpoint" in message and "\n" not in message
    assert all(f"ckpt-{s}.data-00000-of-00001" in message for s in (1, 2, 3))


def test_garbage_index_file_is_rebuilt_from_the_checkpoints_present(tmp_path, caplog):
    d = three_checkpoints(tmp_path / "ck")
    with open(os.path.join(d, "checkpoint"), "w") as f:
        f.write("\x00garbage{{{\n")
    assert tf.train.latest_checkpoint(d) is None  # what TF alone makes of it
    good = checkpoints.readable_checkpoint(d)
    assert good == os.path.join(d, "ckpt-3")
    with caplog.at_level(logging.WARNING):
        checkpoints.repair_checkpoints(d, good)
    assert tf.train.latest_checkpoint(d) == good
    state = tf.train.get_checkpoint_state(d)
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert any("rebuilt" in r.getMessage() for r in caplog.records)


def test_no_checkpoint_at_all_is_none(tmp_path):
    assert checkpoints.readable_checkpoint(str(tmp_path / "nothing")) is None


# ----------------------------------------------------------------------------- deltas


def test_deltas_newer_than_the_checkpoint_are_set_aside(tmp_path, caplog):
    deltas = tmp_path / "deltas"
    for step in range(5, 70, 5):
        (deltas / str(step)).mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        aside = set_aside_stale_deltas(str(deltas), 50)
    assert aside == str(deltas / ".stale-50")
    assert sorted(os.listdir(aside), key=int) == ["55", "60", "65"]
    assert sorted((d for d in os.listdir(deltas) if d.isdigit()), key=int) == [str(s) for s in range(5, 55, 5)]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    (deltas / "55").mkdir()  # a second resume from the same step keeps both sets
    assert set_aside_stale_deltas(str(deltas), 50) == str(deltas / ".stale-50.2")
    assert set_aside_stale_deltas(str(deltas), 50) is None


# ----------------------------------------------------------------------------- YAML


def bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_before_it_is_built(tmp_path):
    start = time.perf_counter()
    with pytest.raises(NodeLimitError, match="once aliases are expanded"):
        safe_load(bomb(9))  # 10**9 nodes expanded
    assert time.perf_counter() - start < 2.0
    assert safe_load(bomb(3))["a2"][0][0] == ["x"] * 10  # ~1,100 nodes: fine


def test_alias_bomb_in_model_params_is_a_one_line_error(tmp_path):
    text = open("configs/deepfm_demo.yaml").read().replace(
        "params: {dnn: {hidden_units: [64, 32], dropout: 0.0}}",
        "params:\n" + textwrap.indent(bomb(8), "    "),
    )
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(RecflowError, match="bomb.yaml: more than 100000 YAML nodes"):
        load_config(str(path))


def test_recursive_alias_is_refused():
    with pytest.raises(NodeLimitError, match="contains it"):
        safe_load("a: &a [1, *a]\n")


# ----------------------------------------------------------------------------- export config


def test_export_config_has_no_model_dir_and_no_absolute_data_paths(tmp_path):
    config = load_config("configs/deepfm_demo.yaml", [
        "data.format=csv", f"data.train=[{tmp_path}/data/train/*.csv]",
        f"data.eval={tmp_path}/data/eval.csv", f"train.model_dir={tmp_path}/secret-run",
    ])
    raw = portable_config(config)
    text = repr(raw)
    assert "model_dir" not in raw["train"] and "secret-run" not in text and str(tmp_path) not in text
    assert raw["data"]["train"] == ["*.csv"] and raw["data"]["eval"] == ["eval.csv"]
    np.testing.assert_equal(raw["train"]["steps"], config.train.steps)
