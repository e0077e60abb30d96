"""Serving that stays fresh: deltas (evicted ids, dense weights, sequence), `apply_delta`
in plain TensorFlow, and the `recflow serve` REST server as a real process."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from recflow.cli import main
from recflow.data.writer import write_columns

BATCH, STEPS, TTL = 8, 12, 3
EVERY = 2  # checkpoint (eviction), delta and export every 2 steps


def raw_rows():
    """Step s (1-based) sees items i{2s}..i{2s+3}: new ids every step, old ones go stale."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    step = np.arange(n) // BATCH + 1
    return {
        "click": rng.integers(0, 2, n),
        "user": rng.integers(0, 12, n).astype(np.int64),
        "item": np.array([f"i{2 * s + k}" for s, k in zip(step, rng.integers(0, 4, n))], dtype=object),
        "price": rng.random(n).astype(np.float32) * 10,
    }


def write_config(tmp, model_dir, steps=STEPS):
    config = {
        "version": 1,
        "data": {"format": "csv", "train": str(tmp / "train.csv"), "label": "click",
                 "batch_size": BATCH, "shuffle": False},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "table": "u"},
            {"name": "item", "kind": "categorical", "dtype": "string", "table": "i"},
            {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        ],
        "tables": {"u": {"dim": 4}, "i": {"dim": 4, "eviction": {"ttl_steps": TTL}}},
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [8]}}},
        "train": {"model_dir": str(model_dir), "steps": steps, "checkpoint_every_steps": EVERY,
                  "optimizer": {"type": "adam", "learning_rate": 0.05}},
        "export": {"delta_every_steps": EVERY, "every_steps": EVERY},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def string_ids(values):
    """The ids recflow gives strings: their fingerprint64 into 2**55 buckets (computed by TF)."""
    import tensorflow as tf

    values = sorted(set(values))
    return set(tf.strings.to_hash_bucket_fast(values, 2**55).numpy().tolist()) if values else set()


def evicted_by_hand(rows):
    """{checkpoint step: items evicted there}: ttl eviction at every checkpoint (DESIGN 7)."""
    step = np.arange(len(rows["item"])) // BATCH + 1
    last, out = {}, {}
    for s in range(1, STEPS + 1):
        for item in rows["item"][step == s]:
            last[item] = s
        if s % EVERY == 0:
            out[s] = {k for k, v in last.items() if v <= s - TTL}
            last = {k: v for k, v in last.items() if v > s - TTL}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    rows = raw_rows()
    write_columns(str(tmp / "train.csv"), rows, "csv", labels=["click"])
    model_dir = tmp / "run"
    assert main(["train", write_config(tmp, model_dir), "--quiet"]) == 0
    return tmp, rows, model_dir


def manifest(model_dir, step):
    return json.loads((model_dir / "deltas" / str(step) / "manifest.json").read_text())


