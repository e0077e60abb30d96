"""Model-based test of the embedding store: random steps, rebuilds (admission and eviction),
checkpoints, restores and growth, on 1 and 3 shards, against a plain Python dict.

The dict model follows DESIGN.md section 7 by hand: a key seen `min_count` times gets a row
carrying all its sightings; rows unseen for `ttl_steps` and waiting keys idle as long are
dropped at a rebuild; each shard keeps its share of `max_keys`, most frequent first. With
zero gradients and SGD an embedding never changes, so a stale copy of a row would show.
"""

import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from recflow.config import config_from_dict
from recflow.embedding.engine import EmbeddingEngine
from recflow.embedding.placement import ModPlacement
from recflow.features.keys import encode

MIN_COUNT, TTL, MAX_KEYS = 2, 4, 48
# Small ids, and ids at the ends of int64 or that differ from others only in their top bits.
IDS = list(range(33)) + [-1, -2, -(2**63), 2**63 - 1, 5 + 2**55, 5 - 2**63, -5, 2**55 - 5]


def make_engine(shards: int) -> EmbeddingEngine:
    config = config_from_dict(
        {
            "data": {"format": "synthetic", "label": "click", "batch_size": 8},
            "features": [{"name": "item", "kind": "categorical", "dtype": "int64", "table": "t"}],
            "tables": {
                "t": {
                    "dim": 2,
                    "optimizer": {"type": "sgd", "learning_rate": 1.0},
                    "initializer": {"type": "uniform", "minval": -1.0, "maxval": 1.0},
                    "admission": {"min_count": MIN_COUNT},
                    "eviction": {"ttl_steps": TTL, "max_keys": MAX_KEYS},
                    "expected_keys": 16,  # starts small, so inserts make the shards grow
                }
            },
            "model": {"type": "deepfm"},
        }
    )
    return EmbeddingEngine(config, ModPlacement(shards))


