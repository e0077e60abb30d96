"""`recflow predict` reads a file as training read it (delimiter, header, columns,
`column:`), and stderr carries only recflow's own lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from recflow.cli import main
from recflow.errors import DataError
from recflow.exporter.predict import predict_file


def _train_and_predict(tmp_path, raw: dict, data: str) -> tuple[str, str, np.ndarray]:
    """Trains `raw` (its model dir `tmp_path/run`); returns (config path, newest export,
    `predict_file`'s scores of `data`)."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert main(["train", str(config), "--quiet"]) == 0
    export = str(tmp_path / "run" / "export" / max(os.listdir(tmp_path / "run" / "export"), key=int))
    return str(config), export, np.array([float(v) for v in predict_file(export, data)])


def _csv_config(tmp_path, lines: list[str], features: list[dict]) -> dict:
    """A tiny DeepFM config on the CSV `lines` (a header line first; label `y`)."""
    data = tmp_path / "d.csv"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        "data": {"format": "csv", "train": str(data), "label": "y", "batch_size": 4, "shuffle": False},
        "features": features,
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(tmp_path / "run"), "steps": 2},
    }


def test_predict_uses_the_training_csv_settings(tmp_path, capsys):
    rows = [f"{i};u{i % 3};{i * 0.5};{i % 2}" for i in range(8)]  # no header, ';'
    data = tmp_path / "d.txt"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    raw = {
        "data": {
            "format": "csv", "train": str(data), "label": "y", "batch_size": 4, "shuffle": False,
            "csv": {"delimiter": ";", "header": False, "columns": ["id", "user", "price", "y"]},
        },
        "features": [
            {"name": "who", "column": "user", "kind": "categorical"},
            {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        ],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(tmp_path / "run"), "steps": 2},
    }  # fmt: skip
    _, export, got = _train_and_predict(tmp_path, raw, str(data))
    serve = tf.saved_model.load(export).signatures["serving_default"]
    expected = serve(
        who=tf.constant([f"u{i % 3}" for i in range(8)]),
        price=tf.constant([i * 0.5 for i in range(8)], tf.float32),
    )["probability"].numpy().reshape(-1)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_stderr_is_clean_when_tensorflow_loads(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("RECFLOW_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "recflow.cli", "data", "synth", "--out", str(tmp_path), "--rows", "5"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_predict_reads_typed_parquet_columns_as_training_did(tmp_path, capsys):
    """A float64 column of a string feature (what pandas writes for ids with a missing
    value) keys its rows by the text a CSV of the rows holds (1005.0 -> "1005", NaN ->
    missing; TF's own text, "1005.000000", was an id no CSV row or REST client sends);
    predict fed str(v) ("1005.0"), an unseen id for every row. A float64 column for an int64 input is
    refused, as training refuses it (it was cut to an integer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recflow.config import load_config
    from recflow.data import make_dataset


    n = 16
    table = pa.table({
        "shop": pa.array([1005.0 + i % 4 if i % 7 else [float("nan"), 0.5, -3.0][i // 7] for i in range(n)],
                         pa.float64()),
        "user": pa.array([i % 5 for i in range(n)], pa.int64()),
        "y": pa.array([float(i % 2) for i in range(n)], pa.float64()),
    })  # fmt: skip
    data = str(tmp_path / "d.parquet")
    pq.write_table(table, data)
    raw = {
        "data": {"format": "parquet", "train": data, "label": "y", "batch_size": 8, "shuffle": False},
        "features": [{"name": "shop", "kind": "categorical"},
                     {"name": "user", "kind": "categorical", "dtype": "int64"}],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": str(tmp_path / "run"), "steps": 2},
    }  # fmt: skip
    config, export, got = _train_and_predict(tmp_path, raw, data)
    # The training reader's own raw columns, fed to the export.
    batches = list(make_dataset(load_config(str(config)), "train", epochs=1, shuffle=False))
    shops = np.concatenate([b[0]["shop"].numpy() for b in batches])
    assert shops.tolist() == [
        {0: b"", 7: b"0.5", 14: b"-3"}.get(i, str(1005 + i % 4).encode()) for i in range(n)
    ]
    serve = tf.saved_model.load(export).signatures["serving_default"]
    expected = serve(shop=tf.constant(shops), user=tf.constant(table["user"].to_numpy()))
    # the printed scores read back as the export's float32 scores, exactly (9 digits, not 6 decimals)
    np.testing.assert_array_equal(got.astype(np.float32), expected["probability"].numpy().reshape(-1))

    floats = table.set_column(1, "user", pa.array([float(i % 5) for i in range(n)], pa.float64()))
    pq.write_table(floats, data)
    with pytest.raises(DataError, match="column 'user' holds float64 values, but input 'user' expects int64"):
        list(predict_file(export, data))


def test_spaces_are_stripped_as_training_strips_them_in_every_path(tmp_path, capsys):
    """Training strips ASCII spaces only (`tf.strings.strip`): predict's `str.strip` also
    took a no-break space off ("a\\u00a0" scored as the trained "a"); and the serving graph
    kept the spaces around a multi_hot's values (" x| y " held the unknown ids " x", " y"
    there, where CSV training had read "x" and " y")."""
    rows = ["item,tags,y"] + [f"{'ab'[i % 2]},{['x| y', 'y |z', 'x'][i % 3]},{i % 2}" for i in range(8)]
    raw = _csv_config(tmp_path, rows, [{"name": "item", "kind": "categorical"},
                                       {"name": "tags", "kind": "multi_hot", "separator": "|"}])
    scored = tmp_path / "s.csv"
    cases = [("a\u00a0", "x"), ("\u3000a", "x"), ("a", " x | y "), ("a", "y|x"), (" a ", "\tx|||y")]
    scored.write_text("item,tags\n" + "".join(f'"{i}","{t}"\n' for i, t in cases), encoding="utf-8")
    _, export, got = _train_and_predict(tmp_path, raw, str(scored))
    serve = tf.saved_model.load(export).signatures["serving_default"]

    def score(item, tags):
        return float(serve(item=tf.constant([item]), tags=tf.constant([tags]))["probability"][0, 0])

    unknown = score("never-seen", "x")
    assert score("a\u00a0", "x") == score("\u3000a", "x") == unknown != score("a", "x")
    assert score("a", " x | y ") == score("a", "y|x") == score("a", "\tx|||y") != score("a", "x")
    np.testing.assert_allclose(got, [unknown, unknown] + [score("a", "x|y")] * 3, atol=1e-6)


def test_predict_reads_long_and_overflowing_numbers_as_training_does(tmp_path, recwarn):
    """A number past TensorFlow's 31 characters reads without its leading zeros and far
    decimals, or is refused, as in training; 1e39 is float32's inf (numpy warned on stderr)."""
    rows = ["item,price,y"] + [f"i{i % 3},{i * 0.5},{i % 2}" for i in range(8)]
    raw = _csv_config(tmp_path, rows, [{"name": "item", "kind": "categorical"},
                                       {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}}])
    scored = tmp_path / "s.csv"
    values = ["0.25", "000000000000000000000000000000.25" + "0" * 20, "1e39", "", "3"]
    scored.write_text("item,price\n" + "".join(f"i1,{v}\n" for v in values), encoding="utf-8")
    _, export, got = _train_and_predict(tmp_path, raw, str(scored))
    assert got[0] == got[1] and got[2] == got[3] != got[4]  # 1e39: non-finite, read as missing
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    scored.write_text(f"item,price\ni1,{'1' * 32}\n", encoding="utf-8")
    with pytest.raises(DataError, match="expected a number of at most 31 characters"):
        list(predict_file(export, str(scored)))
