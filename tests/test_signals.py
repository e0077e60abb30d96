"""SIGTERM and SIGINT stop a run with a checkpoint that resumes exactly (no eviction off
schedule), a summary that says so, and exit 143 / 130."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import procs
import pytest
import tf_keras as keras
from conftest import DEMO as CONFIG
from conftest import small

import recflow

# 24 steps (1536 rows of 64), checkpoints every 5 with admission and eviction: a signal
# lands on or off the checkpoint schedule, and a checkpoint off it must not evict.
# No export at the end: the resumed run is compared by its checkpoint and metrics.
SMALL = small({
    "data.synthetic": {"rows": 1536, "eval_rows": 128, "seed": 11, "schema": "demo"},
    "data.batch_size": 64,
    "train.checkpoint_every_steps": 5,
    "tables.item.admission": {"min_count": 2},
    "tables.item.eviction": {"ttl_steps": 4},
    "tables.user.eviction": {"ttl_steps": 3},
})


class SignalAt(keras.callbacks.Callback):
    """Sends this process `signum` after global step `step` (a real signal, handled by the
    trainer's own handler, as a Ctrl-C or a `kill` would be)."""

    def __init__(self, step, signum):
        super().__init__()
        self.step, self.signum = step, signum

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step:
            os.kill(os.getpid(), self.signum)


def _checkpoint_tensors(model_dir):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints")))
    names = reader.get_variable_to_dtype_map()
    return {n: reader.get_tensor(n) for n, d in names.items() if d == tf.float32 and "/embedding/" not in n}


def _rows(model_dir):
    from recflow.training.tables import restore_engine

    return restore_engine(str(model_dir)).logical_rows()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("signals") / "whole"
    metrics = recflow.train(CONFIG, model_dir=str(model_dir), overrides=SMALL)
    assert metrics["steps"] == 24
    return model_dir


# Each signal at a step off the checkpoint schedule of every 5, drawn once at random (seed
# 2026), and SIGTERM on it (both signals take one path: one handler, one stop).
_OFF = [s for s in range(1, 24) if s % 5]
_CASES = [(signum, int(s)) for signum, s in zip(
    (signal.SIGTERM, signal.SIGINT), np.random.default_rng(2026).choice(_OFF, 2, replace=False)
)] + [(signal.SIGTERM, 10)]


@pytest.mark.parametrize("signum, step", _CASES)
def test_a_signal_at_any_step_resumes_to_the_uninterrupted_model(uninterrupted, tmp_path, signum, step):
    model_dir = tmp_path / "stopped"
    stopped = recflow.train(CONFIG, model_dir=str(model_dir), overrides=SMALL, callbacks=[SignalAt(step, signum)])
    assert stopped["interrupted"] == signal.Signals(signum).name
    assert stopped["steps"] == step
    assert not (model_dir / "metrics.json").exists()  # a cut-short run writes no metrics
    assert not (model_dir / "export").exists()
    done = recflow.train(CONFIG, model_dir=str(model_dir), overrides=SMALL)
    assert done["steps"] == 24 and "interrupted" not in done
    got, want = _rows(model_dir), _rows(uninterrupted)
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        ia, ib = np.argsort(a.ids), np.argsort(b.ids)
        np.testing.assert_array_equal(a.ids[ia], b.ids[ib], err_msg=name)
        np.testing.assert_array_equal(a.count[ia], b.count[ib], err_msg=name)
        np.testing.assert_array_equal(a.last_step[ia], b.last_step[ib], err_msg=name)
        np.testing.assert_allclose(a.emb[ia], b.emb[ib], rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(a.slots[ia], b.slots[ib], rtol=1e-5, atol=1e-7, err_msg=name)
    dense_got, dense_want = _checkpoint_tensors(model_dir), _checkpoint_tensors(uninterrupted)
    assert dense_got.keys() == dense_want.keys()
    for name in dense_want:
        np.testing.assert_allclose(dense_got[name], dense_want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # The resumed run ends as the uninterrupted one did (the same model: its metrics are
    # left out here, `train.evaluate: false`).
    a = json.loads((model_dir / "metrics.json").read_text())
    b = json.loads((uninterrupted / "metrics.json").read_text())
    assert a["steps"] == b["steps"] == 24
    assert stopped["examples"] + a["examples"] == b["examples"] == 24 * 64  # each row once


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_cli_says_where_it_stopped_and_exits_128_plus_the_signal(tmp_path, signum, code):
    model_dir = tmp_path / "cli"
    sets = {
        "data.synthetic": {"rows": 400000, "eval_rows": 128, "seed": 2, "schema": "demo"},
        "data.batch_size": 64,
        "model.params": {"dnn": {"hidden_units": [8]}},
        "train.checkpoint_every_steps": 20,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    proc = procs.Popen(
        [sys.executable, "-m", "recflow.cli", "train", CONFIG, "--quiet", "--model-dir", str(model_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    first = model_dir / "checkpoints" / "ckpt-20.index"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    line = out.strip().splitlines()[-1]
    assert line.startswith("stopped at step ") and f"(interrupted by {signal.Signals(signum).name})" in line
    step = int(line.split()[3])
    assert (model_dir / "checkpoints" / f"ckpt-{step}.index").exists()
    assert not (model_dir / "metrics.json").exists()
