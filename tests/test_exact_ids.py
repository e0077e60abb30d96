"""Every int64 id is exact: distinct (feature, id) pairs never share a row, over the whole
int64 range, through real tables, and raw ids come back out of `tables`, deltas and exports."""

import collections
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recflow.cli import main
from recflow.config import config_from_dict
from recflow.data.writer import write_columns
from recflow.embedding.engine import EmbeddingEngine
from recflow.embedding.placement import ModPlacement
from recflow.embedding.table import ShardedTable
from recflow.features.keys import encode, slot_column, unique_ids, unique_with_counts

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GOLDEN = 0x9E3779B97F4A7C15
# Ends of int64, the old empty/deleted markers, and pairs the 55-bit keys merged.
EXTREMES = [0, 1, -1, -2, 5, -5, 2**55 - 5, 5 + 2**55, INT64_MAX, INT64_MIN, INT64_MIN + 5]


def signed(x: int) -> int:
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


def top_bits_variant(pair) -> int:
    """`x` with its top 9 bits replaced: an id that differs from x only there."""
    x, top = pair
    return signed((x % 2**55) | (top << 55))


any_int64 = st.integers(INT64_MIN, INT64_MAX)
ids = st.one_of(
    st.sampled_from(EXTREMES),
    any_int64,
    st.tuples(st.sampled_from(EXTREMES) | any_int64, st.integers(0, 2**9 - 1)).map(
        top_bits_variant
    ),
)


def fused_engine(shards: int, features: int = 3) -> EmbeddingEngine:
    config = config_from_dict(
        {
            "data": {"format": "synthetic", "label": "click", "batch_size": 64},
            "features": [
                {"name": f"f{i}", "kind": "categorical", "dtype": "int64", "dim": 2}
                for i in range(features)
            ],
            "train": {"sparse_optimizer": {"type": "sgd"}},
            "model": {"type": "deepfm"},
        }
    )
    engine = EmbeddingEngine(config, ModPlacement(shards))
    assert len(engine.physical_tables) == 1  # one fused table: the features differ by slot only
    return engine


def step(engine, batch: dict, n: int) -> None:
    """One training step with zero gradients: rows are created and counted, never moved."""
    feed = {k: tf.constant(v, tf.int64) for k, v in batch.items()}
    states = engine.prepare(feed, tf.constant(n, tf.int64))
    engine.apply(states, [None] * len(states), tf.constant(n, tf.int64))


def check_rows(engine, sightings: dict) -> None:
    """Each feature's table holds exactly its distinct ids, each once with its own count,
    and a lookup of each id reads that id's row."""
    rows = engine.logical_rows()
    for name, counts in sightings.items():
        got = rows[name]
        assert len(set(got.ids.tolist())) == got.ids.size, f"{name} holds an id twice"
        assert dict(zip(got.ids.tolist(), got.count.tolist())) == dict(counts), name
        probe = list(counts)
        emb = engine.embed({f: tf.constant(probe, tf.int64) for f in sightings})[name].numpy()
        want = dict(zip(got.ids.tolist(), got.emb))
        np.testing.assert_array_equal(emb, np.array([want[k] for k in probe]))


@pytest.mark.parametrize("shards", [1, 3])
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    shared=st.lists(ids, min_size=1, max_size=24),
    own=st.lists(st.lists(ids, max_size=8), min_size=3, max_size=3),
    partner=st.booleans(),
)
def test_distinct_pairs_get_distinct_rows(shards, shared, own, partner):
    """Every feature reads the shared ids (same id, other slot) plus its own; with `partner`,
    feature f1 also reads, for each shared id x of f0, the id whose mixed value equals
    x's in f0 (x + (slot0 - slot1) * GOLDEN): a collision the unique must resolve."""
    engine = fused_engine(shards)
    slots = {u.feature.name: u.slot for u in engine.physical_tables[0].uses}
    batch = {f"f{i}": shared + own[i] for i in range(3)}
    if partner:
        batch["f1"] = batch["f1"] + [
            signed(x + (slots["f0"] - slots["f1"]) * GOLDEN) for x in shared
        ]
    size = max(len(v) for v in batch.values())
    batch = {k: (v * size)[:size] for k, v in batch.items()}  # a batch is rectangular
    sightings = {k: collections.Counter(v) for k, v in batch.items()}
    step(engine, batch, 1)
    check_rows(engine, sightings)
    step(engine, batch, 2)  # the second sighting finds each row again
    check_rows(engine, {k: {i: 2 * c for i, c in v.items()} for k, v in sightings.items()})


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6), min_size=2, max_size=5))
def test_several_slots_unique_as_their_keys_concatenated(parts):
    # Each id read through its own logical table's slot (empty parts included): the slot
    # column is numpy's repeat of the slots by the part sizes, and the distinct keys and
    # each id's position in them are those of the keys encoded one by one.
    slots = list(range(3, 3 + len(parts)))
    tensors = [tf.constant(p, tf.int64, shape=[len(p)]) for p in parts]
    column = slot_column(tensors, slots).numpy()
    np.testing.assert_array_equal(column, np.repeat(slots, [len(p) for p in parts]))
    keys, index, counts = (t.numpy() for t in unique_ids(tensors, slots))
    encoded = tf.concat([encode(t, s) for t, s in zip(tensors, slots)], 0).numpy()
    np.testing.assert_array_equal(keys[index], encoded)
    assert len({tuple(k) for k in keys}) == len(keys) == len({tuple(k) for k in encoded})
    assert counts.sum() == len(encoded)


