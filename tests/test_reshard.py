"""Elastic resharding: a checkpoint written with P shards (parameter servers) resumes with Q.

Every saved key must land on the shard the placement rule names for it, worked out
here in numpy (`(mixed >> 32) mod Q`), with its whole packed row (embedding,
optimizer slots, sighting count, last step) and a waiting key's admission counter
exactly as saved; no key is lost or held twice, and training goes on.

- In one process (local shards), the restore itself is compared with the rows read
  from the checkpoint shard for shard, for 2 -> 1, 2 -> 3 and 1 -> 2.
- On a real loopback cluster, 2 -> 3 -> 1 (one process) -> 2 PS tasks: after each
  change the run trains on, and its checkpoint must hold every key of the previous
  one, each row the steps since did not touch (last step at or before the change)
  exactly as it was.
"""

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import DEMO as CONFIG
from conftest import sets, small

import recflow.api
from recflow.cli import main
from recflow.embedding.placement import ModPlacement
from recflow.embedding.reshard import saved_shards
from recflow.embedding.table import segment_buckets, segment_layout
from recflow.features.keys import decode
from recflow.training.tables import restore_engine
from recflow.training.trainer import Trainer

# Runs of a few steps of 64 inside one pass over 20000 rows; no export at the end (the
# checks read checkpoints).
SMALL = small({
    "data.synthetic": {"rows": 20000, "eval_rows": 256, "seed": 5, "schema": "demo"},
    "data.batch_size": 64,
    "train.epochs": None,
    "tables.item.admission": {"min_count": 2},  # waiting keys: admission counters to move
})
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def _config(model_dir, steps: int, every: int):
    overrides = {**SMALL, "train.steps": steps, "train.checkpoint_every_steps": every}
    return recflow.api.load(CONFIG, model_dir=str(model_dir), overrides=overrides)


def _contents(table) -> tuple[np.ndarray, np.ndarray]:
    """((slot, raw id) [n, 2], packed values [n, width]) of a `ShardedTable`, sorted by key."""
    keys, values = (t.numpy() for t in table.export())
    slots, ids = decode(keys)
    order = np.lexsort((ids, slots))
    return np.stack([slots, ids], axis=1)[order], values[order]


def _tables(engine) -> dict:
    """Per physical table: contents of its rows and of its admission counters (if any)."""
    out = {}
    for table in engine.physical_tables:
        out[table.spec.name] = _contents(table.rows)
        if table.counters is not None:
            out[table.spec.name + "/counters"] = _contents(table.counters)
    return out


def _check_placement(engine, shards: int) -> None:
    """Every key of every table sits on shard `(mixed >> 32) mod shards`, once."""
    for physical in engine.physical_tables:
        for table in filter(None, (physical.rows, physical.counters)):
            assert table.num_shards == shards
            held = []
            for i in range(shards):
                keys = table.export_shard(i)[0].numpy()
                # numpy's >> on int64 is arithmetic and np.mod of a positive divisor is >= 0
                assert np.all(np.mod(keys[:, 1] >> 32, shards) == i), (physical.spec.name, i)
                held.append(keys)
            held = np.concatenate(held)
            assert np.unique(held, axis=0).shape[0] == held.shape[0], "a key held twice"


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        (k0, v0), (k1, v1) = before[name], after[name]
        assert k0.shape[0] > 0, name
        np.testing.assert_array_equal(k1, k0, err_msg=name)
        np.testing.assert_array_equal(v1, v0, err_msg=name)  # bit for bit: slots, counts, steps


