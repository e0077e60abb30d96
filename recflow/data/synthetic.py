"""Synthetic click data with a planted, learnable ground truth (numpy only).

Three schemas: `demo` (users, items, tags, history, numeric side features),
`criteo` (label, I1..I13, C1..C26 like the Criteo display-ads set) and `sequence`
(a click that depends on the target's category in the history, for DIN). The
hidden parameters depend only on the seed, so "train" and "eval" share them; the
rows of each split come from their own derived seed. `generate` also returns the
oracle AUC, the AUC of the true click probabilities: the ceiling a model can reach.

Example:
    >>> cols, oracle = generate(SyntheticOptions(rows=1000, schema="demo"), "train")
    >>> sorted(cols)[:3], 0.7 < oracle < 0.9
    (['age', 'category', 'city'], True)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Callable

import numpy as np

from recflow.config.schema import SyntheticOptions
from recflow.metrics import auc

_TARGET_STD = 1.4  # std of the logit: sets the oracle AUC near 0.8
_TARGET_CTR = 0.25
_CALIBRATION_ROWS = 10_000

_SCHEMAS: dict[str, dict[str, str]] = {
    "demo": {
        "click": "int64", "user_id": "int64", "item_id": "string", "category": "string",
        "city": "string", "tags": "string", "hist_items": "string", "price": "float",
        "age": "float", "hour": "float",
    },
    "criteo": {
        "label": "int64",
        **{f"I{i}": "float" for i in range(1, 14)},
        **{f"C{i}": "string" for i in range(1, 27)},
    },
    "sequence": {
        "label": "int64", "user_id": "int64", "item_id": "string", "category": "string",
        "hist_items": "string", "hist_cats": "string",
    },
}  # fmt: skip
_LABELS = {"demo": ("click",), "criteo": ("label",), "sequence": ("label",)}


def columns(schema: str) -> dict[str, str]:
    """Column name -> `int64` | `string` | `float` for a schema, label first."""
    if schema not in _SCHEMAS:
        raise ValueError(f"unknown synthetic schema {schema!r}; expected one of {sorted(_SCHEMAS)}")
    return dict(_SCHEMAS[schema])


def label_columns(schema: str) -> tuple[str, ...]:
    """The label columns of a schema (0/1 int64 values)."""
    columns(schema)
    return _LABELS[schema]


def generate(options: SyntheticOptions, split: str) -> tuple[dict[str, np.ndarray], float]:
    """Samples the rows of a split.

    Args:
        options: rows, eval_rows, seed and schema.
        split: "train" (options.rows rows) or "eval" (options.eval_rows rows).

    Returns:
        (columns, oracle AUC): numpy arrays (int64, float32 with NaN for missing,
        or object arrays of str), read-only, keyed as in `columns(schema)`.
    """
    cols, oracle, _ = _split(options, split)
    return dict(cols), oracle


def train_chunks(options: SyntheticOptions, chunk_rows: int) -> Iterator[dict[str, np.ndarray]]:
    """The `options.rows` training rows in chunks of up to `chunk_rows`, for sets too big
    to hold at once. Every chunk follows the same planted truth as `generate` (so its
    eval split scores them), each with its own random stream: the rows are not
    `generate`'s."""
    truth, sampler, scale, offset = _truth(options.schema, options.seed)
    label = _LABELS[options.schema][0]
    for chunk, start in enumerate(range(0, options.rows, chunk_rows)):
        n = min(chunk_rows, options.rows - start)
        rng = np.random.default_rng([options.seed, 4, chunk])
        cols, signal = sampler(truth, rng, n)
        prob = 1.0 / (1.0 + np.exp(-(scale * signal + offset)))
        yield {label: (rng.random(n) < prob).astype(np.int64), **cols}


def oracle_auc(options: SyntheticOptions, split: str) -> float:
    """The AUC of the true click probabilities on a split."""
    return generate(options, split)[1]


