"""Bad data stops a run instead of exporting a model that learned nothing.

Each run is `recflow.cli.main` in-process on a few hand-written CSV rows; the
expected counts and values follow from the rows themselves.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import tensorflow as tf
import yaml

from recflow.atomic import write_json
from recflow.cli import main
from recflow.config import config_from_dict
from recflow.features.kinds import normalize
from recflow.features.transform import sparse_ids


def config(tmp_path: Path, data: dict | None = None, **sections) -> str:
    raw = {
        "version": 1,
        "data": {
            "format": "csv",
            "train": str(tmp_path / "train.csv"),
            "label": "click",
            "batch_size": 4,
            "shuffle": False,
            **(data or {}),
        },
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "dim": 4},
            {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        ],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(tmp_path / "run"), "epochs": 1, "checkpoint_every_steps": None},
        **sections,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return str(path)


def write(tmp_path: Path, rows: list[str], header: str = "user,price,click") -> str:
    path = tmp_path / "train.csv"
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return str(path)


def fails(capsys, argv: list[str], *fragments: str) -> str:
    """Runs the CLI; checks exit 2, one `recflow: ` line on stderr holding `fragments`."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("recflow: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def no_export(tmp_path: Path) -> bool:
    return not os.path.exists(tmp_path / "run" / "export") and not os.path.exists(
        tmp_path / "run" / "metrics.json"
    )


def test_half_bad_rows_stop_the_run(tmp_path, capsys):
    rows = [f"{i},{'x' if i % 2 else i},{i % 2}" for i in range(20)]  # odd rows: price 'x'
    data = write(tmp_path, rows)
    line = fails(capsys, ["train", config(tmp_path), "--quiet"], "10 of 20 rows read are bad")
    assert "(50.0%, above data.max_bad_fraction 0.01)" in line
    # file order: row 1 (line 3 after the header) is the first bad one
    assert line.endswith(f"first: {data}: line 3: column 'price': expected a number, got 'x'")
    assert no_export(tmp_path)