# ---------------------------------------------------------------------- in one process


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Model dirs trained 4 steps with 1 and 2 local shards (item keys waiting for admission)."""
    dirs = {}
    for shards in (1, 2):
        model_dir = tmp_path_factory.mktemp("reshard") / f"p{shards}"
        Trainer(_config(model_dir, 4, 4), verbose=0, placement=ModPlacement(shards)).fit()
        dirs[shards] = model_dir
    return dirs


@pytest.mark.parametrize("saved, shards", [(2, 1), (2, 3), (1, 2)])
def test_a_restore_on_another_shard_count_moves_every_row(trained, tmp_path, capsys, saved, shards):
    model_dir = tmp_path / "model"
    shutil.copytree(trained[saved], model_dir)
    assert saved_shards(str(model_dir / "checkpoints" / "ckpt-4")) == saved
    original = restore_engine(str(model_dir))  # shard for shard, as saved
    expected = _tables(original)
    assert any(name.endswith("/counters") and v[0].shape[0] for name, v in expected.items())

    trainer = Trainer(_config(model_dir, 8, 4), verbose=0, placement=ModPlacement(shards))
    assert trainer.model_dir.restore() == 4
    engine = trainer.model.embedding
    _check_placement(engine, shards)
    _assert_same(expected, _tables(engine))
    for physical in engine.physical_tables:  # each shard sized once for its keys: none grew
        for i in range(shards):
            held = int(physical.rows.export_shard(i)[0].shape[0])
            sizes, _ = segment_layout(segment_buckets(held, physical.step_keys))
            assert physical.rows.num_buckets(i) == sum(sizes)
    # What `recflow tables` and an export read: the same keys with the same rows.
    for i in range(len(engine.physical_tables)):
        (k0, e0), (k1, e1) = ([t.numpy() for t in e.serving_rows(i)] for e in (original, engine))
        o0, o1 = np.lexsort(k0.T), np.lexsort(k1.T)
        np.testing.assert_array_equal(k1[o1], k0[o0])
        np.testing.assert_array_equal(e1[o1], e0[o0])
    stats = original.table_stats()
    for name, s in engine.table_stats().items():
        assert (s["keys"], s["waiting_keys"]) == (stats[name]["keys"], stats[name]["waiting_keys"])
        assert len(s["shards"]) == shards and sum(s["shards"]) == s["keys"]

    # Training goes on, and its checkpoints are in the new shard count.
    assert trainer.fit()["steps"] == 8
    assert saved_shards(str(model_dir / "checkpoints" / "ckpt-8")) == shards
    assert main(["tables", str(model_dir), "--json"]) == 0
    tables = json.loads(capsys.readouterr().out)["tables"]
    assert all(len(t["shards"]) == shards for t in tables.values())
    _assert_kept(str(model_dir), 4, 8)


# ---------------------------------------------------------------------- between checkpoints


def _rows_by_key(engine) -> dict:
    """Per table (rows, counters): {(slot, raw id): packed values}."""
    out = {}
    for name, (keys, values) in _tables(engine).items():
        assert np.unique(keys, axis=0).shape[0] == keys.shape[0], f"{name}: a key held twice"
        out[name] = {tuple(k): v for k, v in zip(keys.tolist(), values)}
    return out


def _assert_kept(model_dir: str, before: int, after: int) -> None:
    """Checkpoint `after` (resumed from `before`, maybe on another shard count) holds every
    key of `before`; each row and counter untouched since is as it was, bit for bit."""
    checkpoints = os.path.join(model_dir, "checkpoints")
    old = restore_engine(model_dir, os.path.join(checkpoints, f"ckpt-{before}"))
    new = restore_engine(model_dir, os.path.join(checkpoints, f"ckpt-{after}"))
    old_rows, new_rows = _rows_by_key(old), _rows_by_key(new)
    untouched = 0
    for table in new.physical_tables:
        name, layout = table.spec.name, table.layout
        rows = new_rows[name]
        for key, value in old_rows[name].items():
            assert key in rows, f"{name}: {key} lost"
            if layout.split_numpy(rows[key][None])[3][0] <= before:  # last step
                np.testing.assert_array_equal(rows[key], value, err_msg=f"{name} {key}")
                untouched += 1
        if table.counters is None:
            continue
        counters = new_rows[name + "/counters"]
        for key, value in old_rows[name + "/counters"].items():
            if key in counters and counters[key][1] <= before:
                np.testing.assert_array_equal(counters[key], value, err_msg=f"{name} {key}")
                untouched += 1
            elif key in counters:  # seen again since, still waiting
                assert counters[key][1] > before, f"{name} {key}"
            else:  # seen again since and admitted: it has a row now
                assert key in rows, f"{name}: waiting {key} lost"
                assert layout.split_numpy(rows[key][None])[3][0] > before, f"{name} {key}"
    assert untouched > 0


# ---------------------------------------------------------------------- a real cluster

CLUSTER = {**SMALL, "train.checkpoint_every_steps": 4}


def _train(model_dir, steps: int, ps: int) -> str:
    """`recflow launch` with `ps` PS tasks and one worker, or, when ps is 0, one process:
    `recflow.api.train` in this one (what `recflow train` runs); returns the launcher's
    standard error ("" in one process)."""
    overrides = {**CLUSTER, "train.steps": steps}
    err = ""
    if ps:
        command = ["launch", CONFIG, "--ps", str(ps), "--workers", "1", "--model-dir", str(model_dir)]
        done = subprocess.run(
            [sys.executable, "-m", "recflow.cli", *command, *sets(overrides)],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        err = done.stderr
    else:
        recflow.api.train(CONFIG, model_dir=str(model_dir), overrides=overrides)
    assert json.loads((model_dir / "metrics.json").read_text())["steps"] == steps
    return err


def test_two_three_one_two_parameter_servers(tmp_path, caplog):
    model_dir = tmp_path / "elastic"
    checkpoints = model_dir / "checkpoints"
    _train(model_dir, 8, ps=2)
    assert saved_shards(str(checkpoints / "ckpt-8")) == 2
    for before, after, ps in [(8, 12, 3), (12, 16, 0), (16, 20, 2)]:
        with caplog.at_level(logging.WARNING, logger="recflow"):
            err = _train(model_dir, after, ps)
        # An input position, kept by a local run and by parameter servers each in its own
        # form, does not cross from one to the other: the epoch read part way starts over.
        # The launcher relays the chief's warnings to its standard error.
        told = err if ps else caplog.text
        source = "by a local run" if ps else "under parameter servers"
        crossed = after != 12  # 2 -> 3 parameter servers keeps the split positions
        assert (f"written {source} part way through epoch" in told) == crossed, (after, told[-2000:])
        caplog.clear()
        assert saved_shards(str(checkpoints / f"ckpt-{after}")) == max(ps, 1)
        _check_placement(restore_engine(str(model_dir)), max(ps, 1))
        _assert_kept(str(model_dir), before, after)
