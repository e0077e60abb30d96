"""Tests of recflow.data.synthetic: schemas, determinism, planted truth, AUC."""

import dataclasses
import re

import numpy as np
import pytest

from recflow.config.schema import SyntheticOptions
from recflow.data import synthetic
from recflow.data.synthetic import (
    auc,
    click_probabilities,
    columns,
    generate,
    label_columns,
    oracle_auc,
)

SCHEMAS = ["demo", "criteo", "sequence"]


def brute_force_auc(labels, scores):
    """P(score of a positive > score of a negative), ties counting 1/2, over all pairs."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / (len(pos) * len(neg))


def test_auc_by_hand():
    # pairs (positive, negative): (.9,.9) tie 0.5, (.9,.2) 1, (.1,.9) 0, (.1,.2) 0 -> 1.5 / 4
    assert auc([1, 0, 1, 0], [0.9, 0.9, 0.1, 0.2]) == pytest.approx(0.375)
    assert auc([0, 0, 1, 1], [1, 2, 3, 4]) == 1.0
    assert auc([1, 1, 0, 0], [1, 2, 3, 4]) == 0.0
    assert auc([1, 0, 1, 0], [5, 5, 5, 5]) == 0.5
    assert np.isnan(auc([1, 1], [0.1, 0.2])) and np.isnan(auc([0, 0], [0.1, 0.2]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 300)
    scores = rng.integers(0, 6, 300) + 0.5 * labels * rng.integers(0, 2, 300)  # many ties
    assert auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_columns_match_the_declared_schema(schema):
    cols, _ = generate(SyntheticOptions(rows=500, eval_rows=100, seed=3, schema=schema), "train")
    declared = columns(schema)
    assert list(cols) == list(declared)
    assert label_columns(schema)[0] == list(declared)[0]
    for name, kind in declared.items():
        array = cols[name]
        assert len(array) == 500
        if kind == "int64":
            assert array.dtype == np.int64, name
        elif kind == "float":
            assert array.dtype == np.float32, name
        else:
            assert array.dtype == object and all(isinstance(v, str) for v in array), name
    assert set(np.unique(cols[label_columns(schema)[0]])) <= {0, 1}


@pytest.mark.parametrize("schema", SCHEMAS)
def test_deterministic_given_the_seed(schema):
    options = SyntheticOptions(rows=300, eval_rows=60, seed=11, schema=schema)
    first, oracle = generate(options, "train")
    synthetic._generate.cache_clear()
    synthetic._truth.cache_clear()
    again, oracle_again = generate(options, "train")
    assert oracle == oracle_again
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    other, _ = generate(SyntheticOptions(rows=300, eval_rows=60, seed=12, schema=schema), "train")
    assert any(
        not np.array_equal(first[n], other[n]) for n in first if first[n].dtype != np.float32
    )
    evaluation, _ = generate(options, "eval")
    assert len(evaluation[list(first)[0]]) == 60


@pytest.mark.parametrize("schema", SCHEMAS)
def test_oracle_auc_and_click_rate_are_sane(schema):
    options = SyntheticOptions(rows=20_000, eval_rows=4_000, seed=7, schema=schema)
    for split in ("train", "eval"):
        cols, oracle = generate(options, split)
        labels = cols[label_columns(schema)[0]]
        assert 0.75 <= oracle <= 0.86, (split, oracle)
        assert 0.18 <= labels.mean() <= 0.32, (split, labels.mean())


@pytest.mark.parametrize("schema", SCHEMAS)
def test_oracle_auc_equals_pairwise_auc_of_true_probabilities(schema):
    options = SyntheticOptions(rows=400, eval_rows=200, seed=5, schema=schema)
    for split in ("train", "eval"):
        cols, oracle = generate(options, split)
        prob = click_probabilities(options, split)
        assert (
            prob.shape == (len(cols[label_columns(schema)[0]]),) and ((prob > 0) & (prob < 1)).all()
        )
        assert oracle == pytest.approx(
            brute_force_auc(cols[label_columns(schema)[0]], prob), abs=1e-12
        )
        assert oracle_auc(options, split) == oracle


def test_demo_values_and_shared_truth_across_splits():
    options = SyntheticOptions(rows=5000, eval_rows=1000, seed=7, schema="demo")
    train, _ = generate(options, "train")
    evaluation, _ = generate(options, "eval")
    assert train["user_id"].min() >= 1 and train["user_id"].max() <= 5000
    assert all(re.fullmatch(r"i\d+", v) and int(v[1:]) < 2000 for v in train["item_id"])
    assert len(set(train["category"])) <= 30 and len(set(train["city"])) <= 50
    tag_counts = [len(t.split("|")) if t else 0 for t in train["tags"]]
    assert min(tag_counts) == 0 and max(tag_counts) == 4
    assert all(
        re.fullmatch(r"t\d+", t) and int(t[1:]) < 100
        for v in train["tags"]
        if v
        for t in v.split("|")
    )
    hist_counts = [len(h.split("|")) if h else 0 for h in train["hist_items"]]
    assert min(hist_counts) == 0 and max(hist_counts) == 10
    assert 0.02 <= np.isnan(train["price"]).mean() <= 0.09
    assert np.nanmin(train["price"]) > 0
    assert train["age"].min() >= 18 and train["age"].max() <= 70
    assert set(np.unique(train["hour"])) <= set(range(24))
    # Item attributes are part of the hidden truth: the same in both splits.
    for attribute in ("category", "tags"):
        mapping = {}
        for split in (train, evaluation):
            for item, value in zip(split["item_id"], split[attribute]):
                assert mapping.setdefault(item, value) == value
    # Users have a home city in both splits.
    homes = {}
    for split in (train, evaluation):
        for user, city in zip(split["user_id"], split["city"]):
            assert homes.setdefault(user, city) == city


def test_criteo_values():
    cols, _ = generate(
        SyntheticOptions(rows=5000, eval_rows=1000, seed=7, schema="criteo"), "train"
    )
    for i in range(1, 14):
        values = cols[f"I{i}"]
        assert 0.06 <= np.isnan(values).mean() <= 0.14
        assert np.nanmin(values) >= 0 and np.all(
            np.nan_to_num(values) == np.floor(np.nan_to_num(values))
        )
    sizes = []
    for i in range(1, 27):
        values = cols[f"C{i}"]
        assert 0.03 <= np.mean(values == "") <= 0.08
        assert all(re.fullmatch(r"[0-9a-f]{8}", v) for v in values if v)
        sizes.append(len(set(values)) - 1)
    assert min(sizes) <= 10 and max(sizes) > 500  # vocabularies from 10 to ~20000


def test_sequence_label_depends_on_the_category_in_the_history():
    options = SyntheticOptions(rows=8000, eval_rows=1000, seed=7, schema="sequence")
    cols, _ = generate(options, "train")
    item_category = {}
    appears = []
    for item, cat, hist, hist_cats in zip(
        cols["item_id"], cols["category"], cols["hist_items"], cols["hist_cats"]
    ):
        items, cats = hist.split("|"), hist_cats.split("|")
        assert 5 <= len(items) == len(cats) <= 20
        for i, c in zip([item, *items], [cat, *cats]):
            assert item_category.setdefault(i, c) == c  # a category is a function of the item
        appears.append(cat in cats)
    appears = np.array(appears)
    labels = cols["label"]
    assert 0.2 < appears.mean() < 0.8
    assert labels[appears].mean() > 2.5 * labels[~appears].mean()


def test_train_chunks_follow_one_truth_in_chunks():
    """`train_chunks` yields `rows` rows in chunks, each chunk its own draw of the same
    planted truth: its ids come from the vocabularies `generate` draws from (the same
    seed), none from another seed's, and its labels click at about the same rate."""
    options = SyntheticOptions(rows=2500, eval_rows=10, seed=3, schema="criteo")
    chunks = list(synthetic.train_chunks(options, 1000))
    assert [len(c["label"]) for c in chunks] == [1000, 1000, 500]
    reference, _ = synthetic.generate(dataclasses.replace(options, rows=20000), "train")
    other, _ = synthetic.generate(dataclasses.replace(options, rows=20000, seed=4), "train")
    assert set(chunks[0]) == set(reference)
    small = sorted((len(set(reference[f"C{i}"])), f"C{i}") for i in range(1, 27))[:5]
    for _, column in small:  # vocabularies of 10 to ~50 ids: the reference draws them all
        seen = {v for c in chunks for v in c[column] if v}
        assert seen and seen <= set(reference[column])
        assert not seen & set(other[column])
    assert not np.array_equal(chunks[0]["C1"], chunks[1]["C1"][: 1000])
    rate = np.mean(np.concatenate([c["label"] for c in chunks]))
    assert abs(rate - np.mean(reference["label"])) < 0.03
    again = list(synthetic.train_chunks(options, 1000))
    assert all(np.array_equal(a["I1"], b["I1"], equal_nan=True) for a, b in zip(chunks, again))
