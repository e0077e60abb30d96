"""The evaluation's report: the metrics an `Evaluator` computes over a split, and what
`recflow evaluate` / `recflow train` write to metrics.json and print.

Most checks run an `Evaluator` on a model that predicts one constant for every row, so
each metric follows from the hand-written CSV rows by numpy; the CLI checks train a
model of a few rows for a step or two.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from recflow.config import config_from_dict
from recflow.models.heads import heads_for
from recflow.training.evaluator import Evaluator

FEATURES = [
    {"name": "user", "kind": "categorical", "dtype": "int64", "dim": 4},
    {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
]


def write_csv(path: Path, rows: list[str], header: str = "user,price,rating") -> str:
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return str(path)


def make_config(tmp_path: Path, eval_file: str, task: dict | None = None, data: dict | None = None):
    return config_from_dict(
        {
            "data": {
                "format": "csv",
                "train": eval_file,
                "eval": eval_file,
                "label": "rating",
                "batch_size": 4,
                **(data or {}),
            },
            "features": FEATURES,
            "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
            "task": task or {"type": "regression", "metrics": ["mse", "mae", "rmse"]},
            "train": {"model_dir": str(tmp_path / "run"), "epochs": 1},
        }
    )


class ConstantModel:
    """Predicts `value` for every row, under each head's output: the metrics of a split
    are then numpy functions of its labels alone."""

    def __init__(self, config, value: float):
        self.heads = heads_for(config)
        self.value = value

    def __call__(self, features, training=False):
        rows = tf.shape(features["user"])[0]
        return {h.output: tf.fill([rows, 1], tf.constant(self.value, tf.float32)) for h in self.heads}


# ----------------------------------------------------------------------------- precision


def test_small_metrics_keep_their_digits(tmp_path):
    """Ratings / 10000 predicted as 0: the mse is about 1e-8; rounded to 6 decimal places it
    was stored as 0.0 (and an mse of 4.04e-05 as 4e-05)."""
    y = np.array([1, 3, 4, 5, 2, 4], np.float32) / 10000
    rows = [f"{i},{i}.5,{v!r}" for i, v in enumerate(y.tolist())]
    config = make_config(tmp_path, write_csv(tmp_path / "eval.csv", rows))
    result = Evaluator(config, ConstantModel(config, 0.0)).evaluate()
    mse = float(np.mean(y.astype(np.float64) ** 2))  # about 1.18e-07
    assert result["mse"] == pytest.approx(mse, rel=1e-6)
    assert result["mae"] == pytest.approx(float(np.mean(y)), rel=1e-6)
    assert result["rmse"] == pytest.approx(mse**0.5, rel=1e-6)


def test_the_summary_prints_small_values_with_four_significant_digits():
    from recflow.cli import _number

    assert _number(4.04228e-05) == "4.042e-05"
    assert _number(0.0012345) == "0.001234"
    assert _number(0.5) == "0.5000" and _number(0.0) == "0.0000" and _number(12.0) == "12.0000"
    assert _number(float("nan")) == "n/a" and _number(None) == "n/a"


# ----------------------------------------------------------------------------- the summary line


def test_the_summary_prints_a_custom_heads_metrics(tmp_path, monkeypatch):
    """The docs' PoissonHead: `poisson_nll` and `mae` are in metrics.json; the summary line
    printed only built-in names, so it showed `mae` but not `poisson_nll`."""
    from recflow.cli import _format_metrics

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "extensions"))
    y = np.array([0, 1, 3, 2, 0, 1], np.float64)
    rows = [f"{i},{i}.5,{v:g}" for i, v in enumerate(y)]
    task = {"type": "my_extensions:PoissonHead", "metrics": ["poisson_nll", "mae"]}
    config = make_config(tmp_path, write_csv(tmp_path / "eval.csv", rows), task)
    result = Evaluator(config, ConstantModel(config, 2.0)).evaluate()
    nll, mae = np.mean(2.0 - y * np.log(2.0)), np.mean(np.abs(2.0 - y))  # 2 - 7/6 ln 2, 7/6
    assert result["eval_metrics"] == ["poisson_nll", "mae"]
    assert result["poisson_nll"] == pytest.approx(nll, rel=1e-6) and result["mae"] == pytest.approx(mae)
    line = _format_metrics({**result, "steps": 3, "bad_records": 0})
    assert line.startswith(f"poisson_nll {nll:.4f}  mae {mae:.4f}  step 3  bad_records 0"), line


# ----------------------------------------------------------------------------- recflow evaluate


def write_run_config(tmp_path: Path, train: str, eval_file: str | None = None, **task) -> str:
    import yaml

    data = {"format": "csv", "train": train, "label": "click", "batch_size": 4, "shuffle": False}
    if eval_file:
        data["eval"] = eval_file
    raw = {
        "version": 1,
        "data": data,
        "features": FEATURES,
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "task": {"type": "binary", **task},
        "train": {"model_dir": str(tmp_path / "run"), "epochs": 1, "checkpoint_every_steps": None},
        "export": {"at_end": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return str(path)


def read_metrics(tmp_path: Path) -> dict:
    import json

    return json.loads((tmp_path / "run" / "metrics.json").read_text(encoding="utf-8"))


def test_an_evaluation_replaces_the_previous_ones_metrics(tmp_path, capsys):
    """Trained with [auc, logloss], evaluated with [accuracy] on another file: metrics.json
    showed accuracy beside the training's auc and logloss, under the new eval_split."""
    from recflow.cli import main

    header = "user,price,click"
    train = write_csv(tmp_path / "train.csv", [f"{i},{i}.5,{i % 2}" for i in range(8)], header)
    other = write_csv(tmp_path / "other.csv", [f"{i},{i}.5,{i % 3 == 0:d}" for i in range(5)], header)
    path = write_run_config(tmp_path, train, metrics=["auc", "logloss"])
    assert main(["train", path, "--quiet"]) == 0
    trained = read_metrics(tmp_path)
    assert {"auc", "logloss"} <= set(trained) and trained["eval_split"] == "train"
    argv = ["evaluate", path, "--set", f"data.eval={other}", "--set", "task.metrics=[accuracy]"]
    assert main(argv) == 0
    metrics = read_metrics(tmp_path)
    assert "auc" not in metrics and "logloss" not in metrics
    assert metrics["eval_metrics"] == ["accuracy"] and metrics["accuracy"] in {k / 5 for k in range(6)}
    assert metrics["eval_split"] == "eval" and metrics["eval_examples"] == 5
    # The fields that are not the evaluation's stay: 8 rows trained in 2 steps of 4.
    assert metrics["steps"] == 2 and metrics["examples"] == 8 and metrics["bad_records"] == 0
    assert metrics["timing"] == trained["timing"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("accuracy ")


# ----------------------------------------------------------------------------- bad rows


def test_the_evaluations_bad_rows_are_counted_and_checked(tmp_path):
    """Rows 1 and 4 have rating 'NA': the evaluation dropped them without counting them,
    and never held them against data.max_bad_fraction."""
    y = np.array([3, 0, 4, 5, 0, 2], np.float64)
    rows = [f"{i},{i}.5,{'NA' if i in (1, 4) else f'{v:g}'}" for i, v in enumerate(y)]
    data = write_csv(tmp_path / "eval.csv", rows)
    allowed = make_config(tmp_path, data, data={"max_bad_fraction": 0.5})
    result = Evaluator(allowed, ConstantModel(allowed, 1.0)).evaluate()
    good = y[[0, 2, 3, 5]]
    assert result["eval_bad_records"] == 2 and result["eval_examples"] == 4
    assert result["mse"] == pytest.approx(np.mean((good - 1.0) ** 2))  # (4 + 9 + 16 + 1) / 4

    from recflow.errors import DataError

    config = make_config(tmp_path, data)  # max_bad_fraction 0.01
    with pytest.raises(DataError) as e:
        Evaluator(config, ConstantModel(config, 1.0)).evaluate()
    message = str(e.value)
    assert message.startswith(
        "data.eval: 2 of 6 rows read by the evaluation are bad (33.3%, above data.max_bad_fraction 0.01)"
    ), message
    assert f"first: {data}: line 3: label 'rating'" in message and "'NA'" in message  # row 1, after the header


def test_train_fails_at_an_evaluation_with_too_many_bad_rows(tmp_path, capsys):
    """`recflow train` with an eval file of 2 bad rows in 4 exited 0 and exported; now it
    exits 2 once the evaluation has run, saying that training finished and was saved.
    Below the limit, the summary line and metrics.json give the evaluation's bad rows."""
    from recflow.cli import main

    header = "user,price,click"
    train = write_csv(tmp_path / "train.csv", [f"{i},{i}.5,{i % 2}" for i in range(8)], header)
    eval_file = write_csv(tmp_path / "eval.csv", ["1,1.5,1", "2,x,0", "3,3.5,0", "4,y,1"], header)
    path = write_run_config(tmp_path, train, eval_file)
    capsys.readouterr()
    assert main(["train", path, "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "recflow: data.eval: 2 of 4 rows read by the evaluation are bad (50.0%, above data.max_bad_fraction 0.01); "
        f"first: {eval_file}: line 3: column 'price'"
    ), err
    assert err[0].endswith(
        "Training itself finished (checkpoint of step 2 saved); metrics.json is not written: "
        "rerun once the evaluation's data is fixed"
    ), err
    assert not (tmp_path / "run" / "metrics.json").exists()
    assert (tmp_path / "run" / "checkpoints").is_dir()

    # The same run allowing half the rows bad: the rerun evaluates the saved checkpoint.
    assert main(["train", path, "--quiet", "--set", "data.max_bad_fraction=0.5"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("step 2  bad_records 0  eval_bad_records 2")
    metrics = read_metrics(tmp_path)
    assert (metrics["bad_records"], metrics["eval_bad_records"], metrics["eval_examples"]) == (0, 2, 2)
    assert main(["evaluate", path, "--set", "data.max_bad_fraction=0.5"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("step 2  eval_bad_records 2")
    assert read_metrics(tmp_path)["eval_bad_records"] == 2


# ----------------------------------------------------------------------------- default metrics


def test_a_regression_task_reports_mse_by_default(tmp_path):
    """docs/configuration.md said regression reports mse, mae and rmse; without
    task.metrics it computes mse only (RegressionHead.default_metrics), as the docs now say."""
    y = np.array([1, 2, 4, 5], np.float64)
    rows = [f"{i},{i}.5,{v:g}" for i, v in enumerate(y)]
    config = make_config(tmp_path, write_csv(tmp_path / "eval.csv", rows), {"type": "regression"})
    result = Evaluator(config, ConstantModel(config, 3.0)).evaluate()
    assert result["eval_metrics"] == ["mse"] and "mae" not in result and "rmse" not in result
    assert result["mse"] == pytest.approx((4 + 1 + 1 + 4) / 4)


def test_a_head_left_without_metrics_is_named_in_a_warning(tmp_path, caplog):
    """A multi-task model with `task.metrics: [auc]`: the regression head computes none of
    them and reported nothing, silently."""
    rows = [f"{i},{i}.5,{i % 2},{i + 1}" for i in range(6)]
    data = write_csv(tmp_path / "eval.csv", rows, "user,price,click,rating")
    tasks = [{"name": "ctr", "label": "click"}, {"name": "stars", "label": "rating", "type": "regression"}]
    raw = {
        "data": {"format": "csv", "train": data, "eval": data, "batch_size": 4},
        "features": FEATURES,
        "model": {"type": "mmoe", "params": {"num_experts": 2, "expert_units": [4], "tower": {"hidden_units": [4]}}},
        "task": {"type": "multitask", "metrics": ["auc"], "tasks": tasks},
        "train": {"model_dir": str(tmp_path / "run"), "epochs": 1},
    }
    config = config_from_dict(raw)
    with caplog.at_level("WARNING", logger="recflow.training.evaluator"):
        result = Evaluator(config, ConstantModel(config, 0.5)).evaluate()
    assert result["eval_metrics"] == ["ctr/auc"] and result["ctr/auc"] == 0.5  # every score tied
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "task.metrics ['auc']: task 'stars' computes none of them, so it reports no metric "
        "(its metrics: mae, mse, rmse)"
    ], warnings
    raw["task"]["metrics"] = ["auc", "mse"]  # each head computes one: no warning
    caplog.clear()
    config = config_from_dict(raw)
    with caplog.at_level("WARNING", logger="recflow.training.evaluator"):
        result = Evaluator(config, ConstantModel(config, 0.5)).evaluate()
    assert result["stars/mse"] == pytest.approx(np.mean((np.arange(1, 7) - 0.5) ** 2)) and not caplog.records