class StoreMachine(RuleBasedStateMachine):
    shards = 1

    def __init__(self):
        super().__init__()
        self.engine = make_engine(self.shards)
        self.checkpoint = tf.train.Checkpoint(engine=self.engine)
        self.step = 0
        self.rows = {}  # id -> [count, last_step]
        self.waiting = {}  # id -> [count, last_step]
        self.emb = {}  # id -> embedding when its row was created
        self.saved = None  # (path, step, rows, waiting, emb)

    @initialize(tmp=st.just(None))
    def make_dir(self, tmp):
        self.dir = tempfile.mkdtemp(prefix="store-model-")

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ operations

    def _train(self, ids: np.ndarray) -> None:
        self.step += 1
        engine = self.engine
        states = engine.prepare({"item": tf.constant(ids, tf.int64)}, tf.constant(self.step, tf.int64))
        engine.apply(states, [None], tf.constant(self.step, tf.int64))
        new = {}
        for key, n in zip(*np.unique(ids, return_counts=True)):
            key, n = int(key), int(n)
            if key in self.rows:
                self.rows[key] = [self.rows[key][0] + n, self.step]
                continue
            seen = self.waiting.get(key, [0, 0])[0] + n
            if seen >= MIN_COUNT:
                self.rows[key] = [seen, self.step]
                self.waiting.pop(key, None)
                new[key] = True
            else:
                self.waiting[key] = [seen, self.step]
        if new:
            got = engine.logical_rows()["t"]
            for key, emb in zip(got.ids.tolist(), got.emb):
                if key in new:
                    self.emb[key] = emb.copy()

    @rule(ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=12))
    def train_small_ids(self, ids):
        self._train(np.array(ids, np.int64))

    @rule(
        start=st.integers(1000, 10**6),
        n=st.integers(20, 150),
        top=st.sampled_from([0, 2**55, -(2**62)]),
    )
    def grow(self, start, n, top):
        # Every id twice: a burst of admitted keys that makes the shards grow.
        ids = np.arange(start, start + n, dtype=np.int64) + np.int64(top)
        self._train(np.concatenate([ids, ids]))

    @rule()
    def rebuild(self):
        self.engine.rebuild(self.step)
        cutoff = self.step - TTL
        self.waiting = {k: v for k, v in self.waiting.items() if v[1] > cutoff}
        alive = {k: v for k, v in self.rows.items() if v[1] > cutoff}
        got = self.engine.logical_rows()["t"]
        kept = set(got.ids.tolist())
        # max_keys: per shard, the kept keys outrank (count, last) every dropped one.
        ids = np.array(sorted(alive), np.int64)
        shard = self.engine.placement.shard_of(encode(tf.constant(ids), 0)).numpy() if ids.size else ids
        limit = -(-MAX_KEYS // self.shards)
        for s in range(self.shards):
            mine = [int(k) for k in ids[shard == s]]
            keep = [k for k in mine if k in kept]
            drop = [k for k in mine if k not in kept]
            assert len(keep) == min(limit, len(mine))
            if keep and drop:
                assert min(tuple(alive[k]) for k in keep) >= max(tuple(alive[k]) for k in drop)
        assert kept <= set(alive)
        self.rows = {k: v for k, v in alive.items() if k in kept}

    @rule()
    def save(self):
        path = self.checkpoint.write(f"{self.dir}/ckpt-{self.step}")
        self.saved = (path, self.step, dict(self.rows), dict(self.waiting), dict(self.emb))

    @precondition(lambda self: self.saved is not None)
    @rule(fresh=st.booleans())
    def restore(self, fresh):
        path, self.step, rows, waiting, self.emb = self.saved
        self.rows = {k: list(v) for k, v in rows.items()}
        self.waiting = {k: list(v) for k, v in waiting.items()}
        if fresh:  # a new process: a new engine restored from the files
            self.engine = make_engine(self.shards)
            self.checkpoint = tf.train.Checkpoint(engine=self.engine)
        self.checkpoint.read(path).assert_consumed()

    # ------------------------------------------------------------------ invariants

    def embeddings(self, ids: list, missing: np.ndarray | None = None) -> np.ndarray:
        """The embedding each id got when its row was created [len(ids), 2] (all compared
        at once: a per-row assert costs more than the engine call it checks)."""
        rows = [self.emb[k] if missing is None else self.emb.get(k, missing) for k in ids]
        return np.array(rows, np.float32).reshape(len(ids), 2)

    @invariant()
    def matches_the_dict(self):
        got = self.engine.logical_rows()["t"]
        ids = got.ids.tolist()
        assert len(ids) == len(set(ids)), "a key is held twice"
        assert {k: [c, s] for k, c, s in zip(ids, got.count.tolist(), got.last_step.tolist())} == self.rows
        np.testing.assert_array_equal(got.emb, self.embeddings(ids), err_msg=f"ids {ids}")
        stats = self.engine.table_stats()["t"]
        assert stats["keys"] == len(self.rows) and sum(stats["shards"]) == len(self.rows)
        assert stats["waiting_keys"] == len(self.waiting)
        keys, emb = (t.numpy() for t in self.engine.serving_rows(0))  # (slot, raw id) pairs
        assert (keys[:, 0] == 0).all() and sorted(keys[:, 1].tolist()) == sorted(self.rows)
        np.testing.assert_array_equal(emb, self.embeddings(keys[:, 1].tolist()), err_msg=f"ids {keys[:, 1]}")

    @invariant()
    def lookups_read_the_rows(self):
        probe = sorted(self.rows)[:8] + [999_999_999]
        out = self.engine.embed({"item": tf.constant(probe, tf.int64)})["item"].numpy()
        np.testing.assert_array_equal(out, self.embeddings(probe, missing=np.zeros(2, np.float32)))


@pytest.mark.parametrize("shards", [1, 3])
def test_store_matches_a_dict(shards):
    machine = type(f"StoreMachine{shards}", (StoreMachine,), {"shards": shards})
    machine.TestCase.settings = settings(
        max_examples=12,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    machine.TestCase().runTest()
