"""Admission, eviction, deltas and `recflow tables`, checked against counts from the raw rows."""

import json
import os

import numpy as np
import pytest
import yaml
from conftest import fingerprint_ids

from recflow.cli import main
from recflow.data.writer import write_columns

ROWS, BATCH = 64, 8  # 8 steps, file order kept (shuffle: false)


def raw_rows(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "click": rng.integers(0, 2, ROWS),
        "user": rng.integers(0, 40, ROWS).astype(np.int64),
        "item": np.array([f"i{k}" for k in rng.integers(0, 30, ROWS)], dtype=object),
    }


def write_config(tmp_path, data_glob, model_dir, **overrides):
    config = {
        "version": 1,
        "data": {"format": "csv", "train": data_glob, "label": "click", "batch_size": BATCH,
                 "shuffle": False},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "table": "u"},
            {"name": "item", "kind": "categorical", "dtype": "string", "table": "i"},
        ],
        "tables": {
            "u": {"dim": 4, "admission": {"min_count": 2}},
            "i": {"dim": 4, "eviction": {"ttl_steps": 3}},
        },
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(model_dir), "epochs": 1, "checkpoint_every_steps": 4, "evaluate": False},
        "export": {"delta_every_steps": 4},
    }
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        config[section][name] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def steps_of(rows):
    """1-based step of each row."""
    return np.arange(ROWS) // BATCH + 1