def click_probabilities(options: SyntheticOptions, split: str) -> np.ndarray:
    """The true click probability of each row of a split (float64, read-only)."""
    return _split(options, split)[2]


def _split(
    options: SyntheticOptions, split: str
) -> tuple[dict[str, np.ndarray], float, np.ndarray]:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    columns(options.schema)
    rows = options.rows if split == "train" else options.eval_rows
    return _generate(options.schema, options.seed, rows, split)


@functools.lru_cache(maxsize=4)
def _generate(
    schema: str, seed: int, rows: int, split: str
) -> tuple[dict[str, np.ndarray], float, np.ndarray]:
    truth, sampler, scale, offset = _truth(schema, seed)
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])
    cols, signal = sampler(truth, rng, rows)
    prob = 1.0 / (1.0 + np.exp(-(scale * signal + offset)))
    label = (rng.random(rows) < prob).astype(np.int64)
    cols = {_LABELS[schema][0]: label, **cols}
    for array in [*cols.values(), prob]:
        array.flags.writeable = False
    return cols, auc(label, prob), prob


@functools.lru_cache(maxsize=8)
def _truth(schema: str, seed: int) -> tuple[dict, Callable, float, float]:
    """Hidden parameters, and the logit scale and offset that give the target CTR."""
    make, sampler = {"demo": (_demo_truth, _demo_rows), "criteo": (_criteo_truth, _criteo_rows),
                     "sequence": (_seq_truth, _seq_rows)}[schema]  # fmt: skip
    truth = make(np.random.default_rng([seed, 0]))
    _, signal = sampler(truth, np.random.default_rng([seed, 3]), _CALIBRATION_ROWS)
    scale = _TARGET_STD / max(float(signal.std()), 1e-9)
    centered = scale * (signal - signal.mean())
    lo, hi = -20.0, 20.0
    for _ in range(60):  # bisection on the offset: mean click probability == target CTR
        mid = (lo + hi) / 2.0
        if np.mean(1.0 / (1.0 + np.exp(-(centered + mid)))) < _TARGET_CTR:
            lo = mid
        else:
            hi = mid
    return truth, sampler, scale, lo - scale * float(signal.mean())


# ----------------------------------------------------------------------------- helpers


