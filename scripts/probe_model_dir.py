"""Probes of issue 10: how the model dir fares under kill -9, damage, a full disk,
a second writer, and how `recflow launch` exposes its servers.

Usage: PYTHONPATH=TREE python scripts/probe_model_dir.py WORKDIR [PROBE ...]
Prints one line per probe: `name | outcome`.  Runs `recflow` from PYTHONPATH.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "deepfm_demo.yaml")


def small(model_dir, *extra, steps=100):
    sets = [
        "data.synthetic={rows: 4000, eval_rows: 200, seed: 5, schema: demo}",
        "data.batch_size=32",
        "train.epochs=null",
        f"train.steps={steps}",
        "model.params={dnn: {hidden_units: [8]}}",
        f"train.model_dir={model_dir}",
        *extra,
    ]
    return [a for s in sets for a in ("--set", s)]


def cli(*args):
    return [sys.executable, "-m", "recflow.cli", *args]


def run(*args, timeout=600):
    p = subprocess.run(cli(*args), env=ENV, capture_output=True, text=True, timeout=timeout)
    return p.returncode, last(p.stderr)


def last(text):
    lines = [x for x in text.strip().splitlines() if x.strip()]
    tb = any(x.startswith("Traceback") for x in lines)
    return (lines[-1][:160] if lines else "") + (" [traceback]" if tb else "")


def train(model_dir, *extra, steps=100, **kw):
    return run("train", CONFIG, "--quiet", *small(model_dir, *extra, steps=steps), **kw)


def kill_when(args, path_glob, timeout=300):
    proc = subprocess.Popen(cli(*args), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not glob.glob(path_glob) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def probe_deltas_kill(w):
    md = f"{w}/deltas_kill"
    extra = ("train.checkpoint_every_steps=50", "export.delta_every_steps=5")
    kill_when(["train", CONFIG, "--quiet", *small(md, *extra, steps=200)], f"{md}/deltas/65")
    rc, msg = train(md, *extra, steps=200)
    rows = {}
    for step in (55, 60, 65):
        m = f"{md}/deltas/{step}/manifest.json"
        if os.path.exists(m):
            rows[step] = sum(t["rows"] for t in json.load(open(m))["tables"].values())
    stale = sorted(os.path.basename(p) for p in glob.glob(f"{md}/deltas/.stale-*"))
    rc2, msg2 = run("export", CONFIG, "--delta", *small(md, *extra, steps=200))
    return f"restart rc={rc} {msg!r}; rows in deltas 55/60/65={rows}; stale={stale}; export --delta rc={rc2}"


def export_steps(md):
    out = {}
    for d in sorted(glob.glob(f"{md}/export/[0-9]*"), key=lambda p: int(os.path.basename(p))):
        m = os.path.join(d, "assets.extra", "manifest.json")
        out[int(os.path.basename(d))] = json.load(open(m))["step"] if os.path.exists(m) else None
    return out


def probe_export_order(w):
    md = f"{w}/export_order"
    extra = ("train.checkpoint_every_steps=50", "export.every_steps=10")
    kill_when(["train", CONFIG, "--quiet", *small(md, *extra, steps=60)], f"{md}/export/4")
    before = export_steps(md)
    rc, msg = train(md, *extra, steps=60)
    after = export_steps(md)
    if all(v is None for v in after.values()):  # no step recorded: infer from the schedule
        new = [v for v in after if v not in before]
        steps = {v: 10 * (i + 1) for i, v in enumerate(sorted(before))}
        steps.update({v: min(10 * (i + 1), 60) for i, v in enumerate(sorted(new))})
        after = {v: f"~{s}" for v, s in steps.items()}
        ordered = all(steps[a] <= steps[b] for a, b in zip(sorted(steps), sorted(steps)[1:]))
    else:
        vs = sorted(after)
        ordered = all(after[a] <= after[b] for a, b in zip(vs, vs[1:])) and all(v == after[v] for v in vs)
    return f"rc={rc}; version->step {after}; ordered={ordered}"


def damaged(w, name, damage):
    md = f"{w}/{name}"
    train(md, "train.checkpoint_every_steps=10", steps=20)
    damage(md)
    rc, msg = train(md, "train.checkpoint_every_steps=10", steps=30)
    steps = json.load(open(f"{md}/metrics.json")).get("examples") if rc == 0 else None
    return rc, msg, steps


def probe_truncated_data(w):
    def damage(md):
        (f,) = glob.glob(f"{md}/checkpoints/ckpt-20.data-*")
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    rc, msg, ex = damaged(w, "trunc", damage)
    md = f"{w}/trunc_tables"
    train(md, "train.checkpoint_every_steps=10", steps=20)
    damage(md)
    rct, msgt = run("tables", md)
    return f"train rc={rc} {msg!r} examples={ex}; tables rc={rct} {msgt!r}"


def probe_flipped_bytes(w):
    def damage(md):
        (f,) = glob.glob(f"{md}/checkpoints/ckpt-20.data-*")
        with open(f, "r+b") as fh:
            data = bytearray(fh.read())
            for i in range(0, len(data), 7):
                data[i] ^= 0xFF
            fh.seek(0)
            fh.write(data)
    rc, msg, ex = damaged(w, "flip", damage)
    return f"train rc={rc} {msg!r} examples={ex}"


def probe_empty_index(w):
    def damage(md):
        open(f"{md}/checkpoints/ckpt-20.index", "w").close()
    rc, msg, ex = damaged(w, "emptyidx", damage)
    return f"train rc={rc} {msg!r} examples={ex}"


def probe_garbage_index_file(w):
    def damage(md):
        with open(f"{md}/checkpoints/checkpoint", "w") as f:
            f.write("\x00garbage{{{\n")
    rc, msg, ex = damaged(w, "garbage", damage)
    return f"train rc={rc} {msg!r} examples trained on resume={ex} (10 steps=320 resumed, 30 steps=960 from 0)"


def probe_nothing_readable(w):
    def damage(md):
        for f in glob.glob(f"{md}/checkpoints/ckpt-*.data-*"):
            open(f, "w").close()
    rc, msg, ex = damaged(w, "nothing", damage)
    return f"train rc={rc} {msg!r}"


def probe_two_writers(w):
    md = f"{w}/two"
    args = ["train", CONFIG, "--quiet", *small(md, "export.every_steps=20", "export.delta_every_steps=10", steps=150)]
    a = subprocess.Popen(cli(*args), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen(cli(*args, "--set", "train.checkpoint_every_steps=77"),
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ea, eb = a.communicate()[1], b.communicate()[1]
    cfg = open(f"{md}/config.yaml").read()
    loser_cfg = "checkpoint_every_steps: 77" in cfg
    winner_b = b.returncode == 0 and a.returncode != 0
    return (f"rc=({a.returncode},{b.returncode}) loser says {last(eb if b.returncode else ea)!r}; "
            f"config.yaml holds the settings of run {'b' if loser_cfg else 'a'} "
            f"(the {'winner' if loser_cfg == winner_b else 'loser'})")


def probe_export_during_run(w):
    md = f"{w}/exp_during"
    extra = ("export.every_steps=10",)
    train(md, *extra, steps=10)
    p = subprocess.Popen(cli("train", CONFIG, "--quiet", *small(md, *extra, steps=400)),
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not glob.glob(f"{md}/export/.tmp-*") and not (
        os.path.exists(f"{md}/.lock") and open(f"{md}/.lock").read().startswith(f"{p.pid} ")
    ):
        time.sleep(0.01)  # the trainer is running (and, with the fix, holds the lock)
    results = []
    for _ in range(4):
        rc, msg = run("export", CONFIG, *small(md, *extra, steps=400))
        results.append((rc, msg[:90]))
    p.wait()
    return f"4 exports during a run: {results}; trainer rc={p.returncode}"


def probe_full_disk(w):
    mnt = f"{w}/tmpfs"
    os.makedirs(mnt, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", mnt]).returncode:
        return "cannot mount tmpfs"
    try:
        md = f"{mnt}/md"
        rc0, _ = train(md, "train.checkpoint_every_steps=10", steps=10)
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        with open(f"{mnt}/filler", "wb") as f:
            f.write(b"\0" * max(0, free - 300_000))
        rc, msg = train(md, "train.checkpoint_every_steps=10", "export.every_steps=10", steps=60)
        left = [os.path.relpath(p, md) for p in glob.glob(f"{md}/**/*", recursive=True)
                if "tmp" in os.path.basename(p) or "_temp" in os.path.basename(p)]
        left += [os.path.relpath(p, md) for p in glob.glob(f"{md}/**/.tmp*", recursive=True)]
        os.remove(f"{mnt}/filler")
        rc2, msg2 = train(md, "train.checkpoint_every_steps=10", steps=20)
        return f"rc={rc} {msg!r}; left={sorted(set(left))}; after freeing space: rc={rc2}"
    finally:
        subprocess.run(["umount", mnt])


def probe_vanished_file(w):
    data = f"{w}/vanish_data"
    subprocess.run(cli("data", "synth", "--out", data, "--rows", "2000"), env=ENV, check=True,
                   capture_output=True)
    md = f"{w}/vanish"
    args = ["train", CONFIG, "--quiet", *small(md, "data.format=csv", f"data.train={data}/train.csv",
                                             f"data.eval={data}/eval.csv", "train.epochs=5",
                                             "train.steps=null", "train.checkpoint_every_steps=20")]
    p = subprocess.Popen(cli(*args), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not glob.glob(f"{md}/checkpoints/ckpt-20.index") and p.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.remove(f"{data}/train.csv")
    err = p.communicate()[1]
    return f"rc={p.returncode} {last(err)!r}"


def probe_vanished_mid_run(w):
    """The train file disappears after the second pass's file list is made."""
    data = f"{w}/data"
    subprocess.run(cli("data", "synth", "--out", data, "--rows", "300"), env=ENV, check=True,
                   capture_output=True)
    args = ["train", CONFIG, "--quiet", *small(f"{w}/md", "data.format=csv", f"data.train={data}/train.csv",
                                             f"data.eval={data}/eval.csv", "train.epochs=2", "train.steps=null")]
    code = f"""
import os, sys
from recflow.training.trainer import Trainer
from recflow.cli import main
original = Trainer.epoch_dataset
def epoch_dataset(self, epoch):
    ds = original(self, epoch)
    if epoch == 1:
        os.remove({data + "/train.csv"!r})
    return ds
Trainer.epoch_dataset = epoch_dataset
sys.exit(main({args!r}))
"""
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    return f"rc={p.returncode} {last(p.stderr)!r}"


