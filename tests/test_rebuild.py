"""The streaming rebuild (eviction, admission counters) against survivors worked out in numpy.

Rows are written straight into a table that starts small, so its segments grow by
doubling; a rebuild must then keep exactly the rows numpy says survive, each once,
every float bit-identical (embedding, optimizer slots, count, last step), in
segments sized for them, and hand back the evicted ids.
"""

import numpy as np
import pytest
import tensorflow as tf

from recflow.config import config_from_dict
from recflow.embedding.engine import EmbeddingEngine
from recflow.embedding.placement import ModPlacement
from recflow.embedding.table import MAX_LOAD, id_counts, segment_buckets
from recflow.features.keys import decode, encode

DIM, TTL, STEP, N = 3, 50, 100, 6000
EXTREMES = np.array([0, 1, -1, -(2**63), 2**63 - 1, 5 + 2**55], np.int64)


def make_engine(
    shards: int, max_keys: int | None, expected_keys: int = 16, traced: bool = False
) -> EmbeddingEngine:
    """`traced`: the shards are placed on a named device, as on parameter servers, so the
    rebuild and counts run as traced functions (`ShardedTable.on_shard`), not eagerly."""
    eviction = {"ttl_steps": TTL}
    if max_keys is not None:
        eviction["max_keys"] = max_keys
    table = {
        "dim": DIM,
        "optimizer": {"type": "adagrad"},
        "admission": {"min_count": 2},
        "eviction": eviction,
        "expected_keys": expected_keys,  # 16: starts small, the inserts below grow every segment
    }
    config = config_from_dict(
        {
            "data": {"format": "synthetic", "label": "click", "batch_size": 8},
            "features": [{"name": "item", "kind": "categorical", "dtype": "int64", "table": "t"}],
            "tables": {"t": table},
            "model": {"type": "deepfm"},
        }
    )
    devices = ["/device:CPU:0"] * shards if traced else None
    return EmbeddingEngine(config, ModPlacement(shards, devices))


def random_rows(seed: int = 0) -> dict:
    """N distinct ids with rows; counts are a permutation, so (count, last) never ties."""
    rng = np.random.default_rng(seed)
    ids = np.unique(
        np.concatenate([rng.integers(-(2**63), 2**63 - 1, N, np.int64, True), EXTREMES])
    )
    n = ids.size
    return {
        "ids": rng.permutation(ids),  # insertion order unrelated to id order
        "emb": rng.normal(size=(n, DIM)).astype(np.float32),
        "slots": rng.uniform(0.1, 2.0, size=(n, DIM)).astype(np.float32),
        "count": (rng.permutation(n) + 1).astype(np.int32),
        "last": rng.integers(1, STEP + 1, n).astype(np.int32),
    }


def fill(
    engine: EmbeddingEngine, rows: dict, waiting: np.ndarray, waiting_last: np.ndarray
) -> None:
    table = engine.physical_tables[0]
    n = rows["ids"].size
    for start in range(0, n, 500):  # step by step: the segments double as they fill
        part = slice(start, start + 500)
        values = table.layout.pack(
            tf.constant(rows["emb"][part]), tf.constant(rows["slots"][part]),
            tf.constant(rows["count"][part]), tf.constant(rows["last"][part]),
        )  # fmt: skip
        table.rows.insert(encode(tf.constant(rows["ids"][part]), 0), values)
    # Counters: a stale one for every fifth key with a row (admitted keys leave theirs
    # behind), and keys still waiting, some idle past the ttl.
    stale = rows["ids"][::5]
    keys = np.concatenate([stale, waiting])
    last = np.concatenate([np.full(stale.size, STEP, np.int32), waiting_last])
    counters = np.stack([np.ones_like(last), last], axis=1)
    table.counters.insert(encode(tf.constant(keys), 0), tf.constant(counters))


