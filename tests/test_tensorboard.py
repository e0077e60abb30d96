"""TensorBoard shows the run: train loss and rate, each evaluation per head, table health.

One small multi-task run (two heads) with admission and eviction on the `user`
table; its event files are read back with `tf.compat.v1.train.summary_iterator`
and checked against `metrics.json`, `recflow tables --json` and the key sets of
the checkpoints it kept.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import shutil
import struct
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from recflow.cli import main
from recflow.training.tables import restore_engine

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "mmoe.yaml")
EVERY_CHECKPOINT = 6
EVERY_LOG = 4
SETTINGS = [  # the multi-task mmoe config at test size (conftest's SMALL is the demo's)
    "data.synthetic.rows=2560", "data.synthetic.eval_rows=512", "data.batch_size=128",
    "train.epochs=1",  # 20 steps
    f"train.checkpoint_every_steps={EVERY_CHECKPOINT}", f"train.log_every_steps={EVERY_LOG}",
    "train.keep_checkpoints=50",
    "tables.user.admission={min_count: 2}",
    # ttl = the checkpoint interval: a row evicted at a checkpoint was in the previous one,
    # so the kept checkpoints' key sets tell evictions and admissions apart exactly.
    f"tables.user.eviction={{ttl_steps: {EVERY_CHECKPOINT}}}",
    "export.at_end=false",  # the checks read event files, metrics and checkpoints
]


def events(model_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file of MODEL_DIR/logs, in write order."""
    out = collections.defaultdict(list)
    for path in sorted((model_dir / "logs").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                out[value.tag].append((event.step, float(tf.make_ndarray(value.tensor))))
    return dict(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("board") / "run"
    argv = ["train", CONFIG, "--quiet", "--model-dir", str(model_dir)]
    for item in SETTINGS:
        argv += ["--set", item]
    assert main(argv) == 0
    metrics = json.loads((model_dir / "metrics.json").read_text())
    return model_dir, metrics, events(model_dir)


def test_train_loss_and_examples_per_sec_at_every_log_step(run):
    _, metrics, tags = run
    steps = list(range(EVERY_LOG, metrics["steps"] + 1, EVERY_LOG))
    for tag in ("train/loss", "train/examples_per_sec"):
        assert [s for s, _ in tags[tag]] == steps, tag
        assert all(math.isfinite(v) and v > 0 for _, v in tags[tag]), tag


def test_evaluation_metrics_per_head_match_metrics_json(run):
    _, metrics, tags = run
    heads = {"ctr": ("auc", "logloss"), "age": ("mse",)}
    written = {t for t in tags if t.startswith("eval/")}
    assert written == {f"eval/{h}/{m}" for h, names in heads.items() for m in names}
    for tag in written:
        (step, value), = tags[tag]
        assert step == metrics["steps"]
        assert value == pytest.approx(metrics[tag[len("eval/"):]], rel=1e-6, abs=1e-6)


def test_evaluate_command_adds_an_evaluation(run, tmp_path):
    model_dir, metrics, _ = run
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    argv = ["evaluate", CONFIG, "--model-dir", str(copy)]
    for item in SETTINGS:
        argv += ["--set", item]
    assert main(argv) == 0
    after = json.loads((copy / "metrics.json").read_text())
    points = events(copy)["eval/ctr/auc"]
    assert len(points) == 2 and points[-1][0] == metrics["steps"]
    assert points[-1][1] == pytest.approx(after["ctr/auc"], abs=1e-6)


def table_series(tags: dict, table: str, stat: str) -> dict[int, float]:
    return dict(tags[f"tables/{table}/{stat}"])


def test_final_table_stats_match_tables_json(run, capsys):
    model_dir, metrics, tags = run
    capsys.readouterr()
    assert main(["tables", str(model_dir), "--json"]) == 0
    tables = json.loads(capsys.readouterr().out)["tables"]
    assert {t.split("/")[1] for t in tags if t.startswith("tables/")} == set(tables)
    for name, stats in tables.items():
        for stat in ("keys", "waiting_keys", "bytes"):
            assert table_series(tags, name, stat)[metrics["steps"]] == stats[stat], (name, stat)
    assert tables["user"]["waiting_keys"] > 0  # admission is at work


def test_evictions_and_admissions_match_the_checkpoints_key_sets(run):
    model_dir, metrics, tags = run
    checkpoints = model_dir / "checkpoints"
    steps = sorted(int(p.name[5:-6]) for p in checkpoints.glob("ckpt-*.index"))
    assert steps == [*range(EVERY_CHECKPOINT, metrics["steps"] + 1, EVERY_CHECKPOINT), metrics["steps"]]
    ids = {
        step: restore_engine(str(model_dir), str(checkpoints / f"ckpt-{step}")).logical_rows()
        for step in steps
    }
    assert list(table_series(tags, "user", "evictions")) == steps  # one table log per checkpoint
    evicted_any = False
    for name in ("user", "item", "category"):
        evictions = table_series(tags, name, "evictions")
        admissions = table_series(tags, name, "admissions")
        previous: set = set()
        for step in steps:
            now = set(ids[step][name].ids.tolist())
            assert evictions[step] == len(previous - now), (name, step)
            assert admissions[step] == len(now - previous), (name, step)
            evicted_any |= bool(previous - now)
            previous = now
    assert evicted_any  # the check saw evictions, not only zeros


def test_tables_plot_draws_every_checkpoint(run, tmp_path, capsys):
    model_dir, metrics, _ = run
    out = tmp_path / "tables.png"
    capsys.readouterr()
    assert main(["tables", str(model_dir), "--plot", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    count = len(list((model_dir / "checkpoints").glob("ckpt-*.index")))
    assert last == (
        f"{out}: keys and bytes over {count} checkpoint(s), "
        f"steps {EVERY_CHECKPOINT}-{metrics['steps']}"
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 600 and height > 300
    assert not list(tmp_path.glob("*.tmp-*"))


def test_tables_plot_without_matplotlib_is_one_line(run, tmp_path, capsys, monkeypatch):
    model_dir, _, _ = run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "tables.png"
    assert main(["tables", str(model_dir), "--plot", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "recflow: tables --plot needs matplotlib: pip install 'recflow[plot]' (or matplotlib)\n"
    assert not out.exists()


def test_examples_per_sec_counts_rows_over_wall_time(monkeypatch):
    """The rate is the rows trained since the previous log over the time since it."""
    from recflow.training import callbacks

    clock = iter([10.0, 12.0, 13.0])
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    written = []
    monkeypatch.setattr(callbacks.tf.summary, "scalar", lambda tag, value: written.append((tag, value)))

    class Health:
        def start(self):
            pass

    class Train:
        log_every_steps = 5
        checkpoint_every_steps = None

    logger = callbacks.TensorBoardLogger("unused", Health(), Train())

    class Writer:
        def as_default(self, step):
            return contextlib.nullcontext()

    logger._writer = Writer()
    logger.on_train_begin({"examples": 100})  # t = 10, 100 rows trained before this run's first log
    logger.on_train_batch_end(5, {"loss": 0.5, "previous_step": 4, "examples": 700})  # t = 12
    logger.on_train_batch_end(10, {"loss": 0.25, "previous_step": 9, "examples": 1200})  # t = 13
    assert written == [
        ("train/loss", 0.5), ("train/examples_per_sec", 300.0),
        ("train/loss", 0.25), ("train/examples_per_sec", 500.0),
    ]