def test_bad_rows_below_the_limit_train_and_are_reported(tmp_path, capsys):
    rows = [f"{i},{'x' if i == 5 else i},{i % 2}" for i in range(20)]  # 1 bad of 20 = 5%
    write(tmp_path, rows)
    assert main(["train", config(tmp_path, {"max_bad_fraction": 0.05}), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "bad_records 1" in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["bad_records"] == 1 and metrics["examples"] == 19
    assert metrics["examples_read"] == 20


def test_every_row_bad_stops_the_run(tmp_path, capsys):
    write(tmp_path, [f"{i},{i},yes" for i in range(6)])
    fails(capsys, ["train", config(tmp_path), "--quiet"], "6 of 6 rows read are bad", "label 'click'")
    assert no_export(tmp_path)


def test_zero_examples_is_an_error_even_when_bad_rows_are_allowed(tmp_path, capsys):
    write(tmp_path, [f"{i},{i},yes" for i in range(6)])
    argv = ["train", config(tmp_path, {"max_bad_fraction": 1.0}), "--quiet"]
    fails(capsys, argv, "no examples trained (6 rows read, 6 bad)")
    assert no_export(tmp_path)


def test_binary_label_other_than_0_or_1_stops_the_run(tmp_path, capsys):
    data = write(tmp_path, ["1,1.0,0", "2,2.0,1", "3,3.0,3", "4,4.0,0"])
    fails(
        capsys,
        ["train", config(tmp_path), "--quiet"],
        f"{data}: line 4: label 'click': a binary task needs 0 or 1, got 3",
        "data.positive",
    )
    assert no_export(tmp_path)


def test_positive_values_that_match_no_row_are_named_in_a_warning(tmp_path, capsys):
    """data.positive maps 'yes' to 1, but the column holds 0 and 1: every label reads as 0,
    so the AUC is undefined; the run says why it may be (it used to end silently)."""
    write(tmp_path, [f"{i},{i}.5,{i % 2}" for i in range(8)])
    capsys.readouterr()
    assert main(["train", config(tmp_path, {"positive": {"click": ["yes"]}}), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "label 'click' is 0 in all 8 train rows: AUC is undefined; data.positive maps ['yes'] to 1" in err
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["auc"] is None and metrics["eval_examples"] == 8
    # The same rows without the mapping: both classes, no warning.
    capsys.readouterr()
    argv = ["train", config(tmp_path), "--quiet", "--model-dir", str(tmp_path / "plain")]
    assert main(argv) == 0
    assert "AUC is undefined" not in capsys.readouterr().err


def test_a_non_integer_in_an_int64_multi_hot_is_a_bad_row(tmp_path, capsys):
    """`tags: 0|x|3` in an int64 multi_hot: the transform's integer parse failed the run
    (exit 1, 'StringToNumberOp could not correctly convert string: x')."""
    rows = ["1,1.0,1|2,1", "2,2.0,3||4,0", "3,3.0,0|x|3,1", "4,4.0,,0", "5,5.0,-9,1"]
    data = write(tmp_path, rows, header="user,price,tags,click")
    tags = {"name": "tags", "kind": "multi_hot", "dtype": "int64", "dim": 4}
    features = [
        {"name": "user", "kind": "categorical", "dtype": "int64", "dim": 4},
        {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        tags,
    ]
    path = config(tmp_path, {"max_bad_fraction": 0.5}, features=features)
    capsys.readouterr()
    assert main(["train", path, "--quiet"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["bad_records"] == 1 and metrics["examples"] == 4  # line 4, counted once
    from recflow.training.tables import restore_engine

    ids = restore_engine(str(tmp_path / "run")).logical_rows()["tags"].ids
    assert sorted(ids.tolist()) == [-9, 1, 2, 3, 4]  # the bad row's 0 never trained
    fails(capsys, ["train", config(tmp_path, {"on_bad_record": "fail"}, features=features), "--quiet",
                   "--model-dir", str(tmp_path / "strict")],
          f"{data}: line 4: column 'tags': expected int64 ids joined by '|', got '0|x|3'")  # fmt: skip
    capsys.readouterr()
    assert main(["data", "check", path, "--json"]) in (0, 2)
    assert "'0|x|3'" in capsys.readouterr().out
    export = tmp_path / "run" / "export"
    fails(capsys, ["predict", str(export / os.listdir(export)[0]), data],
          f"{data}: line 4: column 'tags' (input 'tags'): expected int64 ids joined by '|', got '0|x|3'")  # fmt: skip


def test_header_without_rows_fails_before_training(tmp_path, capsys):
    data = write(tmp_path, [])
    fails(capsys, ["train", config(tmp_path), "--quiet"], f"{data}: no rows after the header line")
    assert not os.path.exists(tmp_path / "run")


def test_int64_overflow_suggests_string(tmp_path, capsys):
    write(tmp_path, ["10000169349117863715,1.0,0", "2,2.0,1"])
    fails(
        capsys,
        ["train", config(tmp_path), "--quiet"],
        "column 'user': '10000169349117863715' does not fit in int64; use dtype: string",
    )


def test_non_finite_numbers_read_as_missing_and_are_counted(tmp_path, capsys):
    write(tmp_path, ["1,inf,0", "2,-inf,1", "3,1e308,0", "4,nan,1", "5,,0", "6,2.0,1"])
    assert main(["train", config(tmp_path), "--quiet"]) == 0
    assert "non-finite values 4" in capsys.readouterr().out  # the empty one is just missing
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["nonfinite_values"] == 4 and metrics["bad_records"] == 0
    assert math.isfinite(metrics["logloss"])


def test_non_finite_loss_stops_without_export_or_checkpoint(tmp_path, capsys):
    write(tmp_path, ["1,1.0,0.5", "2,2.0,1e30", "3,1.0,2", "4,2.0,1"])
    fails(
        capsys,
        ["train", config(tmp_path, task={"type": "regression"}), "--quiet"],
        "step 1: the loss is inf",
        "label 'click' reaches 1e+30",
    )
    assert no_export(tmp_path)
    assert not tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))


def test_rerun_of_a_finished_dir_trains_and_exports_nothing(tmp_path, capsys):
    write(tmp_path, [f"{i},{i},{i % 2}" for i in range(8)])
    path = config(tmp_path)
    assert main(["train", path, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["train", path, "--quiet"]) == 0
    assert "is already at step 2 (train.epochs=1): nothing to train" in capsys.readouterr().out
    assert os.listdir(tmp_path / "run" / "export") == ["2"]  # export versions are global steps
    # --set train.steps on an epochs config: the steps win, and training goes on
    assert main(["train", path, "--quiet", "--set", "train.steps=3"]) == 0
    assert "step 3" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "run" / "export")) == ["2", "3"]
    # a finished epoch run given one more epoch trains that whole pass (2 steps of 4 rows)
    other = tmp_path / "again"
    assert main(["train", path, "--quiet", "--model-dir", str(other)]) == 0
    assert main(["train", path, "--quiet", "--model-dir", str(other), "--set", "train.epochs=2"]) == 0
    assert "step 4" in capsys.readouterr().out.splitlines()[-2]


def test_large_raw_number_without_normalizer_prints_one_warning(tmp_path, capsys):
    write(tmp_path, [f"{i},{i * 1000},{i % 2}" for i in range(8)])
    path = config(tmp_path)
    raw = yaml.safe_load(Path(path).read_text())
    del raw["features"][1]["normalizer"]
    Path(path).write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert main(["train", path, "--quiet"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "recflow: warning: feature 'price' has no normalizer and values up to 7000; "
        "add `normalizer: {type: auto}` (or log1p / standard)"
    ]


# ----------------------------------------------------------------------------- units


def numeric(normalizer=None, default=None):
    raw = {
        "data": {"format": "csv", "train": "x.csv", "label": "y"},
        "features": [
            {"name": "c", "kind": "categorical"},
            {"name": "x", "kind": "numeric", "normalizer": normalizer, "default": default},
        ],
    }
    return config_from_dict(raw).features[1]


def test_missing_and_non_finite_numbers_take_the_neutral_value():
    raw = tf.constant([np.inf, -np.inf, np.nan, 55.0])
    standard = {"type": "standard", "mean": 35.0, "std": 10.0}
    got = normalize(numeric(standard), raw).numpy().reshape(-1)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, 2.0])  # missing -> the mean, 0 sigma
    got = normalize(numeric(standard, default=15.0), raw).numpy().reshape(-1)
    np.testing.assert_allclose(got, [-2.0, -2.0, -2.0, 2.0])  # an explicit default is raw
    got = normalize(numeric({"type": "log1p"}), raw).numpy().reshape(-1)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, np.log1p(55.0)], rtol=1e-6)
    log_standard = {"type": "standard", "mean": 1.0, "std": 2.0, "log1p": True}
    got = normalize(numeric(log_standard), tf.constant([np.nan, np.e - 1])).numpy().reshape(-1)
    np.testing.assert_allclose(got, [0.0, 0.0], atol=1e-6)  # (log1p(e - 1) - 1) / 2 = 0
    # bucketize: the bucket's index over the number of boundaries, as its docs say
    x = np.array([0.0, 6.0, 11.9, 12.0, 18.0, 23.0, np.nan])
    got = normalize(numeric({"type": "bucketize", "boundaries": [6, 12, 18]}), tf.constant(x, tf.float32))
    np.testing.assert_allclose(got.numpy().reshape(-1), np.digitize(np.nan_to_num(x), [6, 12, 18]) / 3, rtol=1e-6)


def test_multi_hot_rows_are_cut_to_max_values_and_counted():
    raw = {
        "data": {"format": "csv", "train": "x.csv", "label": "y"},
        "features": [{"name": "tags", "kind": "multi_hot", "max_values": 3}],
    }
    feature = config_from_dict(raw).features[0]
    counts: dict = {}
    ids = sparse_ids(feature, tf.constant(["a|b|c|d|e", "a|b", "a|b|c"]), counts)
    assert ids.row_lengths().numpy().tolist() == [3, 2, 3]
    assert int(counts["truncated"]) == 1
    expected = sparse_ids(feature, tf.constant(["a|b|c"]))
    np.testing.assert_array_equal(ids[0].numpy(), expected[0].numpy())  # the first 3 kept


def test_metrics_json_is_strict(tmp_path):
    path = tmp_path / "m.json"
    write_json(str(path), {"auc": float("nan"), "loss": float("inf"), "n": [1.5, float("nan")]})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"auc": None, "loss": None, "n": [1.5, None]}