def tables_json(model_dir, capsys):
    capsys.readouterr()
    assert main(["tables", str(model_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["tables"]


def string_ids(values):
    """The ids recflow gives strings: their 64-bit fingerprints."""
    return set(fingerprint_ids(sorted(set(values))))


def load_delta(model_dir, step, table):
    data = np.load(os.path.join(model_dir, "deltas", str(step), f"{table}.npz"))
    return data["keys"], data["values"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lifecycle")
    rows = raw_rows()
    write_columns(str(tmp / "train.csv"), rows, "csv", labels=["click"])
    model_dir = tmp / "run"
    config = write_config(tmp, str(tmp / "train.csv"), model_dir)
    assert main(["train", config, "--quiet"]) == 0
    return rows, model_dir


def admitted_users(rows, until_step, min_count=2):
    step = steps_of(rows)
    users, counts = np.unique(rows["user"][step <= until_step], return_counts=True)
    return set(users[counts >= min_count].tolist())


def test_tables_report_exact_survivors(trained, capsys):
    rows, model_dir = trained
    step = steps_of(rows)
    stats = tables_json(model_dir, capsys)
    # Admission: a user has a row once seen twice.
    assert stats["u"]["keys"] == len(admitted_users(rows, 8))
    users, counts = np.unique(rows["user"], return_counts=True)
    assert stats["u"]["waiting_keys"] == int(np.sum(counts < 2))  # seen once: only a counter
    assert stats["u.linear"]["keys"] == stats["u"]["keys"]
    # Eviction at the final checkpoint (step 8, ttl 3): items last seen at step <= 5 are gone.
    last_seen = {}
    for item, s in zip(rows["item"], step):
        last_seen[item] = s
    survivors = {k for k, s in last_seen.items() if s > 8 - 3}
    assert stats["i"]["keys"] == len(survivors)
    assert stats["i"]["shards"] == [len(survivors)]
    width = 4 + 8 + 2  # embedding, Adam m and v (the default sparse optimizer), count, last step
    assert stats["i"]["bytes"] == len(survivors) * (16 + 4 * width)  # a key is two int64s


def test_deltas_hold_exactly_the_updated_rows(trained):
    rows, model_dir = trained
    step = steps_of(rows)
    assert sorted(os.listdir(model_dir / "deltas")) == ["4", "8"]
    manifest = json.loads((model_dir / "deltas" / "8" / "manifest.json").read_text())
    assert manifest["since_step"] == 4 and manifest["step"] == 8
    # Step 4: eviction first drops items last seen at step 1, then the delta has steps 2..4.
    keys, values = load_delta(model_dir, 4, "i")
    items_2_4 = string_ids(rows["item"][(step >= 2) & (step <= 4)])
    assert set(keys.tolist()) == items_2_4 and values.shape == (len(items_2_4), 4)
    keys, _ = load_delta(model_dir, 4, "u")
    assert set(keys.tolist()) == admitted_users(rows, 4)
    # Step 8: rows touched in steps 5..8 that survive eviction (items of step 5 only are gone).
    keys, _ = load_delta(model_dir, 8, "i")
    assert len(keys) == len(set(keys.tolist()))
    assert set(keys.tolist()) == string_ids(rows["item"][step >= 6])
    keys, _ = load_delta(model_dir, 8, "u")
    seen_late = set(rows["user"][step >= 5].tolist())
    assert set(keys.tolist()) == seen_late & admitted_users(rows, 8)


def test_export_delta_command_after_more_training(trained, tmp_path, capsys):
    rows, model_dir = trained
    config = str(model_dir / "config.yaml")
    before = sorted(os.listdir(model_dir / "deltas"))
    assert main(["export", config, "--delta"]) == 0  # nothing since step 8: kept as is
    assert sorted(os.listdir(model_dir / "deltas")) == before
    # A second epoch (epochs are totals) and a delta by command: every row touched in 9..16.
    assert main(["train", config, "--quiet", "--set", "train.epochs=2",
                 "--set", "export.delta_every_steps=null"]) == 0
    assert main(["export", config, "--delta", "--set", "train.epochs=2"]) == 0
    assert sorted(os.listdir(model_dir / "deltas")) == ["16", "4", "8"]
    keys, _ = load_delta(model_dir, 16, "i")
    assert set(keys.tolist()) == string_ids(rows["item"][steps_of(rows) >= 6])
    assert not [d for d in os.listdir(model_dir / "deltas") if d.startswith(".tmp")]


def test_max_keys_keeps_the_most_frequent(tmp_path, capsys):
    # Ten items with distinct counts (64 rows in all), in a shuffled order.
    counts = {f"i{k}": c for k, c in enumerate([1, 2, 3, 4, 5, 6, 7, 8, 11, 17])}
    items = np.array([k for k, c in counts.items() for _ in range(c)], dtype=object)
    rows = raw_rows(seed=1)
    rows["item"] = np.random.default_rng(2).permutation(items)
    write_columns(str(tmp_path / "train.csv"), rows, "csv", labels=["click"])
    model_dir = tmp_path / "run"
    tables = {"u": {"dim": 4}, "i": {"dim": 4, "eviction": {"max_keys": 6}}}
    config = write_config(tmp_path, str(tmp_path / "train.csv"), model_dir, **{"export.delta_every_steps": None})
    assert main(["train", config, "--quiet", "--set", f"tables={tables}",
                 "--set", "train.checkpoint_every_steps=8",
                 "--set", "export.every_steps=4", "--set", "export.keep=1"]) == 0
    stats = tables_json(model_dir, capsys)
    assert stats["i"]["keys"] == 6
    assert stats["u"]["keys"] == len(set(rows["user"]))
    assert os.listdir(model_dir / "export") == ["8"]  # versions are steps: 4, then 8 (the final export replaces it); keep 1
    # Which items survived: a delta since step 0 lists every row, keyed by the id of the string.
    assert main(["export", str(model_dir / "config.yaml"), "--delta"]) == 0
    keys, _ = load_delta(model_dir, 8, "i")
    top6 = sorted(counts, key=counts.get)[-6:]  # counts 5, 6, 7, 8, 11, 17
    assert sorted(keys.tolist()) == sorted(fingerprint_ids(top6))


def simulate_store(users, steps, min_count, ttl, checkpoints):
    """Rows and waiting keys of a table with admission and ttl, by hand (DESIGN.md section 7)."""
    rows, waiting = {}, {}  # id -> [count, last step]
    for s in range(1, steps.max() + 1):
        ids, counts = np.unique(users[steps == s], return_counts=True)
        for key, n in zip(ids.tolist(), counts.tolist()):
            if key in rows:
                rows[key] = [rows[key][0] + n, s]
                continue
            seen = waiting.get(key, [0, 0])[0] + n
            if seen >= min_count:
                rows[key] = [seen, s]
                waiting.pop(key, None)
            else:
                waiting[key] = [seen, s]
        if s in checkpoints:  # eviction and stale counters, at every checkpoint
            rows = {k: v for k, v in rows.items() if v[1] > s - ttl}
            waiting = {k: v for k, v in waiting.items() if v[1] > s - ttl}
    return rows, waiting


def test_ttl_also_drops_keys_waiting_for_admission(tmp_path, capsys):
    rows = raw_rows(seed=3)
    write_columns(str(tmp_path / "train.csv"), rows, "csv", labels=["click"])
    model_dir = tmp_path / "run"
    tables = {"u": {"dim": 4, "admission": {"min_count": 3}, "eviction": {"ttl_steps": 3}},
              "i": {"dim": 4}}
    config = write_config(tmp_path, str(tmp_path / "train.csv"), model_dir,
                          **{"export.delta_every_steps": None, "train.checkpoint_every_steps": 2})
    assert main(["train", config, "--quiet", "--set", f"tables={tables}"]) == 0
    want_rows, want_waiting = simulate_store(rows["user"], steps_of(rows), 3, 3, {2, 4, 6, 8})
    assert want_waiting and want_rows  # the data exercises both
    stats = tables_json(model_dir, capsys)
    assert stats["u"]["keys"] == len(want_rows)
    assert stats["u"]["waiting_keys"] == len(want_waiting)
    from recflow.training.tables import restore_engine

    got = restore_engine(str(model_dir)).logical_rows()["u"]
    assert dict(zip(got.ids.tolist(), zip(got.count.tolist(), got.last_step.tolist()))) == {
        k: tuple(v) for k, v in want_rows.items()
    }


@pytest.mark.parametrize("key_format", [1, 2])
def test_checkpoint_with_55_bit_keys_is_refused_in_one_line(trained, tmp_path, capsys, key_format):
    """A checkpoint of 55-bit keys (format 1: no key_format variable; 2: mixed) fails with
    one line, exit 2, for `tables` and for `train` on its model dir, and changes nothing."""
    import shutil

    import tensorflow as tf

    _, model_dir = trained
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(model_dir / "config.yaml", old / "config.yaml")
    embedding = tf.Module()
    embedding.table = tf.lookup.experimental.DenseHashTable(tf.int64, tf.float32, 0.0, -1, -2)
    if key_format > 1:
        embedding.key_format = tf.Variable(key_format, dtype=tf.int64)
    model = tf.Module()
    model.embedding = embedding
    tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(old / "checkpoints"), 1).save(8)
    before = sorted(os.listdir(old / "checkpoints"))
    for command in (["tables", str(old)], ["train", str(old / "config.yaml"), "--model-dir", str(old)]):
        capsys.readouterr()
        assert main(command + ["--quiet"] * (command[0] == "train")) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("recflow: ") and "ckpt-8" in err
        assert "55-bit" in err and "fresh model dir" in err
    assert sorted(os.listdir(old / "checkpoints")) == before
    assert main(["tables", str(model_dir)]) == 0  # a current checkpoint reads


def test_max_keys_bounds_each_table_of_a_fused_physical_table(tmp_path, capsys):
    """Two tables of one policy fuse into one physical table; `max_keys` was applied to
    its rows together, so the frequent users pushed items out (the two held 6, not 6 each)."""
    counts = {f"i{k}": c for k, c in enumerate([1, 2, 3, 4, 5, 6, 7, 8, 11, 17])}
    items = np.array([k for k, c in counts.items() for _ in range(c)], dtype=object)
    rows = raw_rows(seed=1)
    rows["item"] = np.random.default_rng(2).permutation(items)
    rows["user"] = np.random.default_rng(3).integers(0, 5, ROWS).astype(np.int64) * 7  # 5 users, ~13 rows each
    write_columns(str(tmp_path / "train.csv"), rows, "csv", labels=["click"])
    model_dir = tmp_path / "run"
    policy = {"dim": 4, "eviction": {"max_keys": 6}}
    config = write_config(tmp_path, str(tmp_path / "train.csv"), model_dir, **{"export.delta_every_steps": None})
    assert main(["train", config, "--quiet", "--set", f"tables={ {'u': policy, 'i': policy} }",
                 "--set", "train.checkpoint_every_steps=8"]) == 0
    stats = tables_json(model_dir, capsys)
    assert stats["i"]["physical_table"] == stats["u"]["physical_table"]  # fused
    assert stats["u"]["keys"] == 5 and stats["i"]["keys"] == 6
    assert main(["export", str(model_dir / "config.yaml"), "--delta"]) == 0
    keys, _ = load_delta(model_dir, 8, "i")
    assert sorted(keys.tolist()) == sorted(fingerprint_ids(sorted(counts, key=counts.get)[-6:]))
