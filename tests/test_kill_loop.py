"""Randomized kill -9 loop (slow; not in the default run):

    pytest -m slow tests/test_kill_loop.py

A run with checkpoints, deltas and exports on is killed with SIGKILL at least
KILLS times at random points (while a delta, checkpoint or export is being
written, or just after, or during start-up and restore), restarted each time,
and finally run to the end. Every restart must succeed, and the end state must
equal an uninterrupted run's: table keys and full rows (embedding, optimizer
slots, count, last step) and dense variables in the final checkpoint, every
delta, and the export versions. RECFLOW_KILL_SEED picks the random schedule.

The config has no admission or eviction, so table contents are compared
exactly by key.
"""

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import procs
import pytest
import tensorflow as tf

pytestmark = pytest.mark.slow

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
KILLS = int(os.environ.get("RECFLOW_KILLS", "20"))
STEPS = 240
CKPT, DELTA, EXPORT = 10, 5, 30


def command(model_dir):
    settings = [
        "data.synthetic={rows: 4000, eval_rows: 200, seed: 3, schema: demo}",  # 125 batches/epoch
        "data.batch_size=32",
        "train.epochs=null",
        f"train.steps={STEPS}",
        f"train.checkpoint_every_steps={CKPT}",
        f"export.delta_every_steps={DELTA}",
        f"export.every_steps={EXPORT}",
        "model.params={dnn: {hidden_units: [8]}}",
        f"train.model_dir={model_dir}",
    ]
    return [sys.executable, "-m", "recflow.cli", "train", "configs/deepfm_demo.yaml", "--quiet"] + [
        a for s in settings for a in ("--set", s)
    ]


def newest(model_dir, pattern, regex_group=lambda p: p):
    steps = []
    for path in glob.glob(os.path.join(model_dir, pattern)):
        name = os.path.basename(path)
        digits = "".join(c for c in name.split(".")[0] if c.isdigit())
        if digits:
            steps.append(int(digits))
    return max(steps, default=0)


def up(n, every):
    return -(-n // every) * every


def kill_plan(rng, k):
    """(reached, trigger, delay) of kill `k`: once the run has reached a random step
    of the k-th of KILLS equal slices of the run (`reached`, a delta dir), kill it
    `delay` seconds after `trigger` appears (a glob: the next delta, checkpoint,
    checkpoint staging, export or export staging), or after `delay` alone
    (trigger None). reached None: a random moment of start-up or restore."""
    step = int(STEPS * (k + rng.random()) / KILLS)
    reached = f"deltas/{max(up(step, DELTA), DELTA)}"
    kind = rng.choice(["delta", "checkpoint", "checkpoint-temp", "export", "export-temp", "after", "start"])
    trigger = {
        "delta": f"deltas/{up(step + 1, DELTA)}",
        "checkpoint": f"checkpoints/ckpt-{up(step + 1, CKPT)}.index",
        "checkpoint-temp": "checkpoints/ckpt-*_temp*",
        "export": f"export/{min(up(step + 1, EXPORT), STEPS)}",
        "export-temp": "export/.tmp-*",
    }.get(kind)
    if kind == "start":
        return None, None, rng.uniform(0.0, 6.0)
    return reached, trigger, rng.uniform(0.0, 0.5 if trigger is None else 0.05)


def table_rows(prefix):
    """{table store: {key: row}} from a checkpoint (empty buckets dropped)."""
    reader = tf.train.load_checkpoint(prefix)
    names = reader.get_variable_to_shape_map()
    out = {}
    for name in names:
        if not name.endswith("/.ATTRIBUTES/table-keys"):
            continue
        keys = reader.get_tensor(name).reshape(-1, 2)  # (slot, mixed id)
        values = reader.get_tensor(name.replace("table-keys", "table-values"))
        values = values.reshape(len(keys), -1)
        # .../physical_tables/<t>/<rows|counters>/shards/<shard>/<segment>/...: one dict per
        # table store, every shard and segment together (a key held twice is an error).
        group = name.split("/shards/")[0]
        live = keys[:, 0] >= 0
        rows = out.setdefault(group, {})
        for k, v in zip(map(tuple, keys[live].tolist()), values[live]):
            assert k not in rows, f"duplicate key {k} in table {group}"
            rows[k] = v
    return out


def dense(prefix):
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    return {
        n: reader.get_tensor(n)
        for n, d in dtypes.items()
        if d.is_floating and n.startswith(("model/", "optimizer/"))
    }


def delta_content(path):
    out = {}
    for npz in sorted(glob.glob(os.path.join(path, "*.npz"))):
        with np.load(npz) as f:
            out[os.path.basename(npz)] = dict(zip(f["keys"].tolist(), f["values"]))
    return out


def assert_rows_equal(a, b, what):
    assert a.keys() == b.keys(), what
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=f"{what} key {key}")