def _zipf(n: int, a: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** a
    return p / p.sum()


def _names(prefix: str, n: int) -> np.ndarray:
    return np.array([f"{prefix}{k}" for k in range(n)], dtype=object)


def _joined(names: np.ndarray, idx: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Row r -> "|".join(names[idx[r, :lengths[r]]])."""
    return np.array(["|".join(names[row[:n]]) for row, n in zip(idx, lengths)], dtype=object)


def _in_category(truth: dict, cats: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random item of each given category."""
    start, count = truth["cat_start"][cats], truth["cat_count"][cats]
    return truth["by_cat"][start + (rng.random(cats.shape) * count).astype(np.int64)]


def _catalog(rng: np.random.Generator, n_items: int, n_cat: int) -> dict:
    item_cat = rng.permutation(np.arange(n_items) % n_cat)
    by_cat = np.argsort(item_cat, kind="stable")
    count = np.bincount(item_cat, minlength=n_cat)
    return {"item_cat": item_cat, "by_cat": by_cat, "cat_count": count,
            "cat_start": np.cumsum(count) - count}  # fmt: skip


# ----------------------------------------------------------------------------- demo


def _demo_truth(rng: np.random.Generator) -> dict:
    n_users, n_items, n_cat, n_city, n_tags, dim = 5000, 2000, 30, 50, 100, 4
    truth = _catalog(rng, n_items, n_cat)
    n_item_tags = rng.integers(0, 5, n_items)
    tag_lists = [rng.choice(n_tags, k, replace=False, p=_zipf(n_tags, 0.7)) for k in n_item_tags]
    tag_names = _names("t", n_tags)
    truth.update(
        user_order=rng.permutation(n_users), item_order=rng.permutation(n_items),
        user_city=rng.choice(n_city, n_users, p=_zipf(n_city, 0.8)),
        user_age=rng.integers(18, 71, n_users).astype(np.float32),
        user_fav=rng.integers(0, n_cat, n_users),
        item_price=rng.lognormal(3.0, 0.8, n_items),
        tag_lists=tag_lists, item_tags=np.array(["|".join(tag_names[t]) for t in tag_lists], dtype=object),
        user_vec=rng.normal(0, 0.6, (n_users, dim)), item_vec=rng.normal(0, 0.6, (n_items, dim)),
        item_bias=rng.normal(0, 0.5, n_items), cat_bias=rng.normal(0, 0.5, n_cat),
        city_bias=rng.normal(0, 0.3, n_city), tag_effect=rng.normal(0, 0.5, n_tags),
        cat_age=rng.normal(0, 1.0, n_cat),
        items=_names("i", n_items), cats=_names("c", n_cat), cities=_names("city", n_city),
    )  # fmt: skip
    truth["tag_mean"] = np.array(
        [truth["tag_effect"][t].mean() if len(t) else 0.0 for t in tag_lists]
    )
    return truth


def _demo_rows(
    t: dict, rng: np.random.Generator, n: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    users = t["user_order"][rng.choice(len(t["user_order"]), n, p=_zipf(len(t["user_order"]), 1.0))]
    popular = t["item_order"][
        rng.choice(len(t["item_order"]), (n, 11), p=_zipf(len(t["item_order"]), 1.1))
    ]
    favored = _in_category(t, np.repeat(t["user_fav"][users][:, None], 11, axis=1), rng)
    picks = np.where(rng.random((n, 11)) < np.r_[0.3, [0.6] * 10], favored, popular)
    items, hist = picks[:, 0], picks[:, 1:]
    hist_len = rng.integers(0, 11, n)
    cat = t["item_cat"][items]
    same = (t["item_cat"][hist] == cat[:, None]) & (np.arange(10) < hist_len[:, None])
    match = same.sum(axis=1) / np.maximum(hist_len, 1)
    price = (t["item_price"][items] * rng.lognormal(0.0, 0.2, n)).astype(np.float32)
    price[rng.random(n) < 0.05] = np.nan
    age, hour = t["user_age"][users], rng.integers(0, 24, n).astype(np.float32)
    city = t["user_city"][users]
    signal = (
        np.einsum("nd,nd->n", t["user_vec"][users], t["item_vec"][items])
        + t["item_bias"][items] + t["cat_bias"][cat] + t["city_bias"][city] + t["tag_mean"][items]
        + 1.2 * match
        - 0.3 * np.nan_to_num((np.log(price) - 3.0) / 0.8)
        + 0.2 * (age - 44.0) / 15.0 * t["cat_age"][cat]
        + 0.3 * np.cos(2 * np.pi * (hour - 20.0) / 24.0)
    )  # fmt: skip
    cols = {
        "user_id": (users + 1).astype(np.int64), "item_id": t["items"][items], "category": t["cats"][cat],
        "city": t["cities"][city], "tags": t["item_tags"][items],
        "hist_items": _joined(t["items"], hist, hist_len),
        "price": price, "age": age.astype(np.float32), "hour": hour,
    }  # fmt: skip
    return cols, signal


# ----------------------------------------------------------------------------- criteo


def _criteo_truth(rng: np.random.Generator) -> dict:
    sizes = rng.permutation(np.round(np.geomspace(10, 20_000, 26)).astype(np.int64))
    vocabs = []
    for size in sizes:
        ids = rng.choice(2**32, int(size), replace=False)
        vocabs.append(np.array([f"{v:08x}" for v in ids], dtype=object))
    sigma = rng.uniform(0.05, 0.8, 26)
    pairs = [tuple(rng.choice(26, 2, replace=False)) for _ in range(4)]
    return {
        "sizes": sizes, "vocabs": vocabs, "weights": [rng.normal(0, s, int(n)) for s, n in zip(sigma, sizes)],
        "pairs": pairs, "pair_weights": rng.normal(0, 0.6, (4, 997)),
        "num_scale": rng.uniform(1.0, 200.0, 13), "num_shape": rng.uniform(1.2, 3.0, 13),
        "num_coef": rng.normal(0, 0.3, 13),
    }  # fmt: skip


def _criteo_rows(
    t: dict, rng: np.random.Generator, n: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    cols: dict[str, np.ndarray] = {}
    signal = np.zeros(n)
    for i in range(13):
        x = np.floor(rng.pareto(t["num_shape"][i], n) * t["num_scale"][i]).astype(np.float32)
        signal += t["num_coef"][i] * (np.log1p(x) - np.log1p(t["num_scale"][i]))
        x[rng.random(n) < 0.10] = np.nan
        cols[f"I{i + 1}"] = x
    ids = []
    for c in range(26):
        size = int(t["sizes"][c])
        idx = rng.choice(size, n, p=_zipf(size, 1.1))
        empty = rng.random(n) < 0.05
        signal += np.where(empty, 0.0, t["weights"][c][idx])
        cols[f"C{c + 1}"] = np.where(empty, "", t["vocabs"][c][idx]).astype(object)
        ids.append(np.where(empty, -1, idx))
    for k, (a, b) in enumerate(t["pairs"]):
        both = (ids[a] >= 0) & (ids[b] >= 0)
        signal += np.where(both, t["pair_weights"][k][(ids[a] * 1_000_003 + ids[b]) % 997], 0.0)
    return cols, signal


# ----------------------------------------------------------------------------- sequence


def _seq_truth(rng: np.random.Generator) -> dict:
    n_users, n_items, n_cat = 2000, 1000, 20
    truth = _catalog(rng, n_items, n_cat)
    truth.update(
        user_order=rng.permutation(n_users), user_favs=rng.integers(0, n_cat, (n_users, 3)),
        fav_weights=rng.dirichlet(np.ones(3), n_users), item_bias=rng.normal(0, 0.3, n_items),
        cat_bias=rng.normal(0, 0.3, n_cat), items=_names("i", n_items), cats=_names("c", n_cat),
    )  # fmt: skip
    return truth


def _seq_rows(
    t: dict, rng: np.random.Generator, n: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    n_users, n_items = len(t["user_order"]), len(t["items"])
    users = t["user_order"][rng.choice(n_users, n, p=_zipf(n_users, 0.8))]
    cum = np.cumsum(t["fav_weights"][users], axis=1)
    which = (rng.random((n, 21))[:, :, None] > cum[:, None, :]).sum(axis=2).clip(0, 2)
    fav_cats = np.take_along_axis(t["user_favs"][users], which, axis=1)
    favored = _in_category(t, fav_cats, rng)
    anything = rng.integers(0, n_items, (n, 21))
    picks = np.where(rng.random((n, 21)) < np.r_[0.5, [0.7] * 20], favored, anything)
    items, hist = picks[:, 0], picks[:, 1:]
    hist_len = rng.integers(5, 21, n)
    cat = t["item_cat"][items]
    count = ((t["item_cat"][hist] == cat[:, None]) & (np.arange(20) < hist_len[:, None])).sum(
        axis=1
    )
    signal = 2.0 * (count > 0) + 3.0 * count / hist_len + t["item_bias"][items] + t["cat_bias"][cat]
    cols = {
        "user_id": (users + 1).astype(np.int64), "item_id": t["items"][items], "category": t["cats"][cat],
        "hist_items": _joined(t["items"], hist, hist_len),
        "hist_cats": _joined(t["cats"], t["item_cat"][hist], hist_len),
    }  # fmt: skip
    return cols, signal