def probe_stale_temps(w):
    md = f"{w}/stale"
    train(md, "train.checkpoint_every_steps=10", "export.every_steps=10", steps=10)
    for d in ("checkpoints/ckpt-7_temp", "export/.tmp-dead", "deltas/.tmp-dead"):
        os.makedirs(f"{md}/{d}", exist_ok=True)
    open(f"{md}/config.yaml.tmp-99999", "w").close()
    train(md, "train.checkpoint_every_steps=10", steps=20)
    left = [d for d in ("checkpoints/ckpt-7_temp", "export/.tmp-dead", "deltas/.tmp-dead", "config.yaml.tmp-99999")
            if os.path.exists(f"{md}/{d}")]
    return f"left after next start: {left}"


def _listening(pid):
    """{port: local address} of LISTEN sockets in the network namespace of `pid`."""
    out = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":
                addr, port = f[1].rsplit(":", 1)
                out[int(port, 16)] = "any" if set(addr) == {"0"} else addr
    return out


def probe_launch(w):
    import socket

    md = f"{w}/launch"
    args = ["launch", CONFIG, "--ps", "1", "--workers", "1", *small(md, steps=100000)]
    p = subprocess.Popen(cli(*args), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    ports = {}
    while time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
        if not os.path.exists(f"{md}/cluster.json"):
            continue
        tasks = json.load(open(f"{md}/cluster.json"))["tasks"]
        ports = {t["pid"]: int(t["address"].rsplit(":", 1)[1]) for t in tasks if t["pid"]}
        if len(ports) == 3 and all(port in _listening(pid) for pid, port in ports.items()):
            break
    if p.poll() is not None:
        return f"launcher exited {p.returncode}: {last(p.stderr.read())!r}"
    bound = sorted({_listening(pid).get(port, "?") for pid, port in ports.items()})
    ifaces = sorted({tuple(x.split(":")[0].strip() for x in open(f"/proc/{pid}/net/dev").read().splitlines()[2:])
                     for pid in ports})
    reachable = 0
    for port in ports.values():
        with socket.socket() as s:
            s.settimeout(2)
            reachable += s.connect_ex(("127.0.0.1", port)) == 0
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(10)
    alive = [q for q in ports if os.path.exists(f"/proc/{q}") and open(f"/proc/{q}/stat").read().split()[2] != "Z"]
    for q in alive:
        os.kill(q, signal.SIGKILL)
    return (f"servers bound to {bound} in a netns with interfaces {ifaces}; ports answering from the "
            f"host netns: {reachable}/{len(ports)}; tasks alive 10 s after kill -9 of the launcher: "
            f"{len(alive)}/{len(ports)}")


def probe_alias_bomb(w):
    path = f"{w}/bomb.yaml"
    levels = ["    a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"]
    for i in range(1, 6):
        levels.append(f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n")
    text = open(CONFIG).read().replace(
        "params: {dnn: {hidden_units: [64, 32], dropout: 0.0}}", "params:\n" + "".join(levels)
    )
    open(path, "w").write(text)
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", *cli("train", path, "--quiet",
                        *small(f"{w}/md", steps=2))], env=ENV, capture_output=True, text=True, timeout=600)
    rss = [x for x in p.stderr.splitlines() if x.startswith("maxrss_kb=")]
    err = "\n".join(x for x in p.stderr.splitlines() if not x.startswith("maxrss_kb="))
    return f"rc={p.returncode} {last(err)!r} in {time.time() - t:.1f}s {rss}"