def expected_survivors(engine, rows: dict, max_keys: int | None) -> np.ndarray:
    """Which rows survive, in numpy: last seen within the ttl, then each shard's
    `max_keys` share by (count, last)."""
    keep = rows["last"] > STEP - TTL
    if max_keys is None:
        return keep
    shards = engine.placement.num_shards
    shard = engine.placement.shard_of(encode(tf.constant(rows["ids"]), 0)).numpy()
    limit = max_keys // shards  # rounded down: the table never holds more than max_keys
    out = np.zeros_like(keep)
    for s in range(shards):
        mine = np.flatnonzero(keep & (shard == s))
        score = rows["count"][mine].astype(np.int64) << 32 | rows["last"][mine]
        out[mine[np.argsort(-score)[:limit]]] = True
    return out


def held(engine) -> dict:
    """{id: (emb, slots, count, last)} of the table's rows; fails on a key held twice."""
    got = engine.logical_rows()["t"]
    assert len(set(got.ids.tolist())) == got.ids.size, "a key is held twice"
    return {
        int(i): (e, s, int(c), int(t))
        for i, e, s, c, t in zip(got.ids, got.emb, got.slots, got.count, got.last_step)
    }


def assert_rows(engine, rows: dict, pick: np.ndarray) -> None:
    got = held(engine)
    assert set(got) == set(rows["ids"][pick].tolist())
    for i in np.flatnonzero(pick):
        emb, slots, count, last = got[int(rows["ids"][i])]
        np.testing.assert_array_equal(emb, rows["emb"][i])  # bit for bit
        np.testing.assert_array_equal(slots, rows["slots"][i])
        assert (count, last) == (rows["count"][i], rows["last"][i])


def counter_contents(engine) -> dict:
    counters = engine.physical_tables[0].counters
    out = {}
    for shard in range(counters.num_shards):
        keys, values = counters.export_shard(shard)
        _, ids = decode(keys.numpy())
        for key, value in zip(ids.tolist(), values.numpy().tolist()):
            assert key not in out, "a counter is held twice"
            out[key] = value
    return out


