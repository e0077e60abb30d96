"""Tests of recflow.metrics against brute-force numpy references, and of gauc in the trainer."""

import itertools
import math

import numpy as np
import pytest
import tf_keras as keras

from recflow import metrics
from recflow.config import config_from_dict
from recflow.data import generate
from recflow.training.trainer import Trainer

# ----------------------------------------------------------------------------- references


def pairwise_auc(labels, scores) -> float:
    """AUC by counting every (positive, negative) pair; a tie counts one half."""
    pos = [s for y, s in zip(labels, scores) if y > 0.5]
    neg = [s for y, s in zip(labels, scores) if y <= 0.5]
    if not pos or not neg:
        return math.nan
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def brute_gauc(labels, scores, groups) -> float:
    """Mean of the per-group pairwise AUCs weighted by group size; one-class groups skipped."""
    total, weight = 0.0, 0
    groups = np.asarray(groups)
    for g in set(groups.tolist()):
        idx = np.flatnonzero(groups == g)
        value = pairwise_auc(labels[idx], scores[idx])
        if not math.isnan(value):
            total += len(idx) * value
            weight += len(idx)
    return total / weight if weight else math.nan


# ----------------------------------------------------------------------------- auc, logloss, gauc


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("levels", [None, 5], ids=["continuous", "many-ties"])
def test_auc_matches_pairwise_counting(seed, levels):
    rng = np.random.default_rng(seed)
    n = 200
    labels = (rng.random(n) < 0.3).astype(np.int64)
    scores = rng.random(n) + 0.3 * labels
    if levels:
        scores = np.round(scores * levels) / levels  # many tied scores, across classes
    assert metrics.auc(labels, scores) == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)


def test_auc_by_hand():
    # pairs (pos, neg): (0.8, 0.1) win, (0.8, 0.4) win, (0.4, 0.1) win, (0.4, 0.4) tie -> 3.5 / 4
    assert metrics.auc([1, 0, 1, 0], [0.8, 0.1, 0.4, 0.4]) == pytest.approx(0.875)
    assert metrics.auc([1, 1, 0], [0.1, 0.2, 0.9]) == 0.0
    assert math.isnan(metrics.auc([1, 1], [0.1, 0.2]))
    assert math.isnan(metrics.auc([0, 0, 0], [0.1, 0.2, 0.3]))


def test_logloss_by_hand():
    y = np.array([1, 0, 1, 0])
    p = np.array([0.9, 0.2, 0.5, 0.6])
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.5) + math.log(0.4)) / 4
    assert metrics.logloss(y, p) == pytest.approx(expected, rel=1e-12)
    # Certain and wrong stays finite: p is clipped to [eps, 1 - eps].
    assert metrics.logloss([1, 0], [0.0, 1.0], eps=1e-7) == pytest.approx(-math.log(1e-7), rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_gauc_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 300
    groups = rng.integers(0, 25, n)  # some groups small, some one-class
    labels = (rng.random(n) < 0.3 + 0.02 * groups).astype(np.int64)
    scores = np.round(rng.random(n) + 0.2 * labels, 1)  # ties within groups
    expected = brute_gauc(labels, scores, groups)
    assert not math.isnan(expected)
    assert metrics.gauc(labels, scores, groups) == pytest.approx(expected, abs=1e-12)


def test_gauc_by_hand():
    labels = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0])
    scores = np.array([0.9, 0.1, 0.5, 0.2, 0.8, 0.3, 0.7, 0.6, 0.6])
    groups = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d"])
    # a: pos 0.9 beats both -> 1.0 (3 rows); b: one class -> skipped; c: one row -> skipped;
    # d: pos 0.7 beats 0.6 and 0.6 -> 1.0 (3 rows)
    assert metrics.gauc(labels, scores, groups) == pytest.approx(1.0)
    scores[0] = 0.3  # a: 0.3 beats 0.1, loses to 0.5 -> 0.5
    assert metrics.gauc(labels, scores, groups) == pytest.approx((3 * 0.5 + 3 * 1.0) / 6)
    assert metrics.gauc(labels, scores, groups) == pytest.approx(brute_gauc(labels, scores, groups))


def test_gauc_all_groups_one_class_is_nan():
    assert math.isnan(metrics.gauc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4], [1, 1, 2, 2]))


def test_gauc_weights_groups_by_size():
    # group 1: 4 rows, AUC 1; group 2: 2 rows, AUC 0 -> (4 * 1 + 2 * 0) / 6, not the plain mean 0.5
    labels = [1, 1, 0, 0, 1, 0]
    scores = [0.9, 0.8, 0.2, 0.1, 0.1, 0.9]
    groups = [1, 1, 1, 1, 2, 2]
    assert metrics.gauc(labels, scores, groups) == pytest.approx(4 / 6)


# ----------------------------------------------------------------------------- the trainer reports gauc


def test_trainer_reports_gauc(tmp_path):
    config = config_from_dict(
        {
            "data": {
                "format": "synthetic",
                "synthetic": {"rows": 4000, "eval_rows": 3000, "seed": 3, "schema": "sequence"},
                "label": "label",
                "batch_size": 256,
            },
            "features": [
                {"name": "user_id", "kind": "categorical", "dtype": "int64"},
                {"name": "category", "kind": "categorical", "table": "category"},
                {"name": "hist_cats", "kind": "sequence", "max_len": 20, "table": "category"},
            ],
            "tables": {"category": {"dim": 4}},
            "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [8]}}},
            "task": {"type": "binary", "metrics": ["auc", "gauc"], "group_by": "user_id"},
            "train": {"model_dir": str(tmp_path / "run"), "steps": 20},
        }
    )
    keras.utils.set_random_seed(0)
    trainer = Trainer(config, verbose=0)
    trainer.fit()
    result = trainer.evaluate()
    assert set(result) >= {"auc", "gauc"}
    assert "logloss" not in result  # only the metrics asked for

    # Recompute from the raw eval rows (raw user ids, not the hashed keys the trainer groups by).
    columns, _ = generate(config.data.synthetic, "eval")
    predictions = np.concatenate(
        [
            trainer.model(features, training=False)["probability"].numpy().reshape(-1)
            for features, _, _ in trainer.dataset("eval", epochs=1, shuffle=False)
        ]
    )
    labels, users = np.asarray(columns["label"]), np.asarray(columns["user_id"])
    assert predictions.shape == labels.shape
    # The evaluator predicts in batches of 16384 and this loop in batches of 256: the float32
    # outputs differ in their last bits, which flips a few near-tied pairs (measured 1.2e-5).
    # The metric itself is checked exactly against brute force above.
    assert result["gauc"] == pytest.approx(brute_gauc(labels, predictions, users), abs=1e-4)
    assert result["auc"] == pytest.approx(metrics.auc(labels, predictions), abs=2e-6)
