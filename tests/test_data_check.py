"""`recflow data check`: counts worked out by hand from the rows written here."""

from __future__ import annotations

import json

import numpy as np
import yaml

from recflow.cli import main
from recflow.config import config_from_dict
from recflow.data.check import Distinct, check


def make(tmp_path, rows, header="user,tags,price,click", **data):
    path = tmp_path / "d.csv"
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    raw = {
        "data": {"format": "csv", "train": str(path), "label": "click", **data},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64"},
            {"name": "tags", "kind": "multi_hot", "max_values": 2},
            {"name": "price", "kind": "numeric"},
        ],
    }
    return raw, str(path)


def test_counts_per_feature_and_label(tmp_path):
    rows = [
        "1,a|b,10,1",
        "2,a|b|c,,0",
        "2,,5000,0",
        "x,a,inf,1",  # bad id: the row is bad
        "99999999999999999999,b,1,0",  # beyond int64
        "3,c,-2,1",
    ]
    raw, path = make(tmp_path, rows, max_bad_fraction=0.5)
    report = check(config_from_dict(raw))
    assert report["rows_read"] == 6 and report["bad_rows"] == 2
    assert report["first_bad"] == f"{path}: line 5: column 'user': expected an integer, got 'x'"
    by_name = {f["feature"]: f for f in report["features"]}
    user, tags, price = by_name["user"], by_name["tags"], by_name["price"]
    assert user["parse_failures"] == 2 and user["distinct"] == 5  # 1, 2, x, 999.., 3
    assert tags["empty_rate"] == round(1 / 6, 4) and tags["rows_over_max_values"] == 1
    assert tags["distinct"] == 3  # the ids of a multi_hot column: a, b, c
    assert price["nonfinite"] == 1 and price["empty_rate"] == round(1 / 6, 4)
    finite = np.array([10, 5000, 1, -2], np.float64)
    assert (price["min"], price["max"]) == (-2.0, 5000.0)
    assert price["mean"] == finite.mean()
    assert report["labels"] == [{"label": "click", "rows": 6, "missing": 0, "values": {"1": 3, "0": 3}}]
    # the overflow is a bad row in training (within max_bad_fraction here), not a stop
    assert report["problems"] == []
    assert "feature 'user': 1 values do not fit in int64 (bad rows in training); use dtype: string" in report["advice"]
    assert any("feature 'price': values up to 5000" in a for a in report["advice"])


def test_binary_label_and_bad_fraction_are_problems(tmp_path, capsys):
    rows = ["1,a,1,0", "2,a,1,3", "3,a,1,1", "y,a,1,1"]
    raw, path = make(tmp_path, rows)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert main(["data", "check", str(config), "--json"]) == 2
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["problems"][0].startswith("1 of 4 rows are bad (25.0%")
    assert report["problems"][1].startswith("label 'click': a binary task needs 0 or 1, got 3")
    assert err.startswith("recflow: data check: 2 problem(s)") and len(err.splitlines()) == 1


def test_rows_limit_and_positive_mapping(tmp_path):
    rows = ["1,a,1,yes", "2,a,1,no", "3,a,1,yes", "4,a,1,no"]
    raw, _ = make(tmp_path, rows, positive={"click": ["yes"]})
    report = check(config_from_dict(raw), rows=3)
    assert report["rows_read"] == 3 and report["problems"] == []
    assert report["labels"][0]["values"] == {"1": 2, "0": 1}


def test_distinct_estimate_beyond_the_exact_range(monkeypatch):
    monkeypatch.setattr("recflow.data.check.EXACT_DISTINCT", 1_000)
    d = Distinct()
    n = 20_000
    for i in range(n):
        d.add(str(i))
        d.add(str(i))  # repeats do not count
    assert abs(d.estimate() - n) / n < 0.05


def test_numbers_are_judged_as_training_reads_them(tmp_path):
    """A number over 31 characters once leading zeros and decimals past the 16th are left
    out is a bad row in training and here; so is a float32 overflow of a label (1e39 was
    finite to Python's float). Leading zeros of an int64 id are its value."""
    long = "1" * 32
    rows = [
        "0000000000000000000000000007,a,0.25" + "0" * 30 + ",1",  # fine: 7 and 0.25
        f"2,a,{long},0",  # bad: too long
        "3,b,1,1e39",  # bad: label overflows float32
        f"4,b,2,{long}",  # bad: label too long
    ]
    raw, path = make(tmp_path, rows, max_bad_fraction=1.0)
    report = check(config_from_dict(raw))
    assert report["rows_read"] == 4 and report["bad_rows"] == 3
    assert report["first_bad"] == (f"{path}: line 3: column 'price': expected a number of at most 31 "
                                   f"characters without its leading zeros and decimals past the 16th, got '{long}'")
    by_name = {f["feature"]: f for f in report["features"]}
    assert by_name["user"]["parse_failures"] == 0 and by_name["price"]["min"] == 0.25
    assert report["labels"][0]["values"] == {"1": 1, "0": 1, "1e39": 1, long: 1}
