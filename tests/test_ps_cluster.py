"""A real PS cluster on loopback: `recflow launch` with 2 PS and 2 workers, a worker
and then a PS killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from conftest import items, small

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
# Kills after the checkpoints of steps EVERY and 3 * EVERY; the 2 * EVERY steps after the
# second kill keep the run going until the launcher has seen it.
STEPS, EVERY, TTL = 80, 16, 24
SETTINGS = items(small({
    # 80 steps stay inside the first pass (each row is read once per epoch), where
    # about half the users are seen once: they wait for admission.
    "data.synthetic": {"rows": 20000, "eval_rows": 500, "seed": 11, "schema": "demo"},
    "data.batch_size": 64,
    "train.epochs": None,
    "train.steps": STEPS,
    "train.checkpoint_every_steps": EVERY,
    # Admission and eviction: every checkpoint rebuilds each shard on its PS.
    "tables.item.admission": {"min_count": 2},
    "tables.user.admission": {"min_count": 2},
    "tables.user.eviction": {"ttl_steps": TTL},
}, export=True, evaluate=True))  # the export must serve; its AUC is read


def pid_of(model_dir, job, index):
    tasks = json.loads((model_dir / "cluster.json").read_text())["tasks"]
    return next(t["pid"] for t in tasks if t["job"] == job and t["index"] == index)


def wait_for(path, proc, timeout=400):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"launcher exited early with {proc.returncode}"
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.05)


def test_launch_survives_a_dead_worker_and_a_dead_ps(tmp_path):
    model_dir = tmp_path / "ps"
    command = [sys.executable, "-m", "recflow.cli", "launch", "configs/deepfm_demo.yaml",
               "--ps", "2", "--workers", "2", "--model-dir", str(model_dir)]
    for item in SETTINGS:
        command += ["--set", item]
    launcher = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = model_dir / "checkpoints"

    wait_for(checkpoints / f"ckpt-{EVERY}.index", launcher)
    os.kill(pid_of(model_dir, "worker", 1), signal.SIGKILL)  # its steps move to worker 0

    wait_for(checkpoints / f"ckpt-{3 * EVERY}.index", launcher)
    before = {(t["job"], t["index"]): t["pid"] for t in json.loads((model_dir / "cluster.json").read_text())["tasks"]}
    os.kill(pid_of(model_dir, "ps", 1), signal.SIGKILL)  # shard 1 of every table is lost

    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    assert "worker-1 exited" in err and "ps-1 exited" in err

    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == STEPS
    # as recflow train ends: the metrics, then where the model went
    assert out.splitlines()[-1] == f"model dir: {model_dir}   export: {metrics['export']}", out
    tasks = json.loads((model_dir / "cluster.json").read_text())["tasks"]
    # A dead PS restarts the whole cluster: no task keeps state of the lost run.
    assert all(t["pid"] != before[t["job"], t["index"]] for t in tasks)
    assert sorted((t["job"], t["index"]) for t in tasks) == [
        ("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)
    ]
    for task in tasks:  # no orphans
        try:
            os.kill(task["pid"], 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, f"{task['job']}-{task['index']} still running"
    for name in ("chief-0", "ps-0", "ps-1", "worker-0", "worker-1"):
        assert (model_dir / "logs" / f"{name}.log").exists()

    from test_resume_and_stream import tables_report  # pytest puts tests/ on sys.path

    tables = tables_report(model_dir)
    for name in ("user", "item"):
        shards = tables[name]["shards"]
        assert len(shards) == 2 and min(shards) > 0, (name, shards)
        assert sum(shards) == tables[name]["keys"]
    assert tables["user"]["waiting_keys"] > 0
    from recflow.training.tables import restore_engine

    rows = restore_engine(str(model_dir)).logical_rows()
    for name, logical in rows.items():
        assert np.unique(logical.ids).size == logical.ids.size, f"{name}: an id held twice"
    # ttl at the final checkpoint (step STEPS): no user row was last seen TTL steps before it.
    assert rows["user"].last_step.min() > STEPS - TTL
    assert rows["item"].count.min() >= 2 and rows["user"].count.min() >= 2  # admitted keys only

    # The export serves in plain TensorFlow.
    export = model_dir / "export" / str(STEPS)
    script = os.path.join(os.path.dirname(__file__), "scripts", "serve_zeros_without_recflow.py")
    served = subprocess.run([sys.executable, script, str(export)], env=ENV, capture_output=True, text=True)
    assert "served" in served.stdout, served.stderr[-2000:]
    assert np.isfinite(metrics["auc"])
