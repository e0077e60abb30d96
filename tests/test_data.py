"""Tests of recflow.data: CSV/TFRecord/Parquet/synthetic pipelines and source checks.

Expected values are written by hand or computed with numpy/pandas from the files.
"""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from recflow.config import config_from_dict
from recflow.config.schema import SyntheticOptions
from recflow.data import (
    bad_record_message,
    check_sources,
    generate,
    make_dataset,
    make_file_dataset,
    write_synthetic,
)
from recflow.data.check import check as check_data
from recflow.data.writer import write_columns
from recflow.errors import DataError

# The real sample rows live beside the repository (../shared/data), outside it.
_CANDIDATES = [os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"), "/work/shared/data"]
SHARED = next((p for p in _CANDIDATES if os.path.isdir(p)), _CANDIDATES[0])
needs_samples = pytest.mark.skipif(not os.path.isdir(SHARED), reason=f"no sample data at {SHARED}")


def make_config(data: dict, features: list, label="click", task="binary"):
    data = {"format": "csv", "label": label, "batch_size": 4, "shuffle": False, **data}
    return config_from_dict({"data": data, "features": features, "task": {"type": task}})


def cat(name, dtype="string", **kw):
    return {"name": name, "kind": "categorical", "dtype": dtype, **kw}


def num(name, **kw):
    return {"name": name, "kind": "numeric", **kw}


def read_all(ds):
    """Concatenates every batch: ({name: array}, {label: array}, total bad)."""
    features, labels, bad = {}, {}, 0
    for f, lab, b in ds:
        for out, part in ((features, f), (labels, lab)):
            for k, v in part.items():
                out.setdefault(k, []).append(v.numpy())
        bad += int(b)
    return (
        {k: np.concatenate(v) if v[0].ndim else np.sum(v) for k, v in features.items()},
        {k: np.concatenate(v) for k, v in labels.items()},
        bad,
    )


def strings(array):
    return [v.decode() for v in array]


# ----------------------------------------------------------------------------- CSV


@pytest.mark.parametrize("delimiter", [",", ";", "\t"])
def test_csv_round_trip_every_value_and_dtype(tmp_path, delimiter):
    d = delimiter
    rows = [
        ["id", "name", "price", "tags", "click"],
        ["1", " Alice ", "2.5", "a|b", "1"],
        ["2", f'"Smith{d} John"', "", "c", "0"],
        ["", "  bob", " 7", "", "1"],
        [],  # a blank line is ignored, not counted as bad
        ["-4", '"say ""hi"""', "1e3", "x|y|z", " 0.5"],
    ]
    path = tmp_path / "a.csv"
    path.write_text("\n".join(d.join(r) for r in rows) + "\n")
    features = [
        cat("id", "int64"),
        cat("name"),
        num("price"),
        {"name": "tags", "kind": "multi_hot"},
    ]
    config = make_config({"train": str(path), "csv": {"delimiter": d}}, features, task="regression")
    batch = next(iter(make_dataset(config, "train", epochs=1)))
    assert batch[0]["id"].dtype == tf.int64 and batch[0]["name"].dtype == tf.string
    assert batch[0]["price"].dtype == tf.float32 and batch[0]["tags"].dtype == tf.string
    assert batch[1]["click"].dtype == tf.float32 and batch[2].dtype == tf.int64
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert got["id"].tolist() == [1, 2, -1, -4]
    assert strings(got["name"]) == ["Alice", f"Smith{d} John", "bob", 'say "hi"']
    np.testing.assert_array_equal(got["price"], np.array([2.5, np.nan, 7.0, 1000.0], np.float32))
    assert strings(got["tags"]) == ["a|b", "c", "", "x|y|z"]
    assert labels["click"].tolist() == [1.0, 0.0, 1.0, 0.5]
    assert bad == 0


def test_csv_without_header_uses_configured_columns(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("7,x,1\n8,y,0\n")
    config = make_config(
        {"train": str(path), "csv": {"header": False, "columns": ["u", "v", "click"]}},
        [cat("u", "int64"), cat("v")],
    )
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert got["u"].tolist() == [7, 8] and strings(got["v"]) == ["x", "y"]
    assert labels["click"].tolist() == [1.0, 0.0] and bad == 0


def test_files_are_read_in_sorted_order_and_epochs_repeat(tmp_path):
    (tmp_path / "b.csv").write_text("u,click\n3,1\n4,0\n")
    (tmp_path / "a.csv").write_text("u,click\n1,0\n2,1\n")
    config = make_config({"train": str(tmp_path / "*.csv")}, [cat("u", "int64")])
    got, _, _ = read_all(make_dataset(config, "train", epochs=2))
    assert got["u"].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    # An explicit list is read in the given order.
    got, _, _ = read_all(
        make_file_dataset(config, [str(tmp_path / "b.csv"), str(tmp_path / "a.csv")], epochs=1)
    )
    assert got["u"].tolist() == [3, 4, 1, 2]


def test_shuffle_is_a_seeded_permutation(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("u,click\n" + "".join(f"{i},0\n" for i in range(50)))
    config = make_config(
        {"train": str(path), "shuffle": True, "seed": 3, "batch_size": 8}, [cat("u", "int64")]
    )
    first = read_all(make_dataset(config, "train", epochs=1))[0]["u"].tolist()
    again = read_all(make_dataset(config, "train", epochs=1))[0]["u"].tolist()
    assert first == again and sorted(first) == list(range(50)) and first != list(range(50))
    # Eval never shuffles by default.
    config = make_config(
        {"train": str(path), "eval": str(path), "shuffle": True}, [cat("u", "int64")]
    )
    assert read_all(make_dataset(config, "eval", epochs=1))[0]["u"].tolist() == list(range(50))


BAD_LINES = [
    ("2,2.5", "expected 3 fields, got 2"),
    ("7,1.0,1,9", "expected 3 fields, got 4"),
    ("3,abc,0", "column 'price': expected a number, got 'abc'"),
    ('3,"pr\u00efx\\",0', "column 'price': expected a number, got 'pr\u00efx\\'"),
    ("x1,1.0,0", "column 'id': expected an integer, got 'x1'"),
    ("+7,1.0,0", "column 'id': expected an integer, got '+7'"),  # was: does not fit in int64
    ("5,1.0,", "label 'click': expected a number, got ''"),
    (
        "5,1.0,yes",
        "label 'click': expected a number, got 'yes' (data.positive maps raw label values to 1)",
    ),
    ("5,1.0,1e39", "label 'click': expected a finite number, got '1e39'"),
    ("99999999999999999999,1.0,1", "column 'id': '99999999999999999999' does not fit in int64; "
     "use dtype: string for feature 'id'"),
    ('6,"1.0,0', "malformed quotes"),
    ('6,1"0,0', "malformed quotes"),
    # TensorFlow parses at most 31 characters (it failed the whole batch: exit 1)
    (f"6,{'1' * 32},0", f"column 'price': expected a number of at most 31 characters without its "
     f"leading zeros and decimals past the 16th, got '{'1' * 32}'"),
    (f"6,1.5,{'1' * 32}", f"label 'click': expected a number of at most 31 characters without its "
     f"leading zeros and decimals past the 16th, got '{'1' * 32}'"),
]


def test_long_numbers_read_without_their_leading_zeros_and_far_decimals(tmp_path):
    """`0.25` written with 32 decimals, an id with 30 leading zeros: TensorFlow's parse
    failed on 32 characters or more (a traceback, even with on_bad_record: skip)."""
    path = tmp_path / "long.csv"
    rows = [("0" * 30 + "7", "0.25" + "0" * 30, "1." + "0" * 32),
            ("-" + "0" * 25 + "12", "-000000000000000000000000012.125", "0"),
            ("3", "0.1234567890123456789012345678901234e-3", "1")]
    path.write_text("id,price,click\n" + "".join(",".join(r) + "\n" for r in rows), encoding="utf-8")
    config = make_config({"train": str(path), "on_bad_record": "fail"}, [cat("id", "int64"), num("price")])
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert got["id"].tolist() == [7, -12, 3] and bad == 0
    np.testing.assert_array_equal(got["price"], np.float32([0.25, -12.125, 0.1234567890123456e-3]))
    assert labels["click"].tolist() == [1.0, 0.0, 1.0]


def test_bad_records_are_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.csv"
    good = [f"{100 + i},{i}.5,{i % 2}" for i in range(len(BAD_LINES) + 1)]
    lines = [x for pair in zip(good, [line for line, _ in BAD_LINES] + [""]) for x in pair]
    path.write_text("id,price,click\n" + "\n".join(lines) + "\n", encoding="utf-8")
    config = make_config({"train": str(path), "batch_size": 3}, [cat("id", "int64"), num("price")])
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert got["id"].tolist() == list(range(100, 100 + len(good)))
    assert got["price"].tolist() == [i + 0.5 for i in range(len(good))]
    assert labels["click"].tolist() == [i % 2 for i in range(len(good))]
    assert bad == len(BAD_LINES)


@pytest.mark.parametrize("line,reason", BAD_LINES)
def test_bad_record_fail_names_file_and_line(tmp_path, line, reason):
    path = tmp_path / "bad.csv"
    path.write_text(f"id,price,click\n1,1.5,1\n{line}\n4,4.5,0\n", encoding="utf-8")
    config = make_config(
        {"train": str(path), "on_bad_record": "fail"}, [cat("id", "int64"), num("price")]
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        read_all(make_dataset(config, "train", epochs=1))
    assert bad_record_message(info.value) == f"{path}: line 3: {reason}"


def test_two_bad_rows_skipped_and_first_one_reported(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("id,price,click\n1,1.5,1\n2,2.5\n3,abc,0\n4,4.5,0\n5,5.5,1\n")
    features = [cat("id", "int64"), num("price")]
    got, _, bad = read_all(
        make_dataset(make_config({"train": str(path)}, features), "train", epochs=1)
    )
    assert got["id"].tolist() == [1, 4, 5] and bad == 2
    config = make_config({"train": str(path), "on_bad_record": "fail"}, features)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        read_all(make_dataset(config, "train", epochs=1))
    assert bad_record_message(info.value) == f"{path}: line 3: expected 3 fields, got 2"
    assert bad_record_message(ValueError("something else")) is None


@needs_samples
def test_criteo_sample_matches_pandas():
    path = f"{SHARED}/criteo_sample.txt"
    features = [num(f"I{i}") for i in range(1, 14)] + [cat(f"C{i}") for i in range(1, 27)]
    config = make_config({"train": path, "batch_size": 64}, features, label="label")
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    df = pd.read_csv(path)
    assert len(labels["label"]) == len(df) == 200 and bad == 0
    np.testing.assert_array_equal(labels["label"], df["label"].to_numpy(np.float32))
    for i in (1, 2, 5, 13):
        np.testing.assert_array_equal(got[f"I{i}"], df[f"I{i}"].to_numpy(np.float32))
    for i in (1, 6, 20, 26):
        assert strings(got[f"C{i}"]) == df[f"C{i}"].fillna("").tolist()


@needs_samples
def test_movielens_sample_quoted_titles_match_pandas():
    path = f"{SHARED}/movielens_sample.txt"
    features = [
        cat("user_id", "int64"),
        cat("title"),
        {"name": "genres", "kind": "multi_hot"},
        num("age"),
    ]
    config = make_config({"train": path, "batch_size": 64}, features, label="rating", task="regression")
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    df = pd.read_csv(path)
    assert len(got["title"]) == len(df) == 200 and bad == 0
    assert any("," in t for t in df["title"])  # the sample does hold quoted commas
    assert strings(got["title"]) == df["title"].tolist()
    assert strings(got["genres"]) == df["genres"].tolist()
    assert got["user_id"].tolist() == df["user_id"].tolist()
    np.testing.assert_array_equal(labels["rating"], df["rating"].to_numpy(np.float32))


@needs_samples
def test_census_sample_strips_spaces_and_counts_bad_labels():
    path = f"{SHARED}/census-income.sample"
    df = pd.read_csv(path, header=None, skipinitialspace=True)
    names = [f"c{i}" for i in range(df.shape[1])]
    csv_options = {"header": False, "columns": names}
    features = [cat("c2"), num("c1"), cat("c0", "int64")]
    assert df[25].dtype == np.float64  # the instance weight, e.g. 1819.08
    data = {"train": path, "csv": csv_options, "batch_size": 64}
    config = make_config(data, features, label="c25", task="regression")
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert bad == 0 and len(got["c2"]) == len(df)
    assert strings(got["c2"]) == df[2].tolist()  # " Private" -> "Private"
    np.testing.assert_array_equal(got["c1"], df[1].to_numpy(np.float32))
    np.testing.assert_array_equal(labels["c25"], df[25].to_numpy(np.float32))
    # The last column (" 50000+." / " - 50000.") is not a number: every row is malformed.
    last = names[-1]
    config = make_config(data, features, label=last, task="regression")
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert bad == len(df) and len(labels[last]) == 0
    # data.positive maps it: " 50000+." is 1 (spaces stripped on both sides), the rest 0.
    config = make_config({**data, "positive": {last: " 50000+."}}, features, label=last)
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    expected = (df.iloc[:, -1].str.strip() == "50000+.").to_numpy(np.float32)
    assert bad == 0 and 0 < expected.sum() < len(df)
    np.testing.assert_array_equal(labels[last], expected)


# ----------------------------------------------------------------------------- source checks


def test_check_sources_missing_column_and_label(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("user,click\n1,0\n")
    config = make_config({"train": str(path)}, [cat("user"), cat("city")])
    with pytest.raises(
        DataError, match=r"a\.csv: missing column 'city' \(needed by feature 'city'\)$"
    ):
        check_sources(config)
    config = make_config({"train": str(path)}, [cat("user")], label="y")
    with pytest.raises(DataError, match=r"a\.csv: missing column 'y' \(needed by label\)$"):
        check_sources(config)
    config = make_config({"train": str(path)}, [cat("u", column="user")])  # `column` renames
    check_sources(config)


def test_check_sources_no_files(tmp_path):
    pattern = str(tmp_path / "*.csv")
    config = make_config({"train": pattern}, [cat("user")])
    with pytest.raises(DataError, match=f"^data.train: no files match {re.escape(repr(pattern))}$"):
        check_sources(config)
    (tmp_path / "a.csv").write_text("user,click\n1,0\n")
    config = make_config({"train": pattern, "eval": str(tmp_path / "e*.csv")}, [cat("user")])
    with pytest.raises(DataError, match="^data.eval: no files match"):
        check_sources(config)
    config = make_config({"train": pattern}, [cat("user")])
    with pytest.raises(DataError, match="data.eval: not set"):
        make_dataset(config, "eval", epochs=1)


def test_check_sources_synthetic_schema():
    config = config_from_dict(
        {"data": {"format": "synthetic", "label": "click"}, "features": [cat("nope")]}
    )
    with pytest.raises(DataError, match="missing column 'nope' .*synthetic schema 'demo'"):
        check_sources(config)


def test_check_sources_does_not_import_tensorflow(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("user,click\n1,0\n")
    script = os.path.join(os.path.dirname(__file__), "scripts", "check_sources_without_tensorflow.py")
    subprocess.run([sys.executable, script, str(path)], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# ----------------------------------------------------------------------------- writer, other formats

DEMO_FEATURES = [
    cat("user_id", "int64"),
    cat("item_id"),
    cat("category"),
    {"name": "tags", "kind": "multi_hot"},
    {"name": "hist_items", "kind": "sequence"},
    num("price"),
    num("age"),
    num("hour"),
]


@pytest.mark.parametrize("fmt", ["csv", "tfrecord", "parquet", "synthetic"])
def test_synthetic_demo_round_trip(tmp_path, fmt):
    if fmt != "synthetic":
        paths = write_synthetic(str(tmp_path), 250, fmt, schema="demo", seed=5)
        assert paths == [str(tmp_path / f"train.{fmt}"), str(tmp_path / f"eval.{fmt}")]
        assert sorted(os.listdir(tmp_path)) == sorted(
            os.path.basename(p) for p in paths
        )  # no temp files
    data = {
        "format": fmt,
        "train": str(tmp_path / "train.*"),
        "eval": str(tmp_path / "eval.*"),
        "batch_size": 64,
        "synthetic": {"rows": 250, "eval_rows": 50, "seed": 5},
    }
    config = make_config(data, DEMO_FEATURES)
    options = SyntheticOptions(rows=250, eval_rows=50, seed=5)
    splits = [("train", 250), ("eval", 50)]
    for split, rows in splits[:1] if fmt == "parquet" else splits:  # parquet is slow to open
        columns, _ = generate(options, split)
        got, labels, bad = read_all(make_dataset(config, split, epochs=1))
        assert len(labels["click"]) == rows and bad == 0
        np.testing.assert_array_equal(labels["click"], columns["click"].astype(np.float32))
        assert got.pop("/nonfinite") == 0  # NaN is a missing price, not a non-finite one
        for name, values in got.items():
            if values.dtype == object:
                assert strings(values) == list(columns[name]), name
            else:
                np.testing.assert_array_equal(values, columns[name], err_msg=name)
        assert np.isnan(got["price"]).any()  # missing prices survive as NaN


def test_tfrecord_missing_label_is_bad(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    with tf.io.TFRecordWriter(path) as out:
        for i, click in enumerate([1.0, None, 0.0]):
            feature = {"u": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))}
            if click is not None:
                feature["click"] = tf.train.Feature(float_list=tf.train.FloatList(value=[click]))
            out.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    config = make_config({"format": "tfrecord", "train": path}, [cat("u", "int64"), num("x")])
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert got["u"].tolist() == [0, 2] and labels["click"].tolist() == [1.0, 0.0] and bad == 1
    assert np.isnan(got["x"]).all()  # absent numeric column -> NaN
    config = make_config(
        {"format": "tfrecord", "train": path, "on_bad_record": "fail"}, [cat("u", "int64")]
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        read_all(make_dataset(config, "train", epochs=1))
    assert bad_record_message(info.value) == f"{path}: record 2: label 'click' is missing"


def test_tfrecord_labels_mapped_checked_and_infinities_counted(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    rows = [("yes", 2.0, 1.0), ("no", float("inf"), 0.0), ("", 1.0, 3.0), ("yes", -float("inf"), 1.0)]
    with tf.io.TFRecordWriter(path) as out:
        for i, (answer, x, click) in enumerate(rows):
            feature = {
                "u": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                "answer": tf.train.Feature(bytes_list=tf.train.BytesList(value=[answer.encode()])),
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[x])),
                "click": tf.train.Feature(float_list=tf.train.FloatList(value=[click])),
            }
            out.write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
    data = {"format": "tfrecord", "train": path, "positive": {"answer": ["yes"]}}
    config = make_config(data, [cat("u", "int64"), num("x")], label="answer")
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    # "" is a missing label (bad); yes -> 1, no -> 0; the two infinities are counted
    assert labels["answer"].tolist() == [1.0, 0.0, 1.0] and bad == 1
    assert got["/nonfinite"] == 2
    config = make_config({"format": "tfrecord", "train": path}, [cat("u", "int64")])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        read_all(make_dataset(config, "train", epochs=1))
    assert bad_record_message(info.value).startswith(
        f"{path}: record 3: label 'click': a binary task needs 0 or 1, got 3"
    )


@pytest.mark.parametrize("fmt", ["tfrecord", "parquet"])
def test_positive_values_match_numeric_label_columns_by_value(tmp_path, fmt):
    """A rating stored as a float (TFRecord's float_list, a Parquet double) was compared as
    the text "4.000000" with the config's "4": every label became 0, exit 0."""
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    ratings = np.array([4.0, 2.0, 5.0, 3.5, 1.0, 4.0, 0.0, 5.0])
    expected = np.isin(ratings, [4.0, 5.0, 3.5]).astype(np.float32)  # [1,0,1,1,0,1,0,1]
    path = str(tmp_path / f"a.{fmt}")
    columns = {"u": np.arange(8, dtype=np.int64), "rating": ratings, "stars": ratings.astype(np.int64)}
    write_columns(path, columns, fmt)
    data = {"format": fmt, "train": path, "shuffle": False, "positive": {"rating": ["4", "5", "3.5", "x"]}}
    config = make_config(data, [cat("u", "int64")], label="rating")
    _, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    np.testing.assert_array_equal(labels["rating"], expected)
    assert bad == 0
    data["positive"] = {"stars": [4, "5"]}
    config = make_config(data, [cat("u", "int64")], label="stars")  # an int column: 3.5 -> 3
    _, labels, _ = read_all(make_dataset(config, "train", epochs=1))
    np.testing.assert_array_equal(labels["stars"], np.isin(ratings.astype(int), [4, 5]).astype(np.float32))


def test_positive_values_match_csv_numbers_by_value_too(tmp_path):
    """A CSV rating written `4.0` did not match `positive: [4, 5]` (compared as text),
    where the same rows in Parquet or TFRecord did: every format now maps the same."""
    path = tmp_path / "r.csv"
    ratings = ["4", "4.0", "5.00", "3.5", "x", " 5 ", "45", "0004"]
    path.write_text("u,rating\n" + "".join(f"{i},{r}\n" for i, r in enumerate(ratings)), encoding="utf-8")
    data = {"train": str(path), "shuffle": False, "positive": {"rating": [4, "5", "x"]}}
    config = make_config(data, [cat("u", "int64")], label="rating")
    _, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    assert labels["rating"].tolist() == [1, 1, 1, 0, 1, 1, 0, 1] and bad == 0
    report = check_data(config)
    assert report["labels"][0]["values"] == {"1": 6, "0": 2}


def test_parquet_writer_stores_no_nulls(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "a.parquet")
    write_columns(
        path,
        {"x": np.array([1.0, np.nan], np.float32), "s": np.array(["", "b"], object)},
        "parquet",
    )
    table = pq.read_table(path)
    assert table.column("x").null_count == 0 and table.column("s").null_count == 0
    assert math.isnan(table.column("x").to_pylist()[1])


# ----------------------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("fmt", ["csv", "tfrecord", "synthetic"])
def test_iterator_checkpoint_resumes_the_input_position(tmp_path, fmt):
    if fmt != "synthetic":
        write_synthetic(str(tmp_path / "d"), 120, fmt, seed=5)
    data = {
        "format": fmt,
        "train": str(tmp_path / "d" / "train.*"),
        "synthetic": {"rows": 120, "seed": 5},
        "shuffle": True,
        "shuffle_buffer": 50,
        "batch_size": 8,
    }
    config = make_config(data, DEMO_FEATURES)  # multi_hot and sequence values go through a cut
    iterator = iter(make_dataset(config, "train", epochs=None))
    for _ in range(3):
        next(iterator)
    prefix = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "ckpt" / "c"))
    expected = [next(iterator) for _ in range(2)]
    fresh = iter(make_dataset(config, "train", epochs=None))
    tf.train.Checkpoint(iterator=fresh).restore(prefix).assert_consumed()
    for want in expected:
        got = next(fresh)
        for name in want[0]:
            np.testing.assert_array_equal(got[0][name].numpy(), want[0][name].numpy())
        np.testing.assert_array_equal(got[1]["click"].numpy(), want[1]["click"].numpy())


@pytest.mark.parametrize("fmt", ["csv", "synthetic"])
def test_pipeline_builds_inside_a_tf_function(tmp_path, fmt):
    # ParameterServerStrategy traces the dataset function: building must work in graph mode.
    path = tmp_path / "a.csv"
    path.write_text("user_id,click\n3,1\n4,0\n5,1\n")
    data = {"format": fmt, "train": str(path), "synthetic": {"rows": 50, "seed": 5}}
    config = make_config(data, [cat("user_id", "int64")])
    expected = sum(read_all(make_dataset(config, "train", epochs=1))[0]["user_id"].tolist())

    @tf.function
    def total():
        ds = make_dataset(config, "train", epochs=1)
        return ds.reduce(tf.constant(0, tf.int64), lambda s, b: s + tf.reduce_sum(b[0]["user_id"]))

    assert int(total()) == expected


def test_a_tfrecord_scalar_of_another_length_is_one_bad_row(tmp_path):
    """A record whose label or id list held no value or two failed the whole batch with
    TF's `Number of float values != expected` (exit 1): now an empty list is a missing
    value and two values a bad row, named."""
    path = str(tmp_path / "a.tfrecord")
    lists = [([1.0], [10]), ([], [11]), ([0.0], [12, 13]), ([1.0, 0.0], [14]), ([0.0], []), ([1.0], [15])]
    with tf.io.TFRecordWriter(path) as out:
        for click, u in lists:
            feature = {"u": tf.train.Feature(int64_list=tf.train.Int64List(value=u)),
                       "click": tf.train.Feature(float_list=tf.train.FloatList(value=click))}  # fmt: skip
            out.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    config = make_config({"format": "tfrecord", "train": path, "shuffle": False}, [cat("u", "int64")])
    got, labels, bad = read_all(make_dataset(config, "train", epochs=1))
    # record 2: no label (missing: bad); 3: two ids; 4: two labels; 5: no id (-1, as missing)
    assert got["u"].tolist() == [10, -1, 15] and labels["click"].tolist() == [1.0, 0.0, 1.0] and bad == 3
    config = make_config({"format": "tfrecord", "train": path, "on_bad_record": "fail"}, [cat("u", "int64")])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        read_all(make_dataset(config, "train", epochs=1))
    assert bad_record_message(info.value) == f"{path}: record 2: label 'click' is missing"
    rows = [row for row in lists if len(row[0]) == 1]  # the labels fine, one record of two ids
    with tf.io.TFRecordWriter(path) as out:
        for click, u in rows:
            feature = {"u": tf.train.Feature(int64_list=tf.train.Int64List(value=u)),
                       "click": tf.train.Feature(float_list=tf.train.FloatList(value=click))}  # fmt: skip
            out.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        read_all(make_dataset(config, "train", epochs=1))
    assert bad_record_message(info.value) == f"{path}: record 2: column 'u': expected one value, got 2"


@pytest.mark.parametrize("column", ["price", "shop"])
def test_parquet_nulls_are_refused_before_reading(tmp_path, column):
    """tensorflow-io shifts the values after a null (a float column trained on wrong rows,
    exit 0) or aborts the process (a string column: exit 134, no recflow line)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    values = {"price": [1.0, 2.0, 3.0, 4.0], "shop": ["a", "b", "c", "d"]}
    values[column][2] = None
    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({**values, "click": [1.0, 0.0, 1.0, 0.0]}), path, row_group_size=2)
    config = make_config({"format": "parquet", "train": path}, [cat("shop"), num("price")])
    with pytest.raises(DataError) as info:
        check_sources(config)
    assert str(info.value) == (f"{path}: column '{column}' holds 1 null(s), which the Parquet reader "
                               "mis-reads (the values after a null shift): write a missing number as a NaN "
                               "value (pandas' to_parquet stores NaN as null; pyarrow keeps it with "
                               "pa.array(x, from_pandas=False)) and a missing string as \"\"")
    pq.write_table(pa.table({**values, "click": [1.0, 0.0, 1.0, 0.0]}), path, write_statistics=False)
    with pytest.raises(DataError, match=f"column '{column}' holds 1 null"):
        check_sources(config)  # counted by reading the column


def test_parquet_without_pyarrow_is_refused_up_front(tmp_path, monkeypatch):
    """Without pyarrow the null check was skipped (a null aborted the process, exit 134)
    and predict failed with a traceback: both now say what to install."""
    import importlib.util

    from recflow.data import sources

    path = str(tmp_path / "a.parquet")
    write_columns(path, {"u": np.arange(3), "click": np.array([1.0, 0.0, 1.0])}, "parquet")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else find_spec(name, *a))
    config = make_config({"format": "parquet", "train": path}, [cat("u", "int64")])
    with pytest.raises(DataError) as info:
        check_sources(config)
    assert str(info.value) == f"{path}: Parquet needs the pyarrow package (pip install 'pyarrow<18', or the parquet extra)"
    with pytest.raises(DataError, match="Parquet needs the pyarrow package"):
        sources.require_pyarrow(path)
