"""Every `examples/` config trains on its public sample in ../shared/data, and
`recflow predict` scores the sample with the export.

The samples live beside the repository (CI has them there too); they are not
copied into it: the data sets' licences restrict redistribution.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from recflow.cli import main
from recflow.config import load_config
from recflow.exporter.predict import predict_file

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
needs_samples = pytest.mark.skipif(not SHARED.is_dir(), reason=f"no sample data at {SHARED}")

EXAMPLES = {  # config -> (sample file, outputs of the export)
    "criteo.yaml": ("criteo_sample.txt", ["probability"]),
    "avazu.yaml": ("avazu_sample.txt", ["probability"]),
    "movielens_regression.yaml": ("movielens_sample.txt", ["prediction"]),
    "movielens_binary.yaml": ("movielens_sample.txt", ["probability"]),
    "census.yaml": ("census-income.sample", ["income", "marital"]),
}


STREAM_EXAMPLES = ("kafka_stream.yaml",)  # trained from a broker by tests/test_kafka.py


def test_every_example_is_listed():
    assert sorted(os.listdir(ROOT / "examples")) == sorted([*EXAMPLES, *STREAM_EXAMPLES])


def sample_rows(path: Path, header: bool) -> int:
    with open(path, newline="", encoding="utf-8") as f:
        return sum(1 for row in csv.reader(f) if row) - (1 if header else 0)


@needs_samples
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_on_its_sample_and_predicts(tmp_path, capsys, name):
    sample, outputs = EXAMPLES[name]
    data = SHARED / sample
    config = str(ROOT / "examples" / name)
    model_dir = tmp_path / "run"
    argv = ["train", config, "--set", f"data.train={data}", "--model-dir", str(model_dir)]
    assert main([*argv, "--quiet", "--set", "train.epochs=1"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().err == ""  # no warning, no TensorFlow noise
    metrics = json.loads((model_dir / "metrics.json").read_text())
    header = load_config(config, [f"data.train={data}"]).data.csv.header
    rows = sample_rows(data, header)
    assert metrics["bad_records"] == 0 and metrics["examples"] == rows

    resolved = yaml.safe_load((model_dir / "config.yaml").read_text())
    exported = yaml.safe_load(
        (model_dir / "export" / max(os.listdir(model_dir / "export"), key=int) / "assets.extra" / "recflow_config.yaml").read_text()
    )
    assert exported["features"] == resolved["features"]
    for feature in resolved["features"]:  # `auto` is stored fitted, never as `auto`
        assert (feature.get("normalizer") or {}).get("type") != "auto"

    lines = list(predict_file(str(model_dir / "export" / max(os.listdir(model_dir / "export"), key=int)), str(data)))
    if len(outputs) > 1:
        assert lines.pop(0) == ",".join(outputs)
    values = np.array([[float(v) for v in line.split(",")] for line in lines])
    assert values.shape == (rows, len(outputs))
    assert np.isfinite(values).all()
    if outputs[0] != "prediction":
        assert ((values > 0) & (values < 1)).all()


@needs_samples
def test_example_without_data_train_says_how_to_set_it(capsys):
    assert main(["train", str(ROOT / "examples" / "criteo.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recflow: ") and "data.train" in err and "--set data.train=" in err