def test_deltas_carry_evictions_dense_weights_and_a_sequence(trained):
    _, rows, model_dir = trained
    steps = sorted(int(d) for d in os.listdir(model_dir / "deltas"))
    assert steps == list(range(EVERY, STEPS + 1, EVERY))
    structure = json.loads((model_dir / "export" / str(STEPS) / "assets.extra" / "structure.json").read_text())
    import hashlib

    fingerprint = hashlib.sha256(
        json.dumps(structure, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    evicted = evicted_by_hand(rows)
    for n, step in enumerate(steps, start=1):
        m = manifest(model_dir, step)
        assert (m["sequence"], m["step"], m["since_step"]) == (n, step, step - EVERY)
        assert m["structure_sha256"] == fingerprint
        with np.load(model_dir / "deltas" / str(step) / "i.npz") as data:
            assert set(data["evicted"].tolist()) == string_ids(evicted[step])
            assert not set(data["evicted"].tolist()) & set(data["keys"].tolist())
        with np.load(model_dir / "deltas" / str(step) / "u.npz") as data:
            assert data["evicted"].size == 0
        with np.load(model_dir / "deltas" / str(step) / "dense.npz") as data:
            assert data["weights"].size == m["dense"]["size"]
            assert m["dense"]["size"] == sum(int(np.prod(s)) for _, s in m["dense"]["variables"])
    assert any(evicted[s] for s in steps[2:])  # the check above saw evictions


def test_evicted_ids_survive_a_restart_before_the_next_delta(trained, tmp_path):
    base, rows, _ = trained
    # Eviction at every checkpoint (2, 4, 6, 8), deltas every 4: stop at 6, resume to 8.
    cut = tmp_path / "cut"
    config = write_config(tmp_path, cut, steps=6)
    (tmp_path / "train.csv").write_bytes((base / "train.csv").read_bytes())
    sets = ["--set", "export.delta_every_steps=4", "--set", "export.every_steps=null"]
    assert main(["train", config, "--quiet", *sets]) == 0
    assert sorted(os.listdir(cut / "deltas")) == ["4"]
    assert main(["train", config, "--quiet", *sets, "--set", "train.steps=8"]) == 0
    evicted = evicted_by_hand(rows)
    assert evicted[6] and evicted[6] != evicted[8]  # evicted before the restart
    for step, expected in ((4, evicted[2] | evicted[4]), (8, evicted[6] | evicted[8])):
        with np.load(cut / "deltas" / str(step) / "i.npz") as data:
            assert sorted(data["evicted"].tolist()) == sorted(string_ids(expected))
        assert manifest(cut, step)["sequence"] == step // 4


# Applies deltas with plain TensorFlow and numpy, as any serving runtime would.
APPLY_WITHOUT_RECFLOW = textwrap.dedent(
    """
    import json, os, sys
    sys.modules["recflow"] = None  # any `import recflow` now fails
    import numpy as np, tensorflow as tf
    model_dir, start, inputs, out = sys.argv[1:]
    rows = dict(np.load(inputs, allow_pickle=True))

    def predict(model):
        serve = model.signatures["serving_default"]
        specs = serve.structured_input_signature[1]
        feed = {k: tf.constant(rows[k].tolist() if specs[k].dtype == tf.string else rows[k],
                               specs[k].dtype) for k in specs}
        return serve(**feed)["probability"].numpy().reshape(-1)

    model = tf.saved_model.load(os.path.join(model_dir, "export", start))
    before = predict(model)
    deltas = sorted(int(d) for d in os.listdir(os.path.join(model_dir, "deltas")))
    spec = model.apply_delta.structured_input_signature[0][0]
    for step in [d for d in deltas if d > int(start)]:
        folder = os.path.join(model_dir, "deltas", str(step))
        manifest = json.load(open(os.path.join(folder, "manifest.json")))
        feed = {"step": tf.constant(step, tf.int64),
                "dense": tf.constant(np.load(os.path.join(folder, "dense.npz"))["weights"])}
        for table in manifest["tables"]:
            data = np.load(os.path.join(folder, table + ".npz"))
            feed[table + "/ids"] = tf.constant(data["keys"])
            feed[table + "/values"] = tf.constant(data["values"])
            feed[table + "/evicted"] = tf.constant(data["evicted"])
        assert sorted(feed) == sorted(spec)
        assert int(model.apply_delta(feed)["step"]) == step
    full = tf.saved_model.load(os.path.join(model_dir, "export", str(deltas[-1])))
    np.savez(out, before=before, applied=predict(model), full=predict(full),
             step=int(model.global_step))
    """
)


def held_out_rows(rows):
    """Every user and item of training (so ids first seen late and ids evicted), unseen ones."""
    rng = np.random.default_rng(1)
    items = sorted(set(rows["item"])) + ["never-seen", "i999"]
    users = list(range(14))  # 12, 13 never seen
    n = 3 * len(items)
    return {
        "user": np.array([users[k % len(users)] for k in range(n)], np.int64),
        "item": np.array([items[k % len(items)] for k in rng.permutation(n)], dtype=object),
        "price": rng.random(n).astype(np.float32) * 10,
    }


@pytest.mark.parametrize("start", [4, 8])
def test_deltas_applied_to_an_export_match_the_full_export(trained, tmp_path, start):
    _, rows, model_dir = trained
    held = held_out_rows(rows)
    np.savez(tmp_path / "rows.npz", **held)
    script = tmp_path / "apply.py"
    script.write_text(APPLY_WITHOUT_RECFLOW)
    subprocess.run([sys.executable, str(script), str(model_dir), str(start),
                    str(tmp_path / "rows.npz"), str(tmp_path / "out.npz")], check=True)
    out = np.load(tmp_path / "out.npz")
    assert int(out["step"]) == STEPS
    assert np.max(np.abs(out["applied"] - out["full"])) <= 1e-6
    assert np.max(np.abs(out["before"] - out["full"])) > 1e-4  # the deltas changed something
    # Items trained after `start` and items evicted after it are among the held-out rows.
    step = np.arange(len(rows["item"])) // BATCH + 1
    assert set(rows["item"][step > start]) - set(rows["item"][step <= start]) <= set(held["item"])
    evicted = set().union(*(v for s, v in evicted_by_hand(rows).items() if s > start))
    assert evicted and evicted <= set(held["item"])
