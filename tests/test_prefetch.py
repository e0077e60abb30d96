"""Prefetching the next batch's rows (`train.prefetch_embeddings`) trains exactly as step by step.

`RankingModel.train_window` fetches batch t+1's rows before step t writes, then
takes the rows both batches touch from step t's writes. So a window of steps must
leave the same tables (same keys, same rows, admission counters included) and the
same dense weights as the same batches trained one `train_step` at a time, while a
plain stale read (no refresh) must not.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from recflow.config import config_from_dict
from recflow.embedding.placement import ModPlacement
from recflow.models import build_model
from recflow.training.trainer import make_dense_optimizer

BATCH = 32
STEPS = 6


def make_config(min_count):
    return config_from_dict(
        {
            "data": {"format": "synthetic", "label": "click", "batch_size": BATCH},
            "features": [
                {"name": "user", "kind": "categorical", "dtype": "int64", "table": "ids"},
                {"name": "item", "kind": "categorical", "dtype": "int64", "table": "ids"},
                {
                    "name": "hist",
                    "kind": "sequence",
                    "dtype": "int64",
                    "max_len": 4,
                    "table": "ids",
                },
                {"name": "price", "kind": "numeric"},
            ],
            "tables": {
                "ids": {
                    "dim": 4,
                    "admission": {"min_count": min_count} if min_count > 1 else None,
                }
            },
            "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [8]}}},
        }
    )


def batches(seed):
    """Few distinct ids, so consecutive batches share many keys (new, waiting and trained)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(0, 5, BATCH)
        features = {
            "user": tf.constant(rng.integers(0, 12, BATCH), tf.int64),
            "item": tf.constant(rng.zipf(1.5, BATCH) % 40, tf.int64),
            "hist": tf.constant(
                ["|".join(str(i) for i in rng.integers(0, 40, n)) for n in lengths]
            ),
            "price": tf.constant(rng.normal(size=(BATCH, 1)), tf.float32),
        }
        labels = {"click": tf.constant(rng.integers(0, 2, BATCH), tf.float32)}
        out.append((features, labels, tf.constant(0, tf.int64)))
    return out


def fresh_model(config, shards=1):
    keras.utils.set_random_seed(1)
    model = build_model(config, ModPlacement(shards))
    model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
    return model


def snapshot(model):
    """Every table's keys and values (counters too), sorted by key; the dense weights."""
    tables = {}
    for table in model.embedding.physical_tables:
        for name, store in (("rows", table.rows), ("counters", table.counters)):
            if store is None:
                continue
            parts = [store.export_shard(i) for i in range(store.num_shards)]
            keys = np.concatenate([k.numpy() for k, _ in parts])
            values = np.concatenate([v.numpy() for _, v in parts])
            order = np.argsort(keys)
            tables[f"{table.spec.name}/{name}"] = (keys[order], values[order])
    return tables, [w.numpy() for w in model.trainable_weights]


def dataset(data):
    def gen():
        yield from data

    spec = tf.nest.map_structure(tf.type_spec_from_value, data[0])
    spec = tf.nest.map_structure(_unbatched_size, spec)
    return tf.data.Dataset.from_generator(gen, output_signature=spec)


def _unbatched_size(spec):
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec([None, None], spec.dtype, 1, spec.row_splits_dtype)
    return tf.TensorSpec([None, *spec.shape[1:]] if spec.shape.rank else [], spec.dtype)


def train_sequential(config, data, shards):
    model = fresh_model(config, shards)
    step = tf.function(model.train_step, autograph=False)
    losses = [float(step(transformed(config, b))["loss"]) for b in data]
    return model, losses


def transformed(config, batch):
    from recflow.features.transform import transform

    features, labels, bad = batch
    return transform(config, features), labels, bad


def train_windowed(config, data, window, shards):
    model = fresh_model(config, shards)
    ds = dataset(data).map(lambda *batch: transformed(config, batch))
    iterator = iter(ds)
    run = tf.function(model.train_window, autograph=False)
    steps, losses = 0, []
    for _ in range(3):  # two windows of 4 cover the 6 steps; a third must find no input
        out = run(iterator, tf.constant(window, tf.int64))
        steps += int(out["steps"])
        losses.append(float(out["loss"]))
    return model, losses, steps


@pytest.mark.parametrize("min_count,shards", [(1, 1), (3, 1), (3, 3)])
def test_window_trains_exactly_as_step_by_step(min_count, shards):
    config = make_config(min_count)
    data = batches(seed=min_count)
    expected, step_losses = train_sequential(config, data, shards)
    got, window_losses, steps = train_windowed(config, data, window=4, shards=shards)
    assert steps == STEPS and int(got.global_step) == STEPS
    # The loss of the last step of each window: steps 4 and 6.
    np.testing.assert_allclose(window_losses[:2], [step_losses[3], step_losses[5]], rtol=1e-5)
    assert np.isnan(window_losses[2])
    (want_tables, want_dense), (got_tables, got_dense) = snapshot(expected), snapshot(got)
    assert want_tables.keys() == got_tables.keys()
    for name, (keys, values) in want_tables.items():
        np.testing.assert_array_equal(got_tables[name][0], keys, err_msg=name)
        np.testing.assert_allclose(got_tables[name][1], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for want, have in zip(want_dense, got_dense):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def test_refresh_is_what_makes_it_exact():
    """Without the refresh a shared key's second update starts from the stale row and
    overwrites the first: the prefetch would lose updates."""
    config = make_config(1)
    model = fresh_model(config)
    engine = model.embedding
    ids = {
        "user": tf.constant([1, 2], tf.int64),
        "item": tf.constant([5], tf.int64),
        "hist": tf.ragged.constant([[5]], tf.int64),
    }
    first = engine.fetch(ids)
    stale = engine.fetch(ids)  # fetched before the first step writes
    step = tf.constant(1, tf.int64)
    states = engine.states(first, step)
    grads = [tf.ones_like(s.emb) for s in states]
    written = engine.apply(states, grads, step)
    fresh = engine.fetch(ids)  # read after the write
    refreshed = engine.refresh(stale, written)
    for f, r, s in zip(fresh, refreshed, stale):
        (f,), (r,), (s,) = f.shards, r.shards, s.shards  # one local shard
        np.testing.assert_array_equal(r.rows.numpy(), f.rows.numpy())
        assert not np.array_equal(s.rows.numpy(), f.rows.numpy())


def test_window_stops_at_the_end_of_the_input_and_skips_empty_batches():
    config = make_config(1)
    data = batches(seed=5)[:3]
    features, labels, _ = data[1]
    empty = (
        tf.nest.map_structure(lambda t: t[:0], features),
        {"click": labels["click"][:0]},
        tf.constant(7, tf.int64),  # a batch whose rows were all bad
    )
    data = [data[0], empty, data[2]]
    model = fresh_model(config)
    ds = dataset(data).map(lambda *batch: transformed(config, batch))
    out = tf.function(model.train_window, autograph=False)(iter(ds), tf.constant(10, tf.int64))
    assert int(out["steps"]) == 2 and int(out["examples"]) == 2 * BATCH
    assert int(model.global_step) == 2 and int(model.bad_records) == 7
    assert np.isfinite(float(out["loss"]))