def test_random_kill_9_loop_ends_with_an_uninterrupted_runs_state(tmp_path):
    seed = int(os.environ.get("RECFLOW_KILL_SEED", "2026"))
    rng = random.Random(seed)
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    assert procs.run(command(whole), env=ENV, capture_output=True).returncode == 0

    kills, log = 0, []
    while kills < KILLS:
        reached, trigger, delay = kill_plan(rng, kills)
        proc = procs.Popen(command(killed), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        armed = time.time() if reached is None else None
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            if armed is None and glob.glob(os.path.join(killed, reached)):
                armed = time.time()
            if armed is not None and trigger is None and time.time() - armed >= delay:
                break
            if armed is not None and trigger is not None and glob.glob(os.path.join(killed, trigger)):
                time.sleep(delay)
                break
            time.sleep(0.002)
        if proc.poll() is not None:
            err = proc.stderr.read().decode()[-3000:]
            assert proc.returncode == 0, f"restart {kills} (seed {seed}) failed: {err}"
            break  # finished before the kill point: the loop starts no new run
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        log.append((reached, trigger, newest(killed, "checkpoints/ckpt-*.index")))
    else:
        final = procs.run(command(killed), env=ENV, capture_output=True, text=True)
        assert final.returncode == 0, final.stderr[-3000:]
    if kills < KILLS:  # the run ended early: go again from the start of a fresh dir
        pytest.fail(f"the run finished after {kills} kills (seed {seed}); schedule kills earlier")
    print(f"{kills} kills (seed {seed}): {log}")

    for model_dir in (whole, killed):
        assert json.load(open(os.path.join(model_dir, "metrics.json")))["steps"] == STEPS
    a, b = (os.path.join(d, "checkpoints", f"ckpt-{STEPS}") for d in (whole, killed))
    rows_a, rows_b = table_rows(a), table_rows(b)
    assert rows_a.keys() == rows_b.keys()
    for group in rows_a:
        assert_rows_equal(rows_a[group], rows_b[group], f"table {group}")
    dense_a, dense_b = dense(a), dense(b)
    assert dense_a.keys() == dense_b.keys() and dense_a
    for name in dense_a:
        np.testing.assert_allclose(dense_a[name], dense_b[name], rtol=1e-5, atol=1e-6, err_msg=name)

    tables = [
        json.loads(procs.run([sys.executable, "-m", "recflow.cli", "tables", d, "--json"],
                             env=ENV, check=True, capture_output=True, text=True).stdout)
        for d in (whole, killed)
    ]
    assert tables[0] == tables[1]

    steps = lambda d: sorted(int(x) for x in os.listdir(d) if x.isdigit())  # noqa: E731
    assert steps(os.path.join(killed, "deltas")) == steps(os.path.join(whole, "deltas")) == list(
        range(DELTA, STEPS + 1, DELTA)
    )
    for step in range(DELTA, STEPS + 1, DELTA):
        da = delta_content(os.path.join(whole, "deltas", str(step)))
        db = delta_content(os.path.join(killed, "deltas", str(step)))
        assert da.keys() == db.keys()
        for table in da:
            assert_rows_equal(da[table], db[table], f"delta {step} {table}")
    assert steps(os.path.join(killed, "export")) == steps(os.path.join(whole, "export"))
    for version in steps(os.path.join(killed, "export")):
        manifest = os.path.join(killed, "export", str(version), "assets.extra", "manifest.json")
        assert json.load(open(manifest))["step"] == version
    leftovers = glob.glob(f"{killed}/**/*_temp*", recursive=True) + glob.glob(f"{killed}/**/.tmp-*", recursive=True)
    assert not leftovers
