"""The model dir under production faults, through the CLI: a kill after the last
checkpoint (deltas and exports ahead of it), damaged checkpoints, a second
writer, a full disk, a vanished input file, a launcher killed with -9."""

import contextlib
import errno
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from recflow.cli import main
from recflow.data.writer import write_synthetic
from recflow.training import checkpoints
from recflow.training.trainer import Trainer

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
SCRIPTS = Path(__file__).parent / "scripts"
CONFIG = "configs/deepfm_demo.yaml"
BATCH = 32


def train_argv(model_dir, *sets, steps=30, export=False):
    """`recflow train` of the demo; the run ends without its evaluation, and without its
    export unless `export`."""
    settings = [
        f"export.at_end={str(export).lower()}",
        "train.evaluate=false",
        "data.synthetic={rows: 3000, eval_rows: 100, seed: 5, schema: demo}",
        f"data.batch_size={BATCH}",
        "train.epochs=null",
        f"train.steps={steps}",
        "model.params={dnn: {hidden_units: [8]}}",
        f"train.model_dir={model_dir}",
        *sets,
    ]
    return ["train", CONFIG, "--quiet"] + [a for s in settings for a in ("--set", s)]


def run_ok(capsys, argv):
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return out, err


def run_error(capsys, argv, *fragments):
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("recflow")]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def delta_rows(path):
    """{table: {key: row}} of one delta dir."""
    out = {}
    for npz in glob.glob(os.path.join(path, "*.npz")):
        with np.load(npz) as f:
            out[os.path.basename(npz)] = dict(zip(f["keys"].tolist(), f["values"]))
    return out


def assert_same_delta(a, b):
    ra, rb = delta_rows(a), delta_rows(b)
    assert ra.keys() == rb.keys()
    for table in ra:
        assert ra[table].keys() == rb[table].keys(), table
        for key, row in ra[table].items():
            np.testing.assert_allclose(row, rb[table][key], rtol=1e-5, atol=1e-6)


def temps(model_dir):
    return [p for p in glob.glob(f"{model_dir}/**/*", recursive=True)
            if "_temp" in os.path.basename(p) or ".tmp-" in os.path.basename(p)] + \
        glob.glob(f"{model_dir}/**/.tmp-*", recursive=True)


# ----------------------------------------------------------------------------- kill after a checkpoint


HOOKS = ("train.checkpoint_every_steps=20", "export.delta_every_steps=5", "export.every_steps=10")