@pytest.mark.parametrize(("shards", "traced"), [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("max_keys", [None, 1501])  # 3 shards: 500 each (501 each held 1503)
def test_rebuild_keeps_exactly_the_survivors(shards, traced, max_keys, tmp_path):
    engine = make_engine(shards, max_keys, traced=traced)
    table = engine.physical_tables[0]
    rows = random_rows()
    rng = np.random.default_rng(1)
    waiting = rng.integers(-(2**63), 2**63 - 1, 800, np.int64, True)
    waiting = np.setdiff1d(waiting, rows["ids"])
    waiting_last = rng.integers(1, STEP + 1, waiting.size).astype(np.int32)
    initial = [table.rows.num_buckets(i) for i in range(shards)]
    fill(engine, rows, waiting, waiting_last)
    grown = [table.rows.num_buckets(i) for i in range(shards)]
    assert all(g >= 16 * b for g, b in zip(grown, initial))  # every shard grew by doubling
    assert_rows(engine, rows, np.ones(rows["ids"].size, bool))

    evicted, gone = engine.rebuild_tracked(STEP)

    keep = expected_survivors(engine, rows, max_keys)
    assert max_keys is None or keep.sum() <= max_keys
    assert evicted == {table.spec.name: int((~keep).sum())}
    np.testing.assert_array_equal(gone["t"], np.sort(rows["ids"][~keep]))
    assert_rows(engine, rows, keep)
    # Counters: those of keys with a row are dropped, and waiting keys idle past the ttl.
    fresh = waiting_last > STEP - TTL
    assert counter_contents(engine) == {
        int(k): [1, int(t)] for k, t in zip(waiting[fresh], waiting_last[fresh])
    }
    assert engine.table_stats()["t"]["waiting_keys"] == int(fresh.sum())
    # Each shard shrank to segments sized for its survivors, none above half of them.
    shard_of = engine.placement.shard_of(encode(tf.constant(rows["ids"][keep]), 0)).numpy()
    for i in range(shards):
        mine = int((shard_of == i).sum())
        sizes = [int(tf.shape(t.export()[0])[0]) for t in table.rows.shards[i]]
        assert sum(sizes) < grown[i]
        assert mine <= MAX_LOAD * sum(sizes) <= 1.4 * (mine + table.step_keys) + 64
        assert max(sizes) <= sum(segment_buckets(mine, table.step_keys)) // 2 or max(sizes) < 64

    # Evicted keys come back with new rows (the erase/re-insert pattern), each once.
    back = ~keep
    rows2 = {k: v.copy() for k, v in rows.items()}
    rows2["emb"][back] += 1.0
    rows2["last"][back] = STEP + 1
    values = table.layout.pack(
        tf.constant(rows2["emb"][back]), tf.constant(rows2["slots"][back]),
        tf.constant(rows2["count"][back]), tf.constant(rows2["last"][back]),
    )  # fmt: skip
    table.rows.insert(encode(tf.constant(rows2["ids"][back]), 0), values)
    assert_rows(engine, rows2, np.ones(rows["ids"].size, bool))

    # A checkpoint of the rebuilt table restores the same rows in a new engine.
    path = tf.train.Checkpoint(engine=engine).write(str(tmp_path / "ckpt"))
    restored = make_engine(shards, max_keys)
    tf.train.Checkpoint(engine=restored).read(path).assert_consumed()
    assert_rows(restored, rows2, np.ones(rows["ids"].size, bool))


def test_a_traced_rebuild_lays_out_every_bucket_as_the_eager_one():
    """The rebuild as one traced function per shard (parameter servers) orders its
    reads, empties and inserts as the eager one does: the same bucket arrays, bit for
    bit, rows and counters, and the same evicted ids and counts."""
    rows = random_rows(seed=5)
    rng = np.random.default_rng(6)
    waiting = np.setdiff1d(rng.integers(-(2**63), 2**63 - 1, 600, np.int64, True), rows["ids"])
    waiting_last = rng.integers(1, STEP + 1, waiting.size).astype(np.int32)
    results = []
    for traced in (False, True):
        engine = make_engine(2, 2000, traced=traced)
        fill(engine, rows, waiting, waiting_last)
        gone = engine.rebuild_tracked(STEP)
        table = engine.physical_tables[0]
        arrays = [
            [t.numpy() for segment in part.shards[i] for t in segment.export()]
            for part in (table.rows, table.counters)
            for i in range(2)
        ]
        results.append((gone, arrays, engine.table_stats()))
        assert bool(table.rows._functions.traced) == traced  # the path under test was taken
    (gone, arrays, stats), (gone_t, arrays_t, stats_t) = results
    assert gone[0] == gone_t[0] and gone[1].keys() == gone_t[1].keys()
    np.testing.assert_array_equal(gone[1]["t"], gone_t[1]["t"])
    assert stats == stats_t
    for shard, shard_t in zip(arrays, arrays_t):
        for a, b in zip(shard, shard_t):
            np.testing.assert_array_equal(a, b)


def test_rebuild_with_nothing_evicted_keeps_every_row():
    """No row is stale: every row stays, bit for bit, nothing is reported evicted, and
    the stale counters go."""
    engine = make_engine(1, None)
    rows = random_rows(seed=2)
    rows["last"][:] = STEP
    fill(engine, rows, np.zeros(0, np.int64), np.zeros(0, np.int32))
    evicted, gone = engine.rebuild_tracked(STEP)
    assert evicted == {engine.physical_tables[0].spec.name: 0} and gone == {}
    assert_rows(engine, rows, np.ones(rows["ids"].size, bool))
    assert counter_contents(engine) == {}


@pytest.mark.parametrize("shards", [1, 3])
def test_restore_gives_every_row_exactly_once(shards, tmp_path):
    """A table that grew by doubling, saved, comes back through `EmbeddingEngine.restore`
    (which empties the new engine's tables first) in an engine created for far more keys:
    every key once, every row bit for bit, every counter, in the saved bucket arrays, and
    a lookup of each key finds its row (the segment routes come back with the arrays)."""
    engine = make_engine(shards, None)
    table = engine.physical_tables[0]
    rows = random_rows(seed=3)
    rng = np.random.default_rng(4)
    waiting = np.setdiff1d(rng.integers(-(2**63), 2**63 - 1, 700, np.int64, True), rows["ids"])
    waiting_last = rng.integers(1, STEP + 1, waiting.size).astype(np.int32)
    initial = [table.rows.num_buckets(i) for i in range(shards)]
    fill(engine, rows, waiting, waiting_last)
    grown = [table.rows.num_buckets(i) for i in range(shards)]
    assert all(g >= 16 * b for g, b in zip(grown, initial))
    path = tf.train.Checkpoint(engine=engine).save(str(tmp_path / "ckpt"))  # as a model dir does

    restored = make_engine(shards, None, expected_keys=200_000)
    again = restored.physical_tables[0]
    assert again.rows.num_buckets(0) > grown[0]  # created larger than the saved table
    restored.restore(tf.train.Checkpoint(engine=restored), path).assert_consumed()

    everything = np.ones(rows["ids"].size, bool)
    assert_rows(restored, rows, everything)
    stale = rows["ids"][::5]
    assert counter_contents(restored) == {
        **{int(k): [1, STEP] for k in stale},
        **{int(k): [1, int(t)] for k, t in zip(waiting, waiting_last)},
    }
    assert [again.rows.num_buckets(i) for i in range(shards)] == grown
    found = again.rows.lookup(encode(tf.constant(rows["ids"]), 0)).numpy()
    emb, slots, count, last = again.layout.split_numpy(found)
    np.testing.assert_array_equal(emb, rows["emb"])
    np.testing.assert_array_equal(slots, rows["slots"])
    np.testing.assert_array_equal(count, rows["count"])
    np.testing.assert_array_equal(last, rows["last"])


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64])
def test_id_counts_count_each_id_and_no_negative_one(dtype):
    """What table counts and rebuilds tally with: empty and deleted buckets' slots are
    negative (the smallest int64 among them) and count for none."""
    ids = np.array([2, -1, 0, 2, 1, 2, -7] + ([-(2**63)] if dtype == tf.int64 else []))
    expected = np.bincount(ids[ids >= 0], minlength=4)  # id 3 held by none
    got = id_counts(tf.constant(ids, dtype), 4)
    assert got.dtype == tf.int64 and got.numpy().tolist() == expected.tolist() == [1, 1, 3, 0]
    assert id_counts(tf.zeros([0], dtype), 2).numpy().tolist() == [0, 0]


@pytest.mark.parametrize("traced", [False, True])
def test_rowless_finds_the_keys_without_a_row_across_chunks(traced):
    """Which keys lack a row, looked up a few keys at a time (eager: a Python loop over
    the chunks; traced: a while_loop): the same answer as a set lookup, in key order."""
    engine = make_engine(1, None)
    rows = random_rows(2)
    fill(engine, rows, np.zeros([0], np.int64), np.zeros([0], np.int32))
    table = engine.physical_tables[0]
    rng = np.random.default_rng(3)
    unseen = rng.integers(-(2**63), 2**63 - 1, 40, np.int64, True)
    ids = rng.permutation(np.concatenate([rows["ids"][:60], unseen]))
    keys = encode(tf.constant(ids), 0)
    held = set(rows["ids"].tolist())
    handles = table.rows.handles(0)
    for n, chunk in [(100, 7), (100, 100), (1, 7), (0, 7)]:
        def run(keys=keys[:n], chunk=chunk):
            return table.rowless(handles, keys, chunk=chunk)

        got = (tf.function(run, autograph=False) if traced else run)().numpy()
        assert got.tolist() == [i not in held for i in ids[:n]], (n, chunk)
