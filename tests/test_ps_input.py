"""Input semantics of parameter-server training on a real loopback cluster (`recflow launch`).

- 2 workers, 2 epochs over 4 CSV files: each epoch reads every row once and trains it once.
- A worker killed mid-epoch: at-least-once; the rows trained twice are counted
  (`examples_applied - examples`) and stay within one chunk per kill; none are lost.
- A chief restarted from a checkpoint (a killed PS restarts it): exact; the
  restarted chief trains exactly the rows the checkpoint's split state has not.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import procs
import pytest
from conftest import items, small
from test_ps_cluster import pid_of, wait_for  # pytest puts tests/ on sys.path

from recflow.data import split_positions
from recflow.distribute.splits import FINISHED, Split, SplitState

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
BATCH = 64
# The demo's input semantics are counted in metrics.json; no test here reads an export.
COMMON = items(small({"data.batch_size": BATCH}))


def launch(model_dir, settings, ps=1, workers=2):
    command = [sys.executable, "-m", "recflow.cli", "launch", "configs/deepfm_demo.yaml",
               "--ps", str(ps), "--workers", str(workers), "--model-dir", str(model_dir)]
    for item in COMMON + settings:
        command += ["--set", item]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(launcher, model_dir):
    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    return json.loads((model_dir / "metrics.json").read_text()), err


@pytest.fixture(scope="module")
def csv_files(tmp_path_factory):
    """4 CSV files of the demo schema, of 1000, 900, 1100 and 1000 rows, and an eval file."""
    root = tmp_path_factory.mktemp("csv")
    procs.run([sys.executable, "-m", "recflow.cli", "data", "synth", "--out", str(root),
               "--rows", "4000"], env=ENV, check=True, capture_output=True)
    lines = (root / "train.csv").read_text().splitlines()
    header, rows = lines[0], lines[1:]
    sizes = [1000, 900, 1100, 1000]
    assert len(rows) == sum(sizes)
    files, at = [], 0
    for i, size in enumerate(sizes):
        path = root / f"part-{i}.csv"
        path.write_text("\n".join([header] + rows[at : at + size]) + "\n")
        files.append(path)
        at += size
    return root, sizes


def test_two_workers_read_and_train_each_row_once(tmp_path, csv_files):
    root, sizes = csv_files
    model_dir = tmp_path / "files"
    launcher = launch(model_dir, [
        "data.format=csv", f"data.train={root}/part-*.csv", f"data.eval={root}/eval.csv",
        "train.checkpoint_every_steps=20", "train.epochs=2",
    ])
    metrics, _ = finish(launcher, model_dir)
    rows = sum(sizes)
    print(f"\n2 epochs of {rows} rows: examples_read {metrics['examples_read']}, examples "
          f"{metrics['examples']}, examples_applied {metrics['examples_applied']}, steps {metrics['steps']}")
    assert metrics["examples_read"] <= 2 * 1.05 * rows
    assert abs(metrics["examples"] - 2 * rows) < BATCH
    assert metrics["examples"] == metrics["examples_applied"] == 2 * rows  # no failure: each row once
    # One step per batch of each file (a file's last batch is smaller), none twice.
    assert metrics["steps"] == 2 * sum(-(-n // BATCH) for n in sizes)
    # Checkpoints fire at the first wave end at or after each multiple of 20 steps.
    saved = sorted(int(p.name[5:-6]) for p in (model_dir / "checkpoints").glob("ckpt-*.index"))
    assert saved[-1] == metrics["steps"]


def test_parquet_files_train_on_a_worker(tmp_path):
    """A worker's server runs the Parquet reader's kernels (tensorflow-io's op library,
    which it loads without importing tensorflow_io): each row is trained once."""
    root = tmp_path / "pq"
    procs.run([sys.executable, "-m", "recflow.cli", "data", "synth", "--out", str(root),
               "--rows", "1000", "--format", "parquet"], env=ENV, check=True, capture_output=True)
    model_dir = tmp_path / "parquet"
    launcher = launch(model_dir, [
        "data.format=parquet", f"data.train={root}/train.parquet", f"data.eval={root}/eval.parquet",
        "train.checkpoint_every_steps=null",
    ], workers=1)
    metrics, _ = finish(launcher, model_dir)
    assert metrics["examples"] == metrics["examples_applied"] == 1000
    assert metrics["steps"] == -(-1000 // BATCH)


def _positions(checkpoint_prefix):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(checkpoint_prefix))
    raw = reader.get_tensor("splits/positions/.ATTRIBUTES/VARIABLE_VALUE")
    return json.loads(raw.decode())["positions"]


def test_worker_kill_is_at_least_once_and_chief_restart_is_exact(tmp_path):
    rows, every, workers = 8000, 25, 2  # 125 batches: 2 splits, of 62 and 63
    model_dir = tmp_path / "kills"
    launcher = launch(model_dir, [
        f"data.synthetic={{rows: {rows}, eval_rows: 500, seed: 11, schema: demo}}",
        f"train.checkpoint_every_steps={every}",
    ], ps=2, workers=workers)
    checkpoints = model_dir / "checkpoints"

    # Chunks run between checkpoints: kill a worker halfway into the time `every` steps take.
    wait_for(checkpoints / f"ckpt-{every}.index", launcher)
    wait_for(checkpoints / f"ckpt-{2 * every}.index", launcher)
    took = (checkpoints / f"ckpt-{2 * every}.index").stat().st_mtime - (
        checkpoints / f"ckpt-{every}.index").stat().st_mtime
    time.sleep(took / 2)
    os.kill(pid_of(model_dir, "worker", 1), signal.SIGKILL)  # its chunk reruns on worker 0

    # The chief restarts from the newest checkpoint when a PS dies.
    wait_for(checkpoints / f"ckpt-{4 * every}.index", launcher)
    os.kill(pid_of(model_dir, "ps", 1), signal.SIGKILL)
    # The restarted chief resumes from the newest checkpoint written before the kill.
    resumed_at = max(int(p.name[5:-6]) for p in checkpoints.glob("ckpt-*.index"))
    metrics, err = finish(launcher, model_dir)
    assert "worker-1 exited" in err and "ps-1 exited" in err

    steps_expected = sum(-(-n // BATCH) for n in _split_rows(rows, workers))
    positions = _positions(checkpoints / f"ckpt-{resumed_at}")
    done_rows = sum(
        n if p == -1 else min(p * BATCH, n) for p, n in zip(positions, _split_rows(rows, workers))
    )
    # The restarted chief (the metrics are its own) trained exactly the rest, each row once.
    lost = rows - (done_rows + metrics["examples"])
    after_restart_duplicates = metrics["examples_applied"] - metrics["examples"]
    # Every step that ran before the checkpoint is in its global step: the steps beyond one
    # per batch are the batches the killed worker's chunk trained twice.
    duplicate_steps = metrics["steps"] - steps_expected
    # The declared bound: one chunk, at most a split and at most the hook interval.
    bound = min(max(-(-n // BATCH) for n in _split_rows(rows, workers)), every)
    print(f"\nworker kill: {duplicate_steps} batches ({duplicate_steps * BATCH} rows) trained twice, "
          f"bound {bound} batches ({bound * BATCH} rows); "
          f"chief restart from step {resumed_at}: {lost} rows lost, {after_restart_duplicates} twice")
    assert lost == 0 and after_restart_duplicates == 0
    assert 0 <= duplicate_steps <= bound  # at most one chunk per killed worker
    assert metrics["examples_read"] == metrics["examples"]


def _split_rows(rows, workers):
    """Rows per synthetic split, worked out like `make_splits`: ranges of whole batches, up to
    4 per worker, of 256 batches or more, at least one per worker."""
    batches = -(-rows // BATCH)
    count = min(batches, max(workers, min(4 * workers, batches // 256)))
    bounds = [min(rows, (batches * i // count) * BATCH) for i in range(count + 1)]
    return list(np.diff(bounds))


def test_prefetch_trains_one_worker_exactly_as_without(tmp_path, csv_files):
    """`train.prefetch_embeddings` on a real PS: one worker's steps are sequential, so the
    model (its eval metrics) must be the one trained without prefetching. Two of the files:
    their steps cross a file's end."""
    root, sizes = csv_files
    runs = {}
    for prefetch in ("false", "true"):
        model_dir = tmp_path / f"prefetch_{prefetch}"
        launcher = launch(model_dir, [
            "data.format=csv", f"data.train={root}/part-[01].csv", f"data.eval={root}/eval.csv",
            "train.checkpoint_every_steps=null", f"train.prefetch_embeddings={prefetch}",
            "train.evaluate=true",
        ], workers=1)
        runs[prefetch], _ = finish(launcher, model_dir)
    without, with_prefetch = runs["false"], runs["true"]
    print(f"\nauc without / with prefetch: {without['auc']:.6f} / {with_prefetch['auc']:.6f}")
    assert with_prefetch["examples"] == without["examples"] == sizes[0] + sizes[1]
    assert with_prefetch["steps"] == without["steps"]
    for metric in ("auc", "logloss"):
        assert with_prefetch[metric] == pytest.approx(without[metric], abs=1e-5)