def test_resume_behind_deltas_and_exports_rewrites_them(tmp_path, capsys):
    """Deltas 25 and 30 and export 30 exist, the last checkpoint is 20 (a kill -9)."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_ok(capsys, train_argv(whole, *HOOKS, export=True))
    run_ok(capsys, train_argv(cut, *HOOKS, export=True))
    for path in glob.glob(f"{cut}/checkpoints/ckpt-30.*"):  # back to the state of a kill at 30
        os.remove(path)
    (cut / "checkpoints" / "ckpt-30_temp").mkdir()
    (cut / "deltas" / ".tmp-killed").mkdir()
    first_25 = delta_rows(cut / "deltas" / "25")

    run_ok(capsys, train_argv(cut, *HOOKS, export=True))
    stale = cut / "deltas" / ".stale-20"
    assert sorted(os.listdir(stale), key=int) == ["25", "30"]
    assert delta_rows(stale / "25").keys() == first_25.keys()
    assert not temps(cut)
    steps = lambda d: sorted(int(x) for x in os.listdir(d) if x.isdigit())  # noqa: E731
    assert steps(cut / "deltas") == steps(whole / "deltas") == list(range(5, 35, 5))
    for step in range(5, 35, 5):
        assert_same_delta(whole / "deltas" / str(step), cut / "deltas" / str(step))
        manifest = json.loads((cut / "deltas" / str(step) / "manifest.json").read_text())
        assert (manifest["since_step"], manifest["step"]) == (step - 5, step)
        assert sum(t["rows"] for t in manifest["tables"].values()) > 0  # replayed deltas are not empty

    # Versions are global steps, recorded in each export; the replayed 30 replaced the old one.
    assert steps(cut / "export") == [10, 20, 30]
    for version in (10, 20, 30):
        manifest = json.loads((cut / "export" / str(version) / "assets.extra" / "manifest.json").read_text())
        assert manifest["step"] == version
    loaded = tf.saved_model.load(str(cut / "export" / "30"))
    assert int(loaded.global_step.numpy()) == 30

    out, _ = run_ok(capsys, ["export", *train_argv(cut, *HOOKS, export=True)[1:2], "--delta",
                             *train_argv(cut, *HOOKS, export=True)[3:]])
    assert out.strip() == str(cut / "deltas" / "30")  # recorded in the checkpoint: kept


# ----------------------------------------------------------------------------- damaged checkpoints


def two_checkpoints(capsys, model_dir):
    run_ok(capsys, train_argv(model_dir, "train.checkpoint_every_steps=10", steps=20))
    return str(model_dir / "checkpoints")


def trained_examples(model_dir):
    return json.loads((model_dir / "metrics.json").read_text())["examples"]


def test_truncated_newest_checkpoint_falls_back_and_training_goes_on(tmp_path, capsys):
    model_dir = tmp_path / "run"
    ckpts = two_checkpoints(capsys, model_dir)
    (data,) = glob.glob(f"{ckpts}/ckpt-20.data-*")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    run_error(capsys, ["tables", str(model_dir)], "ckpt-20.data-00000-of-00001", "damaged checkpoint")
    run_ok(capsys, train_argv(model_dir, "train.checkpoint_every_steps=10", steps=30))
    assert trained_examples(model_dir) == 20 * BATCH  # resumed from ckpt-10, not from 0
    assert sorted(os.listdir(f"{ckpts}/.damaged")) == ["ckpt-20.data-00000-of-00001", "ckpt-20.index"]
    assert checkpoints.verify_checkpoint(f"{ckpts}/ckpt-30") is None
    assert tf.train.latest_checkpoint(ckpts).endswith("ckpt-30")


def test_garbage_checkpoint_index_is_rebuilt_not_a_restart_from_zero(tmp_path, capsys):
    model_dir = tmp_path / "run"
    ckpts = two_checkpoints(capsys, model_dir)
    with open(f"{ckpts}/checkpoint", "w") as f:
        f.write("\x00garbage{{{\n")
    run_error(capsys, ["tables", str(model_dir)], "checkpoints/checkpoint", "rebuilds it")
    run_ok(capsys, train_argv(model_dir, "train.checkpoint_every_steps=10", steps=30))
    assert trained_examples(model_dir) == 10 * BATCH  # resumed from ckpt-20


def test_nothing_readable_stops_with_one_line_naming_the_files(tmp_path, capsys):
    model_dir = tmp_path / "run"
    ckpts = two_checkpoints(capsys, model_dir)
    for path in glob.glob(f"{ckpts}/ckpt-*.data-*"):
        open(path, "w").close()
    for command in ("train", "evaluate", "export"):
        argv = train_argv(model_dir, steps=30)
        argv[0] = command
        if command != "train":
            argv.remove("--quiet")
        run_error(capsys, argv, "no readable checkpoint", "ckpt-10.data-00000-of-00001",
                  "ckpt-20.data-00000-of-00001")


# ----------------------------------------------------------------------------- one writer


def test_second_writer_exits_2_naming_the_holder(tmp_path, capsys):
    model_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "hold_writer_lock.py"), str(model_dir)],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for command in ("train", "export", "evaluate"):
            argv = train_argv(model_dir)
            argv[0] = command
            if command != "train":
                argv.remove("--quiet")
            run_error(capsys, argv, str(model_dir), f"pid {holder.pid}", "recflow train")
        assert not (model_dir / "config.yaml").exists()  # the loser wrote nothing
    finally:
        holder.kill()
        holder.wait()


# ----------------------------------------------------------------------------- full disk


@contextlib.contextmanager
def small_tmpfs(path, size="20m"):
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (the injected-ENOSPC case still runs)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path, leave):
    st = os.statvfs(path)
    with open(path / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def test_full_tmpfs_exits_2_and_keeps_the_last_checkpoint(tmp_path, capsys):
    with small_tmpfs(tmp_path / "disk") as disk:
        model_dir = disk / "run"
        sets = ("train.checkpoint_every_steps=10", "export.every_steps=10", "export.delta_every_steps=5")
        run_ok(capsys, train_argv(model_dir, *sets, steps=10, export=True))
        fill(disk, leave=200_000)
        line = run_error(capsys, train_argv(model_dir, *sets, steps=60, export=True), "no space left on device")
        assert line.startswith(f"recflow: {model_dir}/") and ".tmp-" not in line and "_temp" not in line
        assert not temps(model_dir)
        good = checkpoints.readable_checkpoint(str(model_dir / "checkpoints"))
        assert good is not None and checkpoints.verify_checkpoint(good) is None
        os.remove(disk / "filler")
        run_ok(capsys, train_argv(model_dir, *sets, steps=20, export=True))


def test_injected_enospc_exits_2_naming_the_path(tmp_path, capsys, monkeypatch):
    model_dir = tmp_path / "run"

    def no_space(file, **arrays):
        with open(file, "wb") as f:  # half a file, as a full disk leaves it
            f.write(b"PK")
        raise OSError(errno.ENOSPC, "No space left on device", str(file))

    monkeypatch.setattr(np, "savez", no_space)  # what a delta is written with
    line = run_error(capsys, train_argv(model_dir, "export.delta_every_steps=5", steps=10),
                     "no space left on device")
    assert line.startswith(f"recflow: {model_dir / 'deltas'}: ")  # the staging dir is gone
    assert not temps(model_dir) and not (model_dir / "deltas" / "5").exists()


# ----------------------------------------------------------------------------- vanished input, bad paths


def test_train_file_removed_mid_run_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    train_file, eval_file = write_synthetic(str(tmp_path / "data"), 200)
    original = Trainer.epoch_dataset

    def epoch_dataset(self, epoch, cache=None):
        ds = original(self, epoch, cache)  # lists the file ...
        if epoch == 1:
            os.remove(train_file)  # ... which is gone before it is opened
        return ds

    monkeypatch.setattr(Trainer, "epoch_dataset", epoch_dataset)
    argv = train_argv(tmp_path / "run", "data.format=csv", f"data.train={train_file}",
                      f"data.eval={eval_file}", "train.epochs=2", "train.steps=null",
                      "data.cache=off")  # with the input cache, epoch 2 would not reopen the file
    run_error(capsys, argv, train_file, "no such file")


def test_model_dir_that_is_a_file_exits_2(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    run_error(capsys, train_argv(path, steps=2), str(path), "not a directory")


def test_relative_model_type_exits_2(tmp_path, capsys):
    run_error(capsys, train_argv(tmp_path / "run", "model.type=.deepfm:DeepFM", steps=2),
              "model.type", "'.deepfm:DeepFM'")


def test_predict_reads_a_csv_with_a_byte_order_mark(tmp_path, capsys):
    train_file, eval_file = write_synthetic(str(tmp_path / "data"), 200)
    model_dir = tmp_path / "run"
    run_ok(capsys, train_argv(model_dir, "data.format=csv", f"data.train={train_file}",
                              f"data.eval={eval_file}", steps=3, export=True))
    lines = open(eval_file, encoding="utf-8").read().splitlines()
    header = lines[0].split(",")
    first = header.index("user_id")  # a model input first: the BOM sticks to its name
    moved = [",".join([r[first]] + r[:first] + r[first + 1:]) for r in (x.split(",") for x in lines)]
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    plain.write_text("\n".join(moved) + "\n", encoding="utf-8")
    bom.write_text("\n".join(moved) + "\n", encoding="utf-8-sig")
    assert bom.read_bytes()[:3] == b"\xef\xbb\xbf"
    export = str(model_dir / "export" / "3")
    out_plain, _ = run_ok(capsys, ["predict", export, str(plain)])
    out_bom, _ = run_ok(capsys, ["predict", export, str(bom)])
    assert out_bom == out_plain and len(out_bom.splitlines()) == len(lines) - 1


# ----------------------------------------------------------------------------- launch


def listening_ports(pid):
    """TCP ports in LISTEN state in the network namespace of `pid`."""
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def test_launch_is_private_and_dies_with_the_launcher(tmp_path):
    model_dir = tmp_path / "ps"
    command = [sys.executable, "-m", "recflow.cli", "launch", CONFIG, "--ps", "1", "--workers", "1",
               *train_argv(model_dir, steps=100000)[3:]]
    launcher = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        deadline = time.time() + 300
        while True:
            assert launcher.poll() is None, launcher.stderr.read()[-2000:]
            assert time.time() < deadline, "cluster did not come up"
            time.sleep(0.5)
            if not (model_dir / "cluster.json").exists():
                continue
            tasks = json.loads((model_dir / "cluster.json").read_text())["tasks"]
            if any(t["pid"] is None for t in tasks):
                continue
            ports = {t["pid"]: int(t["address"].rsplit(":", 1)[1]) for t in tasks}
            if all(port in listening_ports(pid) for pid, port in ports.items() if pid):
                break
        pids = list(ports)
        for pid, port in ports.items():
            # The task's network namespace holds loopback alone ...
            interfaces = [line.split(":")[0].strip() for line in open(f"/proc/{pid}/net/dev").read().splitlines()[2:]]
            assert interfaces == ["lo"], interfaces
            # ... and from this (the host's) namespace nothing answers on its port.
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(2)
                s.connect(("127.0.0.1", port))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 10
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], "tasks outlived the launcher by 10 s"
    finally:
        launcher.kill()
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)


def test_ctrl_c_stops_a_launch_after_a_final_checkpoint(tmp_path):
    """A terminal's Ctrl-C reached every task: the workers died mid-step, the chief could
    not finish its step and was killed after 10 s, with no final checkpoint. The launcher
    now passes the signal to the chief alone, which stops after its step and checkpoints."""
    model_dir = tmp_path / "ps"
    command = [sys.executable, "-m", "recflow.cli", "launch", CONFIG, "--ps", "1", "--workers", "1",
               *train_argv(model_dir, "train.checkpoint_every_steps=4", steps=100000)[3:]]
    launcher = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own process group, as a shell's job
    try:
        deadline = time.time() + 300
        while not list((model_dir / "checkpoints").glob("ckpt-*.index")):
            assert launcher.poll() is None, launcher.stderr.read()[-2000:]
            assert time.time() < deadline, "no checkpoint"
            time.sleep(0.5)
        tasks = json.loads((model_dir / "cluster.json").read_text())["tasks"]
        os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, err[-2000:]
    stopped = re.search(r"^stopped at step (\d+) \(interrupted by SIGINT\)", err, re.M)
    assert stopped, err[-2000:]
    assert (model_dir / "checkpoints" / f"ckpt-{stopped.group(1)}.index").exists()
    assert not [t["pid"] for t in tasks if t["pid"] and alive(t["pid"])]
