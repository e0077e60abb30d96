"""Screens a person reads: the progress bar after a resume, and what set-up steps say."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from conftest import sets, small

from recflow.cli import main
from recflow.training import progress

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "configs" / "deepfm_demo.yaml")
# 20 steps per epoch (2560 rows of 128), no checkpoint but the final one.
SMALL = sets(small({
    "data.synthetic": {"rows": 2560, "eval_rows": 256, "seed": 3, "schema": "demo"},
    "train.checkpoint_every_steps": 1000,
}))


def shown(output: str) -> list[str]:
    """The bar states a terminal shows in turn (Keras redraws with \\b and \\r)."""
    return [s.strip() for s in re.split(r"[\r\n\b]+", output) if s.strip()]


@pytest.mark.parametrize(
    "step, epoch, per_epoch, expected",
    [(30, 1, 20, 10), (20, 1, 20, 0), (0, 0, 20, 0), (45, 1, 20, 20), (7, 0, None, 0)],
)
def test_pass_position(step, epoch, per_epoch, expected):
    assert progress.pass_position(step, epoch, per_epoch) == expected


def test_eta_counts_only_the_steps_run_since_the_resume(monkeypatch, capsys):
    clock = iter([100.0, 101.0, 103.0])  # start, then one step after 1 s, two more after 2 s
    monkeypatch.setattr(time, "time", lambda: next(clock))  # what Keras' bar reads
    bar = progress.Progress(196, done=77)
    bar.update(78, [("loss", 0.5)])
    bar.update(80, [("loss", 0.5)])
    states = shown(capsys.readouterr().out)
    # 1 s per step since the resume, 116 steps to go (Keras' ETA: time per step x steps left);
    # counting the 77 resumed steps as run would say 0 s.
    assert states[-1].startswith("80/196 [") and "ETA: 1:56" in states[-1], states


def test_a_resumed_epoch_ends_at_its_total(tmp_path, capsys):
    model_dir = str(tmp_path / "run")
    # 30 steps: the checkpoint holds epoch 2's input position, 10 steps into it.
    assert main(["train", DEMO, "--model-dir", model_dir, *SMALL, "--set", "train.steps=30"]) == 0
    capsys.readouterr()
    assert main(["train", DEMO, "--model-dir", model_dir, *SMALL, "--set", "train.epochs=2"]) == 0
    out = capsys.readouterr().out
    states = shown(out)
    assert states[0] == f"Restoring {model_dir}/checkpoints/ckpt-30"
    assert states[1] == "Epoch 2/2"
    bars = [s for s in states[2:] if re.match(r"\d+/20 \[", s)]
    counts = [int(s.split("/")[0]) for s in bars]
    assert counts[0] >= 11 and counts[-1] == 20, bars  # without the fix: ... 10/20
    assert bars[-1].startswith("20/20 [==============================]")


def test_fitting_auto_normalizers_is_announced(tmp_path, capsys):
    model_dir = str(tmp_path / "run")
    argv = ["train", DEMO, "--model-dir", model_dir, *SMALL, "--set", "train.steps=2",
            "--set", "features.price.normalizer={type: auto}",
            "--set", "features.age.normalizer={type: auto}", "--set", "data.sample_rows=500"]
    assert main(argv) == 0
    first = shown(capsys.readouterr().out)[0]  # features are sorted by name
    assert first == "Fitting 2 auto normalizers (age, price) on the first 500 rows of data.train"
    assert main([*argv[:-6], "--quiet", "--set", "train.steps=4", *argv[-6:]]) == 0
    assert "step 4  bad_records 0" in capsys.readouterr().out.splitlines()[0]  # quiet; nothing refitted


def test_counting_a_large_csv_for_the_bar_is_announced(tmp_path):
    from types import SimpleNamespace

    from recflow.config import load_config
    from recflow.training.trainer import Trainer

    path = tmp_path / "big.csv"
    rows = 17 * 2**20 // 8  # "1,abcde\n": 8 bytes a row, 17 MiB
    path.write_bytes(b"click,id\n" + b"1,abcde\n" * rows)
    config = load_config(
        DEMO, ["data.format=csv", f"data.train={path}", "data.batch_size=1000"]
    )
    said = []
    trainer = SimpleNamespace(config=config, status=said.append)
    assert Trainer.steps_per_epoch(trainer, [str(path)]) == -(-rows // 1000)
    assert said == ["Counting the rows of " + str(path) + " (17 MiB) for the progress bar"]


def test_a_stream_prints_its_rate_and_lag_at_most_every_interval():
    import io

    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    clock, out, lags = Clock(), io.StringIO(), iter(["3 files, 1.5 MB", None])
    status = progress.StreamStatus(lambda: next(lags), every_seconds=10.0, out=out, clock=clock)
    status.on_train_begin()
    for step, (t, examples) in enumerate([(104.0, 500), (112.0, 1200), (118.0, 1800), (125.0, 2600)], 1):
        clock.now = t
        status.on_train_batch_end(step, {"examples": examples})
    # lines at t=112 (1200 rows in 12 s) and t=125 (1400 rows in the 13 s since)
    assert out.getvalue().splitlines() == [
        "step 2  100 ex/s  lag 3 files, 1.5 MB",
        "step 4  108 ex/s  lag ?",
    ]


def test_follow_lag_is_the_bytes_not_yet_trained(tmp_path):
    from recflow.config import config_from_dict
    from recflow.data.consumed import scan
    from recflow.training import follow as follow_lib

    config = config_from_dict(
        {
            "data": {"format": "csv", "train": str(tmp_path / "*.csv"), "label": "click"},
            "features": [{"name": "user", "kind": "categorical", "dtype": "int64"}],
        }
    )
    done, partly, new = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "c.csv"
    done.write_text("click,user\n1,1\n0,2\n")
    partly.write_text("click,user\n1,3\n")
    state = follow_lib.StreamState()
    state.record(str(done), scan(str(done), "csv", True, None).complete)
    state.record(str(partly), scan(str(partly), "csv", True, None).complete)
    with open(partly, "a") as f:
        f.write("0,4\n1,55\n")  # 9 bytes appended
    new.write_text("click,user\n1,6\n")  # 15 bytes, none trained
    watcher = follow_lib.Watcher(config, state)
    assert watcher.lag() == (2, 9 + 15)
    assert follow_lib._behind(2, 24) == "2 files, 0.0 MB"


def test_kafka_lag_is_high_watermark_minus_trained_offset():
    from recflow.data.kafka import KafkaSource

    source = KafkaSource.__new__(KafkaSource)  # no broker: only the bookkeeping
    source.high = {}
    assert source.lag({("t", 0): 5}) is None
    source.high = {("t", 0): 120, ("t", 1): 40}
    assert source.lag({("t", 0): 100}) == 20 + 40  # partition 1 not trained at all
    assert source.lag({("t", 0): 120, ("t", 1): 40}) == 0
