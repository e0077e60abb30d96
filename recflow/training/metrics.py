"""Exact evaluation metrics on collected predictions (numpy)."""

from __future__ import annotations

import numpy as np


def auc(labels, scores) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula; ties count one half.

    Returns NaN when only one class is present.
    """
    labels = np.asarray(labels, np.float64).reshape(-1) > 0.5
    scores = np.asarray(scores, np.float64).reshape(-1)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, np.float64)
    # Average ranks over runs of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [scores.size]])
    average = (starts + ends + 1) / 2.0  # 1-based mean rank of each run
    ranks[order] = np.repeat(average, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels, probabilities, eps: float = 1e-7) -> float:
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.clip(np.asarray(probabilities, np.float64).reshape(-1), eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def gauc(labels, scores, groups) -> float:
    """Group AUC: per-group AUC weighted by group size; one-class groups skipped."""
    labels = np.asarray(labels).reshape(-1)
    scores = np.asarray(scores).reshape(-1)
    groups = np.asarray(groups).reshape(-1)
    order = np.argsort(groups, kind="mergesort")
    uniq, starts = np.unique(groups[order], return_index=True)
    ends = np.append(starts[1:], groups.size)
    total, weight = 0.0, 0
    for start, end in zip(starts, ends):
        idx = order[start:end]
        value = auc(labels[idx], scores[idx])
        if not np.isnan(value):
            total += value * idx.size
            weight += idx.size
    return float(total / weight) if weight else float("nan")


def accuracy(labels, probabilities) -> float:
    y = np.asarray(labels).reshape(-1) > 0.5
    return float(np.mean((np.asarray(probabilities).reshape(-1) > 0.5) == y))


def mse(labels, predictions) -> float:
    d = np.asarray(predictions, np.float64).reshape(-1) - np.asarray(labels, np.float64).reshape(-1)
    return float(np.mean(d * d))


def mae(labels, predictions) -> float:
    d = np.asarray(predictions, np.float64).reshape(-1) - np.asarray(labels, np.float64).reshape(-1)
    return float(np.mean(np.abs(d)))


def rmse(labels, predictions) -> float:
    return float(np.sqrt(mse(labels, predictions)))


def compute(name: str, labels, predictions, groups=None) -> float:
    """One named metric (`task.metrics` names)."""
    if name == "gauc":
        return gauc(labels, predictions, groups)
    return {"auc": auc, "logloss": logloss, "accuracy": accuracy, "mse": mse, "mae": mae, "rmse": rmse}[
        name
    ](labels, predictions)