def test_unique_over_colliding_mixed_ids_is_exact():
    """Two slots' keys with equal mixed ids (built to collide) stay apart; counts exact."""
    x = 12345
    keys = tf.concat([encode(tf.constant([x, x, 7], tf.int64), 0),
                      encode(tf.constant([signed(x - GOLDEN)] * 3, tf.int64), 1)], 0)  # fmt: skip
    assert keys[0, 1] == keys[3, 1]  # the same mixed id
    unique, index, counts = (t.numpy() for t in unique_with_counts(keys))
    assert sorted(map(tuple, unique.tolist())) == sorted(set(map(tuple, keys.numpy().tolist())))
    np.testing.assert_array_equal(unique[index], keys.numpy())
    assert dict(zip(map(tuple, unique.tolist()), counts.tolist())) == {
        tuple(keys[0].numpy()): 2,
        tuple(keys[2].numpy()): 1,
        tuple(keys[3].numpy()): 3,
    }


def table_contents(table: ShardedTable) -> dict:
    keys, values = (t.numpy() for t in table.export())
    pairs = list(map(tuple, keys.tolist()))
    assert len(set(pairs)) == len(pairs), "a key is held twice"
    return dict(zip(pairs, values.tolist()))


@pytest.mark.parametrize("shards", [1, 2])
def test_table_survives_growth_rebuilds_and_a_restore_holding_each_key_once(shards, tmp_path):
    """Inserts grow the segments from their smallest size; a rebuild (as eviction does)
    keeps a subset, then evicted and new keys come back (the erase/re-insert pattern that
    doubles keys in a `DenseHashTable`); a checkpoint restores the same contents."""
    rng = np.random.default_rng(0)
    table = ShardedTable("t", 3, ModPlacement(shards), expected_keys=1)
    raw = np.unique(
        np.concatenate(
            [rng.integers(INT64_MIN, INT64_MAX, 3000, dtype=np.int64, endpoint=True), EXTREMES]
        )
    )
    keys = tf.concat([encode(tf.constant(raw), 0), encode(tf.constant(raw), 1)], 0)
    values = rng.normal(size=(int(keys.shape[0]), 3)).astype(np.float32)
    want = dict(zip(map(tuple, keys.numpy().tolist()), values.tolist()))
    before = sum(table.num_buckets(i) for i in range(shards))
    for start in range(0, len(want), 500):  # step by step: the segments double as they fill
        table.insert(keys[start : start + 500], values[start : start + 500])
    assert sum(table.num_buckets(i) for i in range(shards)) >= 8 * before
    assert table_contents(table) == want
    # Rebuild every shard with every other key, then put the dropped half back, new values.
    kept = {k: v for i, (k, v) in enumerate(sorted(want.items())) if i % 2 == 0}
    def keep(others, segments, step):
        return [
            tf.constant([tuple(k) in kept for k in tf.gather(keys, held).numpy().tolist()], tf.bool)
            for keys, _, held in segments
        ]

    for i in range(shards):
        table.rebuild_shard(i, keep)
    assert table_contents(table) == kept
    back = [k for k in want if k not in kept]
    fresh = rng.normal(size=(len(back), 3)).astype(np.float32)
    table.insert(tf.constant(back, tf.int64), fresh)
    table.insert(
        tf.constant(list(kept), tf.int64), np.array(list(kept.values()), np.float32)
    )  # again
    want = {**kept, **dict(zip(back, fresh.tolist()))}
    assert table_contents(table) == want
    path = tf.train.Checkpoint(table=table).write(str(tmp_path / "ckpt"))
    restored = ShardedTable("t", 3, ModPlacement(shards), expected_keys=1)
    tf.train.Checkpoint(table=restored).read(path).assert_consumed()
    assert table_contents(restored) == want


