"""Chunks of steps in one loop (`train_chunk`), with and without prefetching the next
batch's rows (`train.prefetch_embeddings`), train exactly as step by step.

With prefetch, step t+1's rows are fetched before step t writes, then the rows both
batches touch are taken from step t's writes. So chunks must leave the same tables
(same keys, same rows, admission counters included) and the same dense weights as
the same batches trained one `train_step` at a time, while a plain stale read (no
refresh) must not.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from recflow.config import config_from_dict
from recflow.data.records import NONFINITE, TRUNCATED
from recflow.distribute.chunk import train_chunk
from recflow.embedding.placement import ModPlacement
from recflow.models import build_model
from recflow.training.dense_optimizer import make_dense_optimizer

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
            order = np.lexsort((keys[:, 1], keys[:, 0]))  # by (slot, mixed id)
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
    features = transform(config, features)
    # What the trainer's pipeline adds: counts of values read as missing and rows cut.
    features[NONFINITE] = features[TRUNCATED] = tf.constant(0, tf.int64)
    return features, labels, bad


def train_chunks(config, data, sizes, shards, prefetch):
    """Trains `data` as chunks of `sizes` batches, one iterator each; returns the chunks' results."""
    model = fresh_model(config, shards)
    if prefetch:
        model.embedding.make_staging(1)
    run = tf.function(
        lambda iterator: train_chunk(model, iterator, prefetch=prefetch), autograph=False
    )
    results, start = [], 0
    for size in sizes:
        ds = dataset(data[start : start + size]).map(lambda *batch: transformed(config, batch))
        results.append(run(iter(ds)))
        start += size
    return model, results


def assert_trained_as(want, model):
    """`model` holds the tables (keys exactly, values to float rounding) and dense weights
    of the snapshot `want`."""
    (want_tables, want_dense), (got_tables, got_dense) = want, snapshot(model)
    assert want_tables.keys() == got_tables.keys()
    for name, (keys, values) in want_tables.items():
        np.testing.assert_array_equal(got_tables[name][0], keys, err_msg=name)
        np.testing.assert_allclose(got_tables[name][1], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for w, have in zip(want_dense, got_dense):
        np.testing.assert_allclose(have, w, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def sequential():
    """`(snapshot, losses)` of `train_sequential` on the first `count` batches of `seed`,
    trained once per (min_count, seed, count, shards) for the module (tests only read it)."""
    done = {}

    def run(min_count, seed, count, shards):
        key = (min_count, seed, count, shards)
        if key not in done:
            model, losses = train_sequential(make_config(min_count), batches(seed)[:count], shards)
            done[key] = snapshot(model), losses
        return done[key]

    return run


@pytest.mark.parametrize(
    "min_count,shards,prefetch",
    [(1, 1, True), (3, 1, True), (3, 3, True), (3, 3, False)],
)
def test_chunks_train_exactly_as_step_by_step(sequential, min_count, shards, prefetch):
    config = make_config(min_count)
    data = batches(seed=min_count)
    want, step_losses = sequential(min_count, min_count, STEPS, shards)
    got, results = train_chunks(config, data, [4, 2], shards, prefetch)
    assert [int(r.steps) for r in results] == [4, 2] and int(got.global_step) == STEPS
    assert [int(r.rows) for r in results] == [4 * BATCH, 2 * BATCH]
    # The loss of the last step of each chunk: steps 4 and 6.
    np.testing.assert_allclose(
        [float(r.loss) for r in results], [step_losses[3], step_losses[5]], rtol=1e-5
    )
    assert_trained_as(want, got)


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


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("where", [0, 1, 3])  # first, middle, last batch
def test_chunk_skips_batches_without_rows(sequential, prefetch, where):
    config = make_config(1)
    data = batches(seed=5)[:3]
    features, labels, _ = data[1]
    empty = (
        tf.nest.map_structure(lambda t: t[:0], features),
        {"click": labels["click"][:0]},
        tf.constant(7, tf.int64),  # a batch whose rows were all bad
    )
    chunk = data[:where] + [empty] + data[where:]
    model, (result,) = train_chunks(config, chunk, [4], 1, prefetch=prefetch)
    assert (int(result.read), int(result.steps), int(result.rows)) == (4, 3, 3 * BATCH)
    assert int(result.bad) == 7 and int(model.bad_records) == 7
    # The same tables and weights as the three batches with rows, trained step by step.
    assert_trained_as(sequential(1, 5, 3, 1)[0], model)


def test_staging_slots_are_not_model_state(tmp_path):
    """Staged rows live between two steps of a chunk: not in the model's variables nor in
    its checkpoints (a chunk stages its first batch when it starts)."""
    model = fresh_model(make_config(1))

    def saved_keys(name):
        path = tf.train.Checkpoint(model=model).save(str(tmp_path / name))
        return sorted(key for key, _ in tf.train.list_variables(path))

    variables, keys = len(model.variables), saved_keys("before")
    model.embedding.make_staging(3)
    assert len(model.variables) == variables
    assert saved_keys("after") == keys
