"""The embedding engine: sparse optimizers against numpy, exact key sets, admission, fusion."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import fingerprint_ids

from recflow.config import config_from_dict
from recflow.embedding.rows import RowLayout
from recflow.embedding.table import MAX_LOAD
from recflow.features.keys import decode, encode
from recflow.features.transform import transform
from recflow.models import RankingModel, build_model, register_model
from recflow.training.dense_optimizer import make_dense_optimizer


@register_model("test_sum_tower")
class SumTower(RankingModel):
    """logit = sum of every pooled embedding: no dense weights, so gradients are known."""

    def tower(self, inputs, training=False):
        return tf.add_n([tf.reduce_sum(v, axis=1, keepdims=True) for v in self.pooled(inputs)])


def make_config(optimizer=None, tables=None, features=None, fusion=True, model="test_sum_tower"):
    return config_from_dict(
        {
            "data": {"format": "synthetic", "label": "click"},
            "features": features
            or [{"name": "item", "kind": "categorical", "dtype": "int64", "table": "t"}],
            "tables": tables or {"t": {"dim": 3, "optimizer": optimizer or {"type": "sgd"}}},
            "embedding": {"fusion": fusion},
            "model": {"type": model},
        }
    )


def make_model(config):
    model = build_model(config)
    model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
    return model, tf.function(model.train_step)


def batch(config, raw, labels):
    features = transform(config, {k: tf.constant(v) for k, v in raw.items()})
    return features, {"click": tf.constant(labels, tf.float32)}, tf.constant(0, tf.int64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def preset(model, keys, emb, slots):
    """Writes known rows so the first update starts from known values."""
    table = model.embedding.physical_tables[0]
    layout = table.layout
    n = len(keys)
    rows = layout.pack(
        tf.constant(emb, tf.float32),
        tf.constant(slots, tf.float32),
        tf.ones([n], tf.int32),
        tf.zeros([n], tf.int32),
    )
    table.rows.insert(encode(tf.constant(keys, tf.int64), 0), rows)


def numpy_step(opt, e, s, g, t):
    """Reference updates, written from the papers / Keras docs."""
    kind = opt["type"]
    lr = opt["learning_rate"]
    if kind == "sgd":
        return e - lr * g, s
    if kind == "adagrad":
        acc = s + g * g
        return e - lr * g / (np.sqrt(acc) + 1e-7), acc
    if kind == "adam":
        d = e.shape[1]
        m, v = s[:, :d], s[:, d:]
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        lr_t = lr * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        return e - lr_t * m / (np.sqrt(v) + 1e-7), np.concatenate([m, v], 1)
    if kind == "ftrl":
        d = e.shape[1]
        n, z = s[:, :d], s[:, d:]
        n_new = n + g * g
        sigma = (np.sqrt(n_new) - np.sqrt(n)) / lr
        z = z + g - sigma * e
        quad = np.sqrt(n_new) / lr + 2 * opt.get("l2", 0.0)
        l1 = opt.get("l1", 0.0)
        w = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / quad, 0.0)
        return w, np.concatenate([n_new, z], 1)
    raise AssertionError(kind)


OPTIMIZERS = [
    ({"type": "sgd", "learning_rate": 0.5}, 0),
    ({"type": "adagrad", "learning_rate": 0.3}, 1),
    ({"type": "adam", "learning_rate": 0.1}, 2),
    ({"type": "ftrl", "learning_rate": 0.2, "l1": 0.01, "l2": 0.1}, 2),
]


@pytest.mark.parametrize("opt,num_slots", OPTIMIZERS, ids=[o["type"] for o, _ in OPTIMIZERS])
def test_sparse_optimizer_matches_numpy(opt, num_slots):
    config = make_config(optimizer=opt)
    model, step = make_model(config)
    rng = np.random.default_rng(0)
    keys = np.array([10, 20, 30], np.int64)
    e = rng.normal(size=(3, 3)).astype(np.float32)
    s = np.abs(rng.normal(size=(3, 3 * num_slots))).astype(np.float32) + 0.1
    preset(model, keys, e, s)
    # Key 10 twice (gradients add up), key 20 once, key 30 unseen (must not change).
    ids = np.array([10, 20, 10, 20], np.int64)
    y = np.array([1.0, 0.0, 0.0, 1.0])
    for t in (1, 2):
        step(batch(config, {"item": ids}, y))
        lookup = {k: i for i, k in enumerate(keys)}
        logits = np.array([e[lookup[k]].sum() for k in ids])
        per_example = (sigmoid(logits) - y) / len(ids)
        g = np.zeros_like(e)
        for k, d in zip(ids, per_example):
            g[lookup[k]] += d
        touched = [0, 1]
        e_new, s_new = e.copy(), s.copy()
        e_new[touched], s_new[touched] = numpy_step(opt, e[touched], s[touched], g[touched], t)
        e, s = e_new, s_new
        table = model.embedding.physical_tables[0]
        rows = table.rows.lookup(encode(tf.constant(keys), 0)).numpy()
        got_e, got_s, count, last = RowLayout(3, num_slots).split_numpy(rows)
        np.testing.assert_allclose(got_e, e, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(got_s, s, rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(count, [1 + 2 * t, 1 + 2 * t, 1])
        np.testing.assert_array_equal(last, [t, t, 0])


def demo_features():
    return [
        {"name": "user", "kind": "categorical", "dtype": "int64", "table": "u"},
        {"name": "item", "kind": "categorical", "dtype": "string", "table": "i"},
        {"name": "hist", "kind": "sequence", "dtype": "string", "max_len": 2, "table": "i"},
        {"name": "tags", "kind": "multi_hot", "dtype": "string", "dim": 4},
    ]


RAW = {
    "user": np.array([1, 2, 1, 3], np.int64),
    "item": np.array(["a", "b", "a", "c"], object),
    "hist": np.array(["b|d|e", "", "a", "f|g"], object),
    "tags": np.array(["x|y", "y", "", "z|x"], object),
}


def distinct_ids(min_count=1):
    """Expected ids per logical table, from the raw rows by hand (strings by their fingerprint)."""
    counts = {"u": {}, "i": {}, "tags": {}}
    for value in RAW["user"]:
        counts["u"][value] = counts["u"].get(value, 0) + 1
    for value in RAW["item"]:
        counts["i"][value] = counts["i"].get(value, 0) + 1
    for value in RAW["hist"]:
        for token in [t for t in value.split("|") if t][:2]:
            counts["i"][token] = counts["i"].get(token, 0) + 1
    for value in RAW["tags"]:
        for token in [t for t in value.split("|") if t]:
            counts["tags"][token] = counts["tags"].get(token, 0) + 1
    out = {}
    for table, kc in counts.items():
        kept = [k for k, c in kc.items() if c >= min_count]
        if table != "u":
            kept = fingerprint_ids(kept)
        out[table] = {int(k) for k in kept}
    return out


def ids_per_logical(model):
    """Raw ids with a row per logical table; fails if a table holds an id twice."""
    out = {}
    for name, rows in model.embedding.logical_rows().items():
        assert len(set(rows.ids.tolist())) == rows.ids.size, f"{name} holds an id twice"
        out[name] = set(rows.ids.tolist())
    return out


@pytest.mark.parametrize("fusion", [True, False])
def test_table_holds_exactly_the_distinct_keys(fusion):
    tables = {"u": {"dim": 4}, "i": {"dim": 4}}
    config = make_config(tables=tables, features=demo_features(), fusion=fusion)
    model, step = make_model(config)
    step(batch(config, RAW, [1, 0, 1, 0]))
    assert ids_per_logical(model) == distinct_ids()
    # Fusion: all three logical tables agree, so they share one physical table.
    assert len(model.embedding.physical_tables) == (1 if fusion else 3)


def test_a_first_order_companion_shares_its_tables_unique():
    # DeepFM's dim-1 weights read the same features under the same slots as the
    # embeddings (two physical tables when fused): one unique of the batch's keys for both.
    tables = {"u": {"dim": 4}, "i": {"dim": 4}}
    config = make_config(tables=tables, features=demo_features(), model="deepfm")
    model, step = make_model(config)
    data = batch(config, RAW, [1, 0, 1, 0])
    graph = step.get_concrete_function(data).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    assert len(model.embedding.physical_tables) == 2
    assert sum(n.op == "UniqueWithCounts" for n in nodes) == 1
    step(data)
    expected = distinct_ids()
    held = ids_per_logical(model)
    assert held == {**expected, **{f"{t}.linear": ids for t, ids in expected.items()}}


def test_admission_counts_before_creating_rows():
    tables = {"u": {"dim": 4}, "i": {"dim": 4, "admission": {"min_count": 2}}}
    config = make_config(tables=tables, features=demo_features())
    model, step = make_model(config)
    engine = model.embedding
    step(batch(config, RAW, [1, 0, 1, 0]))
    assert ids_per_logical(model)["i"] == distinct_ids(min_count=2)["i"]  # a (3x), b (2x)
    waiting = len(distinct_ids()["i"] - distinct_ids(2)["i"])
    assert engine.table_stats()["i"]["waiting_keys"] == waiting
    step(batch(config, RAW, [1, 0, 1, 0]))  # every key now seen at least twice
    assert ids_per_logical(model)["i"] == distinct_ids()["i"]
    stats = engine.table_stats()["i"]
    assert stats["waiting_keys"] == 0 and stats["keys"] == len(distinct_ids()["i"])
    # The admitted keys' counters linger (nothing is erased in a step) until a rebuild drops them.
    table = next(t for t in engine.physical_tables if t.spec.admission)
    assert int(table.counters.size()) == waiting
    engine.rebuild(step=2)
    assert int(table.counters.size()) == 0
    assert ids_per_logical(model)["i"] == distinct_ids()["i"]
    # A row carries every sighting, counted before and after admission.
    rows = engine.logical_rows()["i"]
    sightings = {"a": 6, "b": 4, "c": 2, "d": 2, "f": 2, "g": 2}  # hist keeps 2: no "e"
    expected = dict(zip(fingerprint_ids(sightings),
                        sightings.values()))
    assert dict(zip(rows.ids.tolist(), rows.count.tolist())) == expected


def test_key_encoding_keeps_slots_apart_and_inverts():
    ids = tf.constant([0, 5, -1, -2, 2**55 + 5, -(2**63), 2**63 - 1], tf.int64)
    a, b = encode(ids, 0).numpy(), encode(ids, 3).numpy()
    assert len({tuple(k) for k in a} | {tuple(k) for k in b}) == 2 * len(ids)
    assert (a[:, 0] == 0).all() and (b[:, 0] == 3).all()  # never the empty (-1, -1) / deleted key
    slots, back = decode(b)
    np.testing.assert_array_equal(slots, [3] * len(ids))
    np.testing.assert_array_equal(back, ids.numpy())


def test_expected_keys_sizes_the_table_up_front():
    tables = {"t": {"dim": 3, "optimizer": {"type": "sgd"}, "expected_keys": 50_000}}
    model, _ = make_model(make_config(tables=tables))
    rows = model.embedding.physical_tables[0].rows
    before = rows.num_buckets(0)
    assert 50_000 / MAX_LOAD <= before <= 1.4 * 50_000 / MAX_LOAD  # not a power-of-two doubling
    keys = encode(tf.range(50_000, dtype=tf.int64), 0)
    rows.insert(keys, tf.ones([50_000, model.embedding.physical_tables[0].layout.width]))
    assert rows.num_buckets(0) == before  # the keys fit without growing
    assert int(rows.size()) == 50_000


def test_a_new_row_draws_the_initializer_whatever_known_keys_share_its_batch():
    """New rows take `initializer` values; rows that exist keep theirs; a new key's row
    does not depend on which known keys share its batch (one draw for the new rows)."""
    from recflow.embedding.engine import EmbeddingEngine

    config = make_config(tables={"t": {
        "dim": 3, "optimizer": {"type": "sgd"},
        "initializer": {"type": "uniform", "minval": 2.0, "maxval": 3.0},
    }})

    def rows_after(batches):
        engine = EmbeddingEngine(config)
        for step, ids in enumerate(batches, start=1):
            states = engine.prepare({"item": tf.constant(ids, tf.int64)}, tf.constant(step, tf.int64))
            engine.apply(states, [None], tf.constant(step, tf.int64))  # no gradient: rows stay
        got = engine.logical_rows()["t"]
        return {int(k): e for k, e in zip(got.ids, got.emb)}

    first = rows_after([[1, 2, 3]])
    assert sorted(first) == [1, 2, 3]
    values = np.stack(list(first.values()))
    assert ((values >= 2.0) & (values < 3.0)).all() and len({tuple(v) for v in values}) == 3
    alone = rows_after([[1, 2, 3], [9]])
    shared = rows_after([[1, 2, 3], [1, 9, 2, 3]])
    for key in (1, 2, 3):  # known rows unchanged by the second step
        np.testing.assert_array_equal(alone[key], first[key])
        np.testing.assert_array_equal(shared[key], first[key])
    np.testing.assert_array_equal(shared[9], alone[9])
    assert ((alone[9] >= 2.0) & (alone[9] < 3.0)).all()
