"""A multi_hot or sequence value is cut to its first `max_values` / `max_len` (+ 1)
values by the reader, before anything splits it, so one very long line costs no
memory per value (scripts/bench_long_line.py measures it). Expected values come
from Python's own split of the same text."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from recflow.config import config_from_dict
from recflow.data import make_file_dataset
from recflow.data.records import first_values
from recflow.data.sources import leading_values
from recflow.data.writer import write_columns
from recflow.features.transform import sparse_ids, transform


def python_first(text: str, separator: str, limit: int) -> str:
    return separator.join([t for t in text.split(separator) if t][: limit + 1])


@pytest.mark.parametrize("separator", ["|", "::", ";"])
@pytest.mark.parametrize("limit", [1, 3, 8])
def test_first_values_keeps_the_first_limit_plus_one_values(separator, limit):
    rng = np.random.default_rng(limit)
    texts = []
    for _ in range(200):
        tokens = [("" if rng.random() < 0.3 else f"v{rng.integers(100)}") for _ in range(rng.integers(0, 25))]
        texts.append(separator.join(tokens))
    cut = first_values(tf.constant(texts), separator, limit, longer_than=0).numpy()
    got = [t.decode() for t in cut]
    for text, kept in zip(texts, got):
        values = [t for t in text.split(separator) if t]
        if len(values) > limit + 1:
            assert kept == python_first(text, separator, limit), text
        else:  # not cut: the same values (the text itself when it is short)
            assert [t for t in kept.split(separator) if t] == values, text
        assert leading_values(text, separator, limit) == values[: limit + 1], text
    short = first_values(tf.constant(texts), separator, limit).numpy()  # all under 4 KiB
    assert [t.decode() for t in short] == texts


def long_text(count: int) -> str:
    """Values t0, t1, ... with empty values and runs of separators among them."""
    return "||" + "|".join(f"t{i}" + ("||" if i % 7 == 3 else "") for i in range(count)) + "|"


@pytest.mark.parametrize("fmt", ["csv", "tfrecord", "parquet"])
def test_a_long_line_is_cut_before_it_is_split(tmp_path, fmt):
    rows = 4
    tags = np.array(["a|b", long_text(200_000), "", "x||y|z"], dtype=object)
    hist = np.array([long_text(50_000), "h1", "h1|h2|h3|h4|h5", ""], dtype=object)
    path = str(tmp_path / f"d.{fmt}")
    columns = {"click": np.arange(rows) % 2, "tags": tags, "hist": hist}
    write_columns(path, columns, fmt, labels=["click"])
    config = config_from_dict(
        {
            "data": {"format": fmt, "train": path, "label": "click", "batch_size": rows, "shuffle": False},
            "features": [
                {"name": "tags", "kind": "multi_hot", "max_values": 7},
                {"name": "hist", "kind": "sequence", "max_len": 3},
            ],
        }
    )
    features, _, _ = next(iter(make_file_dataset(config, [path], epochs=1, shuffle=False)))
    got_tags = [t.decode() for t in features["tags"].numpy()]
    assert got_tags == ["a|b", "|".join(f"t{i}" for i in range(8)), "", "x||y|z"]
    got_hist = [t.decode() for t in features["hist"].numpy()]
    assert got_hist == ["t0|t1|t2|t3", "h1", "h1|h2|h3|h4|h5", ""]  # a short row: the transform cuts it

    counts: dict = {}
    ids = transform(config, features, counts)
    assert int(counts["truncated"]) == 1  # the long multi_hot row, counted once
    tags_feature, hist_feature = config.feature("tags"), config.feature("hist")
    expected = sparse_ids(tags_feature, tf.constant(["t0|t1|t2|t3|t4|t5|t6"]))
    np.testing.assert_array_equal(ids["tags"][1].numpy(), expected[0].numpy())
    expected = sparse_ids(hist_feature, tf.constant(["t0|t1|t2", "h1|h2|h3"]))
    np.testing.assert_array_equal(ids["hist"][0].numpy(), expected[0].numpy())
    np.testing.assert_array_equal(ids["hist"][2].numpy(), expected[1].numpy())