def probe_export_config(w):
    md = f"{w}/expcfg"
    train(md, steps=5)
    (cfg,) = glob.glob(f"{md}/export/*/assets.extra/recflow_config.yaml")
    text = open(cfg).read()
    return f"model dir in export config={os.path.abspath(md) in text or md in text}; abs paths={'/' in ''.join(line for line in text.splitlines() if 'train:' in line or 'eval:' in line or 'model_dir' in line)}"


def probe_model_dir_file(w):
    f = f"{w}/iamafile"
    open(f, "w").write("x")
    rc, msg = train(f, steps=5)
    return f"rc={rc} {msg!r}"


def probe_relative_model_type(w):
    rc, msg = run("train", CONFIG, "--quiet", *small(f"{w}/reltype", "model.type=.deepfm:DeepFM", steps=5))
    return f"rc={rc} {msg!r}"


def probe_bom_predict(w):
    data = f"{w}/bom_data"
    subprocess.run(cli("data", "synth", "--out", data, "--rows", "500"), env=ENV, check=True, capture_output=True)
    md = f"{w}/bom"
    train(md, "data.format=csv", f"data.train={data}/train.csv", f"data.eval={data}/eval.csv", steps=5)
    import csv
    rows = list(csv.reader(open(f"{data}/eval.csv", newline="")))
    first = rows[0].index("user_id")  # a model input first, so the BOM sticks to it
    rows = [[r[first]] + r[:first] + r[first + 1:] for r in rows]
    with open(f"{data}/bom.csv", "w", newline="", encoding="utf-8-sig") as f:
        csv.writer(f).writerows(rows)
    (exp,) = glob.glob(f"{md}/export/*")
    p = subprocess.run(cli("predict", exp, f"{data}/bom.csv"), env=ENV, capture_output=True, text=True)
    return f"rc={p.returncode} lines={len(p.stdout.splitlines())} {last(p.stderr)!r}"


PROBES = {n[6:]: f for n, f in globals().items() if n.startswith("probe_")}

if __name__ == "__main__":
    work = sys.argv[1]
    names = sys.argv[2:] or list(PROBES)
    for name in names:
        w = os.path.join(work, name)
        shutil.rmtree(w, ignore_errors=True)
        os.makedirs(w)
        t = time.time()
        try:
            out = PROBES[name](w)
        except Exception as e:  # noqa: BLE001
            out = f"probe error: {type(e).__name__}: {e}"
        print(f"{name} | {out} | {time.time() - t:.0f}s", flush=True)
