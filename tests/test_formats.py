"""`recflow data synth` in each format, then training from those files by config alone."""

import json

import pytest

from recflow.cli import main


@pytest.mark.parametrize("fmt", ["csv", "tfrecord", "parquet"])
def test_synth_then_train_from_files(fmt, tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["data", "synth", "--out", str(data), "--rows", "600", "--format", fmt]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(data / f"train.{fmt}"), str(data / f"eval.{fmt}")]
    model_dir = tmp_path / "run"
    args = ["train", "configs/deepfm_demo.yaml", "--quiet", "--model-dir", str(model_dir)]
    for item in (
        f"data.format={fmt}",
        f"data.train={data}/train.{fmt}",
        f"data.eval={data}/eval.{fmt}",
        "data.batch_size=128",
        "train.epochs=1",
        "model.params={dnn: {hidden_units: [8]}}",
        "export.at_end=false",  # the check is what was read and trained
    ):
        args += ["--set", item]
    assert main(args) == 0
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["steps"] == 5  # ceil(600 / 128)
    assert metrics["examples"] == 600
    assert metrics["eval_examples"] == 120
    assert metrics["bad_records"] == 0
