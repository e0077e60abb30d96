"""Two-tower retrieval: recall@k, the in-batch loss, config checks, training, and an
export whose `query` / `candidate` signatures serve without recflow."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import recflow
from recflow import metrics
from recflow.cli import main
from recflow.config import load_config
from recflow.data import generate
from recflow.errors import ConfigError
from recflow.models import build_model
from recflow.models.heads import heads_for, in_batch_candidates, retrieval_loss

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "two_tower.yaml")
QUERY = ["user_id", "city", "age", "hist_items"]
CANDIDATE = ["item_id", "category", "tags"]

# ----------------------------------------------------------------------------- recall@k


def brute_recall(queries, candidates, targets, k) -> float:
    """Expected top-k hit rate when ties are ordered uniformly at random, by enumeration."""
    total = 0.0
    for q, t in zip(queries, targets):
        scores = [float(np.dot(q, c)) for c in candidates]
        higher = sum(s > scores[t] for s in scores)
        tied = [j for j, s in enumerate(scores) if s == scores[t]]
        orders = list(itertools.permutations(tied))  # every order of the tied block
        hits = sum(higher + order.index(t) < k for order in orders)
        total += hits / len(orders)
    return total / len(targets)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 9])
def test_recall_at_k_matches_brute_force(k):
    rng = np.random.default_rng(k)
    # Small integer embeddings make exact ties common.
    candidates = rng.integers(-1, 2, (7, 2)).astype(np.float32)
    queries = rng.integers(-1, 2, (40, 2)).astype(np.float32)
    targets = rng.integers(0, 7, 40)
    expected = brute_recall(queries, candidates, targets, k)
    assert metrics.recall_at_k(queries, candidates, targets, k, chunk=6) == pytest.approx(expected)


def test_recall_at_k_by_hand():
    candidates = np.array([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]], np.float32)
    queries = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]], np.float32)
    # Query 0: its target (0) scores best. Query 1: target 1 scores 0, below 1.0 and 0.7.
    # Query 2: all three tie; the target lands in the top 2 with probability 2/3.
    targets = np.array([0, 1, 2])
    assert metrics.recall_at_k(queries, candidates, targets, 1) == pytest.approx(
        (1 + 0 + 1 / 3) / 3
    )
    assert metrics.recall_at_k(queries, candidates, targets, 2) == pytest.approx(
        (1 + 0 + 2 / 3) / 3
    )
    assert metrics.recall_at_k(queries, candidates, targets, 3) == pytest.approx(1.0)


def test_recall_of_a_constant_model_is_the_random_baseline():
    candidates = np.ones((50, 4), np.float32)
    queries = np.ones((20, 4), np.float32)
    targets = np.arange(20)
    assert metrics.recall_at_k(queries, candidates, targets, 10) == pytest.approx(10 / 50)


def test_distinct_rows():
    ids = np.array([3, 1, 3, 3, 1])
    names = np.array([b"a", b"b", b"a", b"c", b"b"], dtype=object)
    price = np.array([1.0, np.nan, 1.0, 1.0, np.nan], np.float32)
    index, first = metrics.distinct_rows([ids, names, price])
    np.testing.assert_array_equal(index, [0, 1, 0, 2, 1])
    np.testing.assert_array_equal(first, [0, 1, 3])


# ----------------------------------------------------------------------------- the loss


def softmax_loss(scores, positives):
    """Mean over `positives` of -log softmax(scores[i])[i]."""
    scores = scores - scores.max(axis=1, keepdims=True)
    log_p = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    return float(-np.mean([log_p[i, i] for i in positives]))


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_retrieval_loss_is_an_in_batch_softmax():
    rng = np.random.default_rng(0)
    q = unit(rng.normal(size=(6, 4))).astype(np.float32)
    c = unit(rng.normal(size=(6, 4))).astype(np.float32)
    labels = np.array([1, 0, 1, 1, 0, 1], np.float32)  # rows 1 and 4 are negatives only
    expected = softmax_loss(q @ c.T / 0.5, [0, 2, 3, 5])
    for logq in (False, True):  # distinct candidates: every share is 1/B, a constant shift
        loss = retrieval_loss(tf.constant(labels), q, c, temperature=0.5, logq_correction=logq)
        assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_retrieval_loss_removes_accidental_hits_and_corrects_for_frequency():
    rng = np.random.default_rng(1)
    q = unit(rng.normal(size=(5, 3))).astype(np.float32)
    distinct = unit(rng.normal(size=(3, 3))).astype(np.float32)
    rows = np.array([0, 1, 0, 2, 0])  # candidate 0 fills three of the five rows
    c = distinct[rows]
    ids, share = in_batch_candidates(tf.constant(c))
    np.testing.assert_array_equal(ids.numpy(), [0, 1, 0, 3, 0])
    np.testing.assert_allclose(share.numpy(), [0.6, 0.2, 0.6, 0.2, 0.6])
    labels = np.ones(5, np.float32)
    scores = q @ c.T
    for logq in (False, True):
        corrected = scores - np.log(share.numpy())[None, :] if logq else scores.copy()
        for i in range(5):  # another copy of row i's own candidate is not a negative
            corrected[i, (rows == rows[i]) & (np.arange(5) != i)] = -np.inf
        loss = retrieval_loss(tf.constant(labels), q, c, logq_correction=logq)
        assert float(loss) == pytest.approx(softmax_loss(corrected, range(5)), rel=1e-5)


# ----------------------------------------------------------------------------- config checks


@pytest.mark.parametrize("bad", ["recall@0", "recall@x", "recall@", "auc", "recall@05", "ndcg@10"])
def test_retrieval_metric_names_are_checked(bad):
    with pytest.raises(ConfigError, match=r"task\.metrics\[1\]: expected 'recall@K'"):
        heads_for(load_config(CONFIG, [f"task.metrics=[recall@5, {bad}]"]))


def test_retrieval_metrics_default_to_recall_at_10():
    config = load_config(CONFIG, ["task.metrics=null"])
    assert heads_for(config)[0].metric_names(config.task) == ("recall@10",)


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"query_features": QUERY + ["item_id"]}, "'item_id' is in both"),
        ({"query_features": QUERY[:-1]}, "'hist_items' is in neither"),
        ({"candidate_features": ["item_id", "nope"]}, "`candidate_features`: no feature 'nope'"),
        ({"candidate_features": []}, "must be a non-empty list"),
        ({"query_features": "user_id"}, "must be a non-empty list"),
        ({"temperature": 0}, "`temperature` must be a positive number"),
        ({"output_dim": -2}, "`output_dim` must be a positive integer"),
        ({"hidden": [8]}, "model.params.hidden: unknown parameter of two_tower"),
    ],
)
def test_two_tower_params_are_checked(params, fragment):
    config = load_config(CONFIG)
    base = dict(config.model.params)
    base.update(params)
    config = load_config(CONFIG, [f"model.params={json.dumps(base)}"])
    with pytest.raises(ConfigError, match="model.params") as info:
        build_model(config)
    assert fragment in str(info.value)


def test_task_and_model_must_agree():
    with pytest.raises(
        ConfigError, match="model.type: task.type 'retrieval' needs a retrieval model"
    ):
        build_model(load_config(CONFIG, ["model={type: deepfm}"]))
    with pytest.raises(ConfigError, match="task.type: model 'two_tower' is a retrieval model"):
        build_model(load_config(CONFIG, ["task={type: binary}"]))


# ----------------------------------------------------------------------------- train, evaluate, serve

# Not conftest's SMALL: the two-tower config, trained long enough to beat random retrieval.
SMALL = [
    "data.synthetic={rows: 30000, eval_rows: 3000, seed: 3, schema: demo}",
    "data.batch_size=512",
    "train.epochs=null",
    "train.steps=60",
    "train.checkpoint_every_steps=null",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("two_tower")
    args = ["train", CONFIG, "--model-dir", str(model_dir), "--quiet"]
    assert main(args + [a for s in SMALL for a in ("--set", s)]) == 0
    return model_dir


def test_metrics_beat_random_retrieval(trained):
    result = json.loads((trained / "metrics.json").read_text())
    assert result["steps"] == 60
    config = load_config(CONFIG, SMALL)
    columns, _ = generate(config.data.synthetic, "eval")
    assert result["eval_queries"] == int((columns["click"] > 0).sum())
    # item_id determines category and tags: the distinct candidates are the distinct items.
    assert result["eval_candidates"] == len(np.unique(columns["item_id"]))
    for k in (10, 50):
        baseline = k / result["eval_candidates"]
        assert result[f"recall@{k}"] > 5 * baseline, (k, result)


def raw_rows(n: int = 40) -> dict:
    config = load_config(CONFIG, SMALL)
    columns, _ = generate(config.data.synthetic, "eval")
    raw = {}
    for feature in config.features:
        values = np.array(columns[feature.source][:n])
        raw[feature.name] = values.astype(np.float32) if feature.kind == "numeric" else values
    raw["item_id"][0] = "never-seen-item"  # unknown ids read the default row
    return raw


SERVE_WITHOUT_RECFLOW = Path(__file__).parent / "scripts" / "serve_two_towers_without_recflow.py"


def test_export_serves_both_towers_without_recflow(trained, tmp_path):
    raw = raw_rows()
    np.savez(tmp_path / "inputs.npz", **raw)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = tmp_path / "out.npz"
    export_dir = trained / "export" / "60"
    subprocess.run(
        [sys.executable, str(SERVE_WITHOUT_RECFLOW), str(export_dir), str(tmp_path / "inputs.npz"), str(out)],
        check=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    served = np.load(out)
    assert list(served["query_inputs"]) == sorted(QUERY)
    assert list(served["candidate_inputs"]) == sorted(CANDIDATE)
    assert served["query"].shape == served["candidate"].shape == (40, 32)
    np.testing.assert_array_equal(served["serving_default"], served["query"])

    from recflow.training.trainer import Trainer

    trainer = Trainer(load_config(CONFIG, SMALL), model_dir=str(trained), verbose=0)
    assert trainer.model_dir.restore() == 60
    feed = {k: tf.constant(v.tolist() if v.dtype == object else v) for k, v in raw.items()}
    in_process = trainer.model.predict_raw(feed)["embeddings"]
    for side in ("query", "candidate"):
        emb = in_process[side].numpy()
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(served[side], emb, rtol=1e-5, atol=1e-6)

    # Each tower reads only its own features: changing the items leaves the queries as they were.
    shuffled = dict(
        feed, item_id=tf.reverse(feed["item_id"], [0]), tags=tf.reverse(feed["tags"], [0])
    )
    again = trainer.model.predict_raw(shuffled)["embeddings"]
    np.testing.assert_array_equal(again["query"].numpy(), in_process["query"].numpy())
    assert not np.allclose(again["candidate"].numpy(), in_process["candidate"].numpy())


def test_recall_counts_a_candidate_once_whatever_its_text(tmp_path):
    """Candidates were told apart by their raw texts: the same item with its tags listed
    `b|c` in one row and ` c | b ` in another was two candidates with equal embeddings,
    each target tied with its own copy (recall@1 halved, eval_candidates doubled)."""
    import yaml

    rng = np.random.default_rng(0)
    tags = {f"i{k}": "|".join(sorted(rng.choice(list("abcdef"), 2, replace=False))) for k in range(9)}
    rows = [(u, f"i{(u + j) % 9}") for u in range(12) for j in range(3)]

    def write(name, text):
        path = tmp_path / f"{name}.csv"
        lines = "".join(f"1,{u},{i},{text(i, n)}\n" for n, (u, i) in enumerate(rows))
        path.write_text("click,u,item,tags\n" + lines, encoding="utf-8")
        return str(path)

    train = write("train", lambda i, n: tags[i])
    reordered = write("reordered", lambda i, n: tags[i] if n % 2 else " | ".join(tags[i].split("|")[::-1]))
    raw = {
        "data": {"format": "csv", "train": train, "label": "click", "batch_size": 16, "shuffle": False},
        "features": [{"name": "u", "kind": "categorical", "dtype": "int64", "dim": 4},
                     {"name": "item", "kind": "categorical", "dim": 4},
                     {"name": "tags", "kind": "multi_hot", "dim": 4}],
        "model": {"type": "two_tower", "params": {"query_features": ["u"], "candidate_features": ["item", "tags"],
                                                  "hidden_units": [], "output_dim": 4}},
        "task": {"type": "retrieval", "metrics": ["recall@1", "recall@3"]},
        "train": {"model_dir": str(tmp_path / "run"), "steps": 6},
    }  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    same = recflow.train(str(config))  # evaluated on the training rows
    other = recflow.evaluate(str(config), overrides=[f"data.eval={reordered}"])
    assert same["eval_candidates"] == other["eval_candidates"] == 9
    for k in ("recall@1", "recall@3"):
        assert other[k] == same[k]
