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


def recall_at_k(queries, candidates, targets, k: int, chunk: int = 1024) -> float:
    """Recall@k of exact retrieval: the share of queries whose true candidate ranks in the top k.

    Each query is scored against every candidate by dot product. Ties are broken
    at random, in expectation: with g other candidates scoring higher and t others
    scoring the same, a query counts `clip((k - g) / (t + 1), 0, 1)`. So a model
    that scores everything alike gets exactly the random baseline `k / n`.

    Args:
        queries: `[Q, d]` query embeddings.
        candidates: `[N, d]` embeddings of the distinct candidates.
        targets: `[Q]` index in `candidates` of each query's true candidate.
        k: cut-off, a positive integer.
        chunk: queries scored at a time (memory `chunk * N`).

    Returns NaN when there are no queries.
    """
    queries = np.asarray(queries, np.float32)
    candidates = np.asarray(candidates, np.float32)
    targets = np.asarray(targets, np.int64).reshape(-1)
    if queries.shape[0] != targets.size:
        raise ValueError(f"{queries.shape[0]} queries but {targets.size} targets")
    if not targets.size:
        return float("nan")
    hits = 0.0
    for start in range(0, targets.size, chunk):
        scores = queries[start : start + chunk] @ candidates.T
        rows = np.arange(scores.shape[0])
        true = scores[rows, targets[start : start + chunk]][:, None]
        higher = (scores > true).sum(axis=1)
        ties = (scores == true).sum(axis=1) - 1  # other candidates with the same score
        hits += float(np.clip((k - higher) / (ties + 1.0), 0.0, 1.0).sum())
    return hits / targets.size


def distinct_rows(columns) -> tuple[np.ndarray, np.ndarray]:
    """Groups equal rows of parallel columns (values compared exactly, NaN equal to NaN).

    Returns:
        (index [n]: row -> its distinct value, first [u]: the first row of each distinct value).
    """
    keys = []
    for column in columns:
        column = np.asarray(column).reshape(len(column), -1)
        if column.dtype.kind == "f":  # compare bit patterns: NaN == NaN
            column = np.ascontiguousarray(column, np.float64).view(np.int64)
        keys.append([tuple(row) for row in column.tolist()])
    seen: dict = {}
    index = np.array([seen.setdefault(key, len(seen)) for key in zip(*keys)], np.int64)
    _, first = np.unique(index, return_index=True)
    return index, first

