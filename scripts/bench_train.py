"""Whole-job speed of DeepFM: recflow fused / unfused vs DeepCTR (vs TFRA), each process timed.

The Criteo-like synthetic rows (26 string categorical columns with Zipf ids, 13 numeric
columns with missing values; `recflow.data.synthetic`, schema "criteo") are written to
`train.csv` and `eval.csv` before any clock starts. Then every system runs one whole
job in its own fresh process, timed from outside (start to exit), as a user waits for it:

    recflow_fused    `recflow train configs/criteo_bench.yaml --set data.format=csv ...`
                     (fusion on): read the CSV, train, evaluate, export a SavedModel
    recflow_unfused  the same with embedding.fusion: false (one physical table per table)
    deepctr          import TF, read the same CSV with pandas, LabelEncoder vocabularies,
                     log1p, deepctr.models.DeepFM, fit, predict the eval rows
    tfra             scripts/tfra_deepfm.py in a side virtualenv (TF 2.16.2 + TFRA 0.8.1,
                     built on first use under --tfra-venv) on the same rows as .npz;
                     only with --only ...,tfra; unavailable (skipped) when it cannot build

All use the same DeepFM (embedding dim, first-order terms, FM, ReLU DNN of `--hidden`
units), Adam at `--lr` for every parameter, batch `--batch-size`, `--epochs` epochs,
and the same AUC function on the eval rows. `--repeats` (default 2) runs every system
again, interleaved, and keeps each system's best (shortest) process.

Columns: `job s` the whole process; `job ex/s` trained examples / job s; `train ex/s`
the training loop's own rate (recflow: metrics.json examples_per_sec, trace and input
included; DeepCTR: fit); `steady ex/s` recflow's rate over epochs 2.. (metrics.json
`timing.steady_examples_per_sec`, needs --epochs >= 2); then recflow's phase seconds
(metrics.json `timing`: startup = process start -> training begins, trace, train, eval,
export). Targets (PASS / FAIL): fused job >= 1.5x faster than DeepCTR's, fused steady
state >= 60k examples/s (with --epochs >= 2), fused AUC >= DeepCTR's - 0.005.

Output: a text table, `--out` (default bench_train.md) with the Markdown tables and
`--chart` (default bench_train.png) with bar charts of examples/s and AUC per system,
then the JSON last line.

Usage:
    python scripts/bench_train.py                         # 1 epoch, best of 2
    python scripts/bench_train.py --epochs 3              # + steady-state examples/s
    python scripts/bench_train.py --only recflow_fused,deepctr --repeats 1
    python scripts/bench_train.py --rows 40000 --eval-rows 8000 --repeats 1

Last line: {"bench": "train", "systems": {...}, "fused_vs_deepctr": ..., "passed": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)

SYSTEMS = ("recflow_fused", "recflow_unfused", "deepctr", "tfra")
DEFAULT_SYSTEMS = ("recflow_fused", "recflow_unfused", "deepctr")
SPEEDUP_TARGET = 1.5  # fused job time vs DeepCTR's
STEADY_TARGET = 60_000.0  # fused examples/s over epochs 2..
AUC_TOLERANCE = 0.005
PHASES = ("startup", "trace", "train", "eval", "export")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=240_000, help="train rows (default 240000)")
    p.add_argument("--eval-rows", type=int, default=60_000, help="eval rows (default 60000)")
    p.add_argument("--batch-size", type=int, default=4096, help="default 4096")
    p.add_argument("--epochs", type=int, default=1, help="default 1")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    p.add_argument("--hidden", default="256,128", help="DNN hidden units (default 256,128)")
    p.add_argument(
        "--lr", type=float, default=0.005, help="Adam learning rate, all parameters (default 0.005)"
    )
    p.add_argument("--seed", type=int, default=7, help="data seed (default 7)")
    p.add_argument(
        "--only", default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})",
    )  # fmt: skip
    p.add_argument(
        "--config", default=os.path.join(common.REPO, "configs", "criteo_bench.yaml"),
        help="recflow config; data, batch, epochs, dims, units and optimizers are overridden",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="extra recflow overrides for both recflow systems (e.g. train.xla=true)",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=2,
        help="run every system this many times, interleaved; keep the best (default 2)",
    )  # fmt: skip
    p.add_argument("--out", default="bench_train.md", help="Markdown report (default bench_train.md)")
    p.add_argument("--chart", default="bench_train.png", help="PNG bar chart (default bench_train.png)")
    p.add_argument("--tfra-venv", default=common.DEFAULT_TFRA_VENV, help="side virtualenv for TFRA")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds for one job (default 1800)"
    )
    # The DeepCTR job, run by the bench in a fresh process.
    p.add_argument("--deepctr-job", nargs=2, metavar=("TRAIN_CSV", "EVAL_CSV"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        p.error(f"--only: unknown system(s) {unknown}; expected a subset of {','.join(SYSTEMS)}")
    if args.repeats < 1 or args.epochs < 1:
        p.error("--repeats and --epochs must be >= 1")
    args.hidden_units = [int(u) for u in args.hidden.split(",") if u]
    return args


# ----------------------------------------------------------------------------- the jobs


def recflow_command(args, fusion: bool, paths: tuple[str, str], model_dir: str) -> list[str]:
    """`recflow train` on the CSV files, as a user types it."""
    overrides = common.deepfm_config(
        args.rows, args.eval_rows, seed=args.seed, batch_size=args.batch_size, epochs=args.epochs,
        dim=args.dim, hidden=args.hidden_units, lr=args.lr, fusion=fusion, model_dir=model_dir,
        csv=paths,
    )  # fmt: skip
    overrides += args.set
    script = os.path.join(os.path.dirname(sys.executable), "recflow")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "recflow.cli"]
    command += ["train", args.config, "--quiet"]
    for item in overrides:
        command += ["--set", item]
    return command


def timed(command: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    """(wall seconds, the finished process) of one job, start to exit."""
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise common.Unavailable(f"{os.path.basename(command[0])}: ran past --timeout {timeout:.0f}s") from None
    return time.perf_counter() - began, done


def timed_record(command: list[str], timeout: float, bench: str, who: str) -> tuple[float, dict]:
    """Runs a job process; returns its wall seconds and its last `{"bench": bench, ...}` line.

    Raises:
        common.Unavailable: the job failed or printed no such line.
    """
    wall, done = timed(command, timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(f'{{"bench": "{bench}"')]
    if done.returncode != 0 or not lines:
        raise common.Unavailable(
            f"{who} exit {done.returncode}: {common._last_error_line(done.stderr + done.stdout)}"
        )
    return wall, json.loads(lines[-1])


def run_recflow(args, fusion: bool, paths, work: str) -> dict:
    # A fresh model dir per run: an existing one would resume from its checkpoint.
    model_dir = tempfile.mkdtemp(prefix="fused-" if fusion else "unfused-", dir=work)
    shutil.rmtree(model_dir)
    wall, done = timed(recflow_command(args, fusion, paths, model_dir), args.timeout)
    if done.returncode != 0:
        raise common.Unavailable(
            f"recflow train exit {done.returncode}: {common._last_error_line(done.stderr + done.stdout)}"
        )
    with open(os.path.join(model_dir, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    timing = metrics.get("timing", {})
    shutil.rmtree(model_dir, ignore_errors=True)
    return {
        "job_seconds": wall, "auc": metrics["auc"],
        "train_examples_per_sec": metrics["examples_per_sec"],
        "steady_examples_per_sec": timing.get("steady_examples_per_sec"),
        "timing": {k: timing[k] for k in PHASES if k in timing},
    }  # fmt: skip


def run_deepctr(args, paths) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *args.argv, "--deepctr-job", *paths]
    wall, r = timed_record(command, args.timeout, "deepctr_job", "deepctr job")
    return {
        "job_seconds": wall, "auc": r["auc"], "train_examples_per_sec": r["fit_examples_per_sec"],
        "steady_examples_per_sec": None, "timing": {},
    }  # fmt: skip


def deepctr_job(args) -> int:
    """The DeepCTR job (in its own process): read the CSV files, encode, fit, predict."""
    import pandas as pd

    train_csv, eval_csv = args.deepctr_job
    train = pd.read_csv(train_csv, dtype={c: str for c in common.C_COLUMNS}, keep_default_na=False)
    evaluation = pd.read_csv(eval_csv, dtype={c: str for c in common.C_COLUMNS}, keep_default_na=False)
    columns = lambda frame: {  # noqa: E731
        name: frame[name].to_numpy() if name in common.C_COLUMNS
        else pd.to_numeric(frame[name], errors="coerce").to_numpy(dtype="float32")
        for name in (*common.C_COLUMNS, *common.I_COLUMNS, common.LABEL)
    }  # fmt: skip
    r = common.run_deepctr(
        columns(train), columns(evaluation), dim=args.dim, hidden=args.hidden_units,
        batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, seed=args.seed,
    )  # fmt: skip
    common.emit_json("deepctr_job", **r)
    return 0


def run_tfra(args, train, evaluation, work: str) -> dict:
    import numpy as np

    from recflow.metrics import auc

    python = common.tfra_python(args.tfra_venv)
    paths = [os.path.join(work, n) for n in ("train.npz", "eval.npz", "scores.npy")]
    common.write_npz(paths[0], train)
    common.write_npz(paths[1], evaluation)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tfra_deepfm.py")
    command = [
        python, script, "--train", paths[0], "--eval", paths[1], "--scores", paths[2],
        "--dim", str(args.dim), "--hidden", args.hidden, "--batch-size", str(args.batch_size),
        "--epochs", str(args.epochs), "--lr", str(args.lr), "--seed", str(args.seed),
    ]  # fmt: skip
    wall, r = timed_record(command, args.timeout, "tfra_deepfm", "tfra_deepfm.py")
    return {
        "job_seconds": wall, "auc": auc(evaluation[common.LABEL], np.load(paths[2])),
        "train_examples_per_sec": r["fit_examples_per_sec"], "steady_examples_per_sec": None,
        "timing": {}, "versions": f"tensorflow {r['tensorflow']}, tfra {r['tfra']}",
    }  # fmt: skip


# ----------------------------------------------------------------------------- report


def table_rows(args, results: dict, unavailable: dict) -> tuple[list[str], list[list]]:
    examples = args.rows * args.epochs
    fused = results.get("recflow_fused")
    headers = ["system", "job s", "job ex/s", "train ex/s", "steady ex/s", "auc", "vs fused"]
    headers += [f"{p} s" for p in PHASES]
    rows = []
    for system in SYSTEMS:
        if system in results:
            r = results[system]
            speed = common.ratio(r["job_seconds"], fused["job_seconds"]) if fused else None
            row = [system, r["job_seconds"], examples / r["job_seconds"], r["train_examples_per_sec"],
                   r["steady_examples_per_sec"], r["auc"], speed]  # fmt: skip
            rows.append(row + [r["timing"].get(p) for p in PHASES])
        elif system in unavailable:
            rows.append([system] + [None] * (len(headers) - 1))
    return headers, rows


def markdown(headers, rows, title: str, checks: dict, ratios: dict, unavailable: dict) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|")
    lines += ["| " + " | ".join(common.fmt(v) for v in row) + " |" for row in rows]
    if unavailable:
        lines += [""] + [f"- {s}: unavailable: {m}" for s, m in unavailable.items()]
    if checks:
        lines += ["", "| target | value | goal | verdict |", "|---|---:|---:|---|"]
        for name, c in checks.items():
            lines.append(f"| {name} | {c['shown']} | {c['goal']} | {'PASS' if c['pass'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def chart(path: str, results: dict, title: str) -> None:
    """Bars of job examples/s (and steady examples/s) and AUC per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in SYSTEMS if s in results]
    fig, (speed, quality) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(systems))
    series = [("whole job", [results[s]["job_examples_per_sec"] for s in systems]),
              ("training loop", [results[s]["train_examples_per_sec"] for s in systems])]  # fmt: skip
    steady = [results[s]["steady_examples_per_sec"] or 0.0 for s in systems]
    if any(steady):
        series.append(("steady state (epochs 2..)", steady))
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * width
        bars = speed.bar([i + offset for i in x], values, width, label=label)
        speed.bar_label(bars, fmt="{:,.0f}", fontsize=7)
    speed.set_xticks(list(x), systems, fontsize=9)
    speed.set_ylabel("examples / s")
    speed.set_title("speed (higher is better)")
    speed.legend(fontsize=8)
    aucs = [results[s]["auc"] for s in systems]
    bars = quality.bar(list(x), aucs, 0.5, color="tab:green")
    quality.bar_label(bars, fmt="{:.4f}", fontsize=8)
    low = min(aucs)
    quality.set_ylim(max(0.0, low - 0.05), max(aucs) + 0.02)
    quality.set_xticks(list(x), systems, fontsize=9)
    quality.set_ylabel("eval AUC")
    quality.set_title("AUC (higher is better)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = [a for a in argv]
    if args.deepctr_job:
        return deepctr_job(args)
    work = tempfile.mkdtemp(prefix="recflow-bench-train-")
    try:
        return bench(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(args, work: str) -> int:
    print(f"writing {args.rows} + {args.eval_rows} Criteo-like rows to CSV ...", flush=True)
    train, evaluation, oracle = common.criteo_data(args.rows, args.eval_rows, args.seed)
    paths = common.write_csv(os.path.join(work, "data"), train, evaluation)
    if "tfra" not in args.systems:
        train = evaluation = None  # the CSV files hold them; free the memory
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    unavailable: dict[str, str] = {}
    for repeat in range(args.repeats):  # systems interleaved, so drift hits all alike
        for system in SYSTEMS:
            if system not in args.systems or system in unavailable:
                continue
            label = f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"running {system}{label} ...", flush=True)
            try:
                if system.startswith("recflow"):
                    r = run_recflow(args, system == "recflow_fused", paths, work)
                elif system == "deepctr":
                    r = run_deepctr(args, paths)
                else:
                    r = run_tfra(args, train, evaluation, work)
            except common.Unavailable as e:
                unavailable[system] = str(e)
                print(f"  {system}: unavailable: {e}", flush=True)
                continue
            runs[system].append(r)
            steady = r["steady_examples_per_sec"]
            print(f"  {r['job_seconds']:.1f}s, auc {r['auc']:.4f}"
                  + (f", steady {steady:,.0f} ex/s" if steady else ""), flush=True)  # fmt: skip
    results = {}
    for system, done in runs.items():
        if done:  # the best (shortest) process; all job times alongside
            best = min(done, key=lambda r: r["job_seconds"])
            results[system] = dict(best, job_seconds_all=[r["job_seconds"] for r in done])
            results[system]["job_examples_per_sec"] = args.rows * args.epochs / best["job_seconds"]

    title = (
        f"DeepFM, {args.rows} CSV rows x {args.epochs} epoch(s) + {args.eval_rows} eval rows, "
        f"batch {args.batch_size}, dim {args.dim}, hidden {args.hidden_units}, Adam lr {args.lr}, "
        f"best of {args.repeats}, {os.cpu_count()} cores, oracle auc {oracle:.4f}"
    )
    headers, rows = table_rows(args, results, unavailable)
    print()
    common.print_table(headers, rows, title=title)
    for system, message in unavailable.items():
        print(f"{system}: unavailable: {message}")

    ratios, checks = {}, {}
    fused, deepctr = results.get("recflow_fused"), results.get("deepctr")
    if fused and deepctr:
        value = deepctr["job_seconds"] / fused["job_seconds"]
        ratios["fused_vs_deepctr"] = value
        checks["fused_vs_deepctr"] = {"shown": f"{value:.2f}x", "goal": f">= {SPEEDUP_TARGET}x",
                                      "pass": value >= SPEEDUP_TARGET}  # fmt: skip
        gap = fused["auc"] - deepctr["auc"]
        ratios["auc_gap_vs_deepctr"] = gap
        checks["auc_gap_vs_deepctr"] = {"shown": f"{gap:+.4f}", "goal": f">= {-AUC_TOLERANCE}",
                                        "pass": gap >= -AUC_TOLERANCE}  # fmt: skip
    if fused and "recflow_unfused" in results:
        ratios["fused_vs_unfused"] = results["recflow_unfused"]["job_seconds"] / fused["job_seconds"]
    if fused and fused["steady_examples_per_sec"]:
        steady = fused["steady_examples_per_sec"]
        checks["fused_steady_examples_per_sec"] = {
            "shown": f"{steady:,.0f}", "goal": f">= {STEADY_TARGET:,.0f}", "pass": steady >= STEADY_TARGET
        }  # fmt: skip
    if checks:
        print("\ntargets (fused speedup = DeepCTR job s / fused job s):")
        for name, c in checks.items():
            print(f"  {name:<30} {c['shown']:>9}  ({c['goal']}): {'PASS' if c['pass'] else 'FAIL'}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(markdown(headers, rows, title, checks, ratios, unavailable))
        print(f"wrote {args.out}")
    if args.chart and results:
        chart(args.chart, results, title)
        print(f"wrote {args.chart}")
    common.emit_json(
        "train", rows=args.rows, eval_rows=args.eval_rows, batch_size=args.batch_size,
        epochs=args.epochs, dim=args.dim, hidden=args.hidden_units, lr=args.lr, oracle_auc=oracle,
        repeats=args.repeats, systems=results, unavailable=unavailable, **ratios,
        passed={k: c["pass"] for k, c in checks.items()},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