# ---------------------------------------------------------------------- through the CLI

# Users whose ids differ only in their top bits (or are the ends of int64), and their labels.
USERS = {5: 1, 5 + 2**55: 0, -5: 1, 2**55 - 5: 0, INT64_MAX: 1, INT64_MIN: 0, -1: 1, -2: 0}
REPEATS = 16  # rows per user


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exact")
    users = np.array(list(USERS) * REPEATS, np.int64)
    rows = {
        "click": np.array([USERS[u] for u in users.tolist()], np.int64),
        "user": users,
        # Each user with both items: only the user explains the label.
        "item": np.array((["a"] * len(USERS) + ["b"] * len(USERS)) * (REPEATS // 2), dtype=object),
    }
    write_columns(str(tmp / "train.csv"), rows, "csv", labels=["click"])
    model_dir = tmp / "run"
    config = {
        "version": 1,
        "data": {"format": "csv", "train": str(tmp / "train.csv"), "label": "click",
                 "batch_size": 16, "shuffle": False},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "table": "u"},
            {"name": "item", "kind": "categorical", "dtype": "string", "table": "i"},
        ],
        "tables": {"u": {"dim": 4}, "i": {"dim": 4}},
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(model_dir), "epochs": 4, "checkpoint_every_steps": 8,
                  "sparse_optimizer": {"type": "adam", "learning_rate": 0.05}, "evaluate": False},
        "export": {"delta_every_steps": 8},
    }  # fmt: skip
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path), "--quiet"]) == 0
    return model_dir


def test_tables_and_deltas_report_raw_ids(trained, capsys):
    capsys.readouterr()
    assert main(["tables", str(trained), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["tables"]
    assert stats["u"]["keys"] == len(USERS) and stats["u.linear"]["keys"] == len(USERS)
    from conftest import fingerprint_ids

    first = os.path.join(trained, "deltas", "8")  # every row is new in the first delta
    for table, want in (
        ("u", set(USERS)),
        ("u.linear", set(USERS)),
        ("i", set(fingerprint_ids("ab"))),
    ):
        keys = np.load(os.path.join(first, f"{table}.npz"))["keys"]
        assert keys.dtype == np.int64 and sorted(keys.tolist()) == sorted(want), table
    from recflow.training.tables import restore_engine

    assert set(restore_engine(str(trained)).logical_rows()["u"].ids.tolist()) == set(USERS)


def test_export_holds_raw_ids_and_scores_top_bit_twins_apart(trained):
    """The export's tables hold (slot, raw id); the served model learned each user's label,
    so ids that differ only in their top bits score apart (they shared a row with 55-bit keys)."""
    from recflow.config import load_config
    from recflow.embedding.plan import plan_tables

    (version,) = os.listdir(trained / "export")
    export = str(trained / "export" / version)
    loaded = tf.saved_model.load(export)
    config = load_config(os.path.join(export, "assets.extra", "recflow_config.yaml"))
    plan = plan_tables(config, first_order=True)
    for index, physical in enumerate(plan):
        keys, _ = tf.raw_ops.LookupTableExportV2(
            table_handle=loaded.tables[index].resource_handle, Tkeys=tf.int64, Tvalues=tf.float32
        )
        keys = keys.numpy().reshape(-1, 2)
        for slot, logical in enumerate(physical.logical):
            if logical.name in ("u", "u.linear"):
                assert sorted(keys[keys[:, 0] == slot, 1].tolist()) == sorted(USERS), logical.name
    serve = loaded.signatures["serving_default"]
    users = list(USERS)
    p = serve(user=tf.constant(users, tf.int64), item=tf.constant(["a"] * len(users)))
    p = dict(zip(users, p["probability"].numpy()[:, 0].tolist()))
    for clicked, other in ((5, 5 + 2**55), (-5, 2**55 - 5), (INT64_MAX, INT64_MIN), (-1, -2)):
        assert p[clicked] > 0.5 > p[other], (clicked, other, p)