@pytest.mark.parametrize(
    "rows,batch,workers,want",
    [
        (100_000, 512, 1, [196]),  # 196 batches: one split (a chunk start is worth ~15 steps)
        (100_000, 512, 2, [98, 98]),  # fewer than 256 per split, but one per worker
        (300_000, 512, 1, [293, 293]),  # 586 batches: 2 splits of 256 or more
        (10_000_000, 512, 4, [1220] * 4 + [1221] * 12),  # 19,532 batches: the cap, 4 per worker
        (100, 64, 4, [1, 1]),  # 2 batches for 4 workers: one each, 2 workers idle
    ],
)
def test_synthetic_splits_hold_enough_batches_to_pay_for_their_start(rows, batch, workers, want):
    from recflow.config import load_config
    from recflow.distribute.splits import make_splits

    config = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "deepfm_demo.yaml"), [
        f"data.synthetic={{rows: {rows}, eval_rows: 10, seed: 1, schema: demo}}",
        f"data.batch_size={batch}",
    ])
    splits = make_splits(config, workers)
    batches = [-(-(s.stop - s.start) // batch) for s in splits]
    assert sorted(batches) == sorted(want)
    # Contiguous whole batches covering every row once.
    assert splits[0].start == 0 and splits[-1].stop == rows
    assert all(a.stop == b.start and a.stop % batch == 0 for a, b in zip(splits, splits[1:]))


def test_a_restored_split_state_goes_on_by_split_name():
    """Positions follow their file: one added between runs is read from its start, one
    whose place in the list moved keeps its own position, never another file's."""
    data = _demo_data()
    saved = SplitState([Split(0, file="a.csv"), Split(1, file="b.csv")], data)
    saved.write([5, FINISHED])
    now = SplitState([Split(0, file="a.csv"), Split(1, file="new.csv"), Split(2, file="b.csv")], data)
    now.positions.assign(saved.positions)  # what a restore does
    assert now.read() == [5, 0, FINISHED]
    # A state written before it named its splits: kept at the same split count only.
    now.positions.assign(json.dumps([7, 2, 1]))
    assert now.read() == [7, 2, 1]
    now.positions.assign(json.dumps([7, 2]))
    assert now.read() == [0, 0, 0]


def test_a_split_record_says_whether_its_epoch_is_under_way():
    """What a local run resuming a PS checkpoint asks: was any split read (a finished one
    counts), in the current form of the record and the bare list before it."""
    data = _demo_data()
    state = SplitState([Split(0, file="a.csv"), Split(1, file="b.csv")], data)
    assert not split_positions.started(state.positions.numpy())
    for positions in ([3, 0], [0, FINISHED]):
        state.write(positions)
        assert split_positions.started(state.positions.numpy())
    assert split_positions.started(json.dumps([0, 4])) and not split_positions.started("[0, 0]")


@pytest.mark.parametrize(
    "change,want",
    [
        ({}, [6, 0, FINISHED]),
        ({"batch_size": 128}, [3, 0, FINISHED]),  # 384 rows read: 3 batches of 128
        ({"batch_size": 100}, [3, 0, FINISHED]),  # rows 300-383 are read again
        ({"batch_size": 32}, [12, 0, FINISHED]),
        ({"seed": 2}, [0, 0, FINISHED]),  # another record order: started over
        ({"shuffle_buffer": 1024}, [0, 0, FINISHED]),
    ],
)
def test_a_split_read_part_way_goes_on_from_its_first_unread_row(change, want):
    """A file split's position counts batches of its shuffled records. With another batch
    size the same records come in other cuts: it goes on from the batch holding its first
    unread record; with another record order (seed, shuffle buffer) it starts over."""
    splits = [Split(i, file=f) for i, f in enumerate(["a.csv", "b.csv", "c.csv"])]
    saved = SplitState(splits, _demo_data(batch_size=64))
    saved.write([6, 0, FINISHED])
    now = SplitState(splits, _demo_data(**{"batch_size": 64, **change}))
    now.positions.assign(saved.positions)
    assert now.read() == want


def _demo_data(**data):
    from recflow.config import load_config

    config = os.path.join(os.path.dirname(__file__), "..", "configs", "deepfm_demo.yaml")
    return load_config(config, [f"data.{k}={v}" for k, v in data.items()]).data


def test_a_wave_gives_every_worker_a_chunk_and_stops_at_the_next_hook():
    """Synthetic waves: the steps to the next hook, shared out over at least one split per
    worker (a wave with one chunk would leave the other workers idle)."""
    from recflow.config import load_config
    from recflow.distribute import splits as splits_lib
    from recflow.distribute.ps_runner import PSRunner

    config = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "deepfm_demo.yaml"), [
        "data.synthetic={rows: 32000, eval_rows: 10, seed: 1, schema: demo}", "data.batch_size=64",
    ])
    runner = PSRunner.__new__(PSRunner)  # only the planning state, no cluster
    runner.config, runner.splits_lib, runner.workers = config, splits_lib, 2
    runner.splits = splits_lib.make_splits(config, 2)  # 500 batches: 2 splits of 250

    def plan(order, positions, step, boundary):
        return [(s.index, n) for s, n in runner._plan(order, positions, step, boundary, None)]

    assert plan([0, 1], [0, 0], 0, 100) == [(0, 50), (1, 50)]
    assert plan([1, 0], [240, 30], 270, 300) == [(1, 20), (0, 10)]  # split 0 has 10 left
    assert plan([0, 1], [0, 0], 0, 7) == [(0, 4), (1, 3)]
    assert plan([0, 1], [240, 30], 270, None) == [(0, 10), (1, 220)]  # no hook: to the ends
