"""Whole-job training speed of DeepFM: recflow fused / unfused vs DeepCTR vs TFRA.

The same Criteo-like synthetic rows (26 string categorical columns with Zipf ids,
13 numeric columns with missing values; `recflow.data.synthetic`, schema
"criteo", the same seed) are materialized in memory before each job's clock starts,
then each system runs one job on them, side by side in this run: build the model, train `--epochs` epochs at `--batch-size`,
score the eval rows. All use the same DeepFM (embedding dim, first-order terms,
FM, ReLU DNN of `--hidden` units), Adam at `--lr` for every parameter, and one
AUC function (`recflow.training.metrics.auc`).

    recflow_fused    configs/criteo_bench.yaml, embedding.fusion: true (2 physical tables)
    recflow_unfused  the same with embedding.fusion: false (52 physical tables)
    deepctr          deepctr.models.DeepFM, LabelEncoder vocabularies (fixed), same venv
    tfra             scripts/tfra_deepfm.py in a side virtualenv (TF 2.16.2 + TFRA 0.8.1,
                     built once under --tfra-venv), on the same rows passed as .npz

Each job runs in a fresh process (no warm XLA / tf.function caches carried over;
`--repeats` runs each system again, interleaved, and keeps the median). Job seconds
are wall time from model construction to eval scores (recflow: Trainer
build + fit + evaluate, including its final checkpoint; DeepCTR: + LabelEncoder
and log1p; TFRA: measured inside its process, TF import excluded). `train ex/s`
is examples over the training loop only (recflow: the trainer's examples_per_sec).

Targets (reported PASS / FAIL): recflow fused job >= 1.5x faster than unfused,
>= 1.2x faster than DeepCTR, >= 1.5x faster than TFRA, and fused AUC no lower
than DeepCTR's - 0.005.

Usage (defaults: 240k train rows, 40k eval rows, batch 4096, 1 epoch):
    python scripts/bench_train.py
    python scripts/bench_train.py --only recflow_fused,recflow_unfused
    python scripts/bench_train.py --only recflow_fused,recflow_unfused,deepctr --repeats 3
    python scripts/bench_train.py --rows 40000 --eval-rows 8000 --only recflow_fused,deepctr

Last line: {"bench": "train", "systems": {...}, "fused_vs_unfused": ..., ...}
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
TARGETS = {"recflow_unfused": 1.5, "deepctr": 1.2, "tfra": 1.5}  # fused speedup on job time
AUC_TOLERANCE = 0.005


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=240_000, help="train rows (default 240000)")
    p.add_argument("--eval-rows", type=int, default=40_000, help="eval rows (default 40000)")
    p.add_argument("--batch-size", type=int, default=4096, help="default 4096")
    p.add_argument("--epochs", type=int, default=1, help="default 1")
    p.add_argument("--dim", type=int, default=8, help="embedding dim (default 8)")
    p.add_argument("--hidden", default="256,128", help="DNN hidden units (default 256,128)")
    p.add_argument(
        "--lr", type=float, default=0.005, help="Adam learning rate, all parameters (default 0.005)"
    )
    p.add_argument("--seed", type=int, default=7, help="data seed (default 7)")
    p.add_argument(
        "--only", default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--config", default=os.path.join(common.REPO, "configs", "criteo_bench.yaml"),
        help="recflow config; data, batch, epochs, dims, units and optimizers are overridden",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=1,
        help="run every system this many times, interleaved; report the median job (default 1)",
    )  # fmt: skip
    p.add_argument("--tfra-venv", default=common.DEFAULT_TFRA_VENV, help="side virtualenv for TFRA")
    p.add_argument(
        "--tfra-timeout", type=float, default=1800, help="seconds for the TFRA job (default 1800)"
    )
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        p.error(f"--only: unknown system(s) {unknown}; expected a subset of {','.join(SYSTEMS)}")
    args.hidden_units = [int(u) for u in args.hidden.split(",") if u]
    return args


def warm_up() -> None:
    """Pays process-wide first-use costs (TF runtime, XLA service, Keras, tf.data) before any job."""
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    tf.function(lambda x: tf.matmul(x, x), jit_compile=True)(tf.ones([4, 4]))
    model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.fit(np.ones((64, 3), np.float32), np.ones(64, np.float32), batch_size=32, verbose=0)


def run_recflow(args, fusion: bool, work: str) -> dict:
    from recflow.config import load_config

    # A fresh model dir per run: an existing one would resume from its checkpoint.
    model_dir = tempfile.mkdtemp(prefix="fused-" if fusion else "unfused-", dir=work)
    overrides = common.deepfm_config(
        args.rows, args.eval_rows, seed=args.seed, batch_size=args.batch_size, epochs=args.epochs,
        dim=args.dim, hidden=args.hidden_units, lr=args.lr, fusion=fusion, model_dir=model_dir,
    )  # fmt: skip
    config = load_config(args.config, overrides)
    r = common.run_recflow(config, model_dir)
    from recflow.embedding.planner import plan_tables

    return {
        "job_seconds": r["job_seconds"], "train_examples_per_sec": r["examples_per_sec"],
        "auc": r["auc"], "fit_seconds": r["fit_seconds"], "eval_seconds": r["eval_seconds"],
        "build_seconds": r["build_seconds"], "physical_tables": len(plan_tables(config, True)),
    }  # fmt: skip


def run_deepctr(args, train, evaluation) -> dict:
    r = common.run_deepctr(
        train, evaluation, dim=args.dim, hidden=args.hidden_units, batch_size=args.batch_size,
        epochs=args.epochs, lr=args.lr, seed=args.seed,
    )  # fmt: skip
    return {
        "job_seconds": r["job_seconds"], "train_examples_per_sec": r["fit_examples_per_sec"],
        "auc": r["auc"], "fit_seconds": r["fit_seconds"], "eval_seconds": r["eval_seconds"],
        "prep_seconds": r["prep_seconds"],
    }  # fmt: skip


def run_tfra(args, train, evaluation, work: str) -> dict:
    import numpy as np

    from recflow.training.metrics import auc

    python = common.tfra_python(args.tfra_venv)
    paths = [os.path.join(work, n) for n in ("train.npz", "eval.npz", "scores.npy")]
    common.write_npz(paths[0], train)
    common.write_npz(paths[1], evaluation)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tfra_deepfm.py")
    cmd = [
        python, script, "--train", paths[0], "--eval", paths[1], "--scores", paths[2],
        "--dim", str(args.dim), "--hidden", args.hidden, "--batch-size", str(args.batch_size),
        "--epochs", str(args.epochs), "--lr", str(args.lr), "--seed", str(args.seed),
    ]  # fmt: skip
    began = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tfra_timeout)
    except subprocess.TimeoutExpired:
        raise common.Unavailable(
            f"tfra_deepfm.py ran past --tfra-timeout {args.tfra_timeout:.0f}s"
        ) from None
    wall = time.perf_counter() - began
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"bench": "tfra_deepfm"')]
    if done.returncode != 0 or not lines:
        raise common.Unavailable(
            f"tfra_deepfm.py exit {done.returncode}: {common._last_error_line(done.stderr + done.stdout)}"
        )
    r = json.loads(lines[-1])
    return {
        "job_seconds": r["job_seconds"], "train_examples_per_sec": r["fit_examples_per_sec"],
        "auc": auc(evaluation[common.LABEL], np.load(paths[2])), "fit_seconds": r["fit_seconds"],
        "eval_seconds": r["eval_seconds"], "process_seconds": wall,
        "versions": f"tensorflow {r['tensorflow']}, tfra {r['tfra']}",
    }  # fmt: skip


def run_system(system: str, args, train, evaluation, work: str) -> dict:
    if system.startswith("recflow"):
        return run_recflow(args, system == "recflow_fused", work)
    if system == "deepctr":
        return run_deepctr(args, train, evaluation)
    return run_tfra(args, train, evaluation, work)


def child(args) -> int:
    """One job of one system in this (fresh) process; prints its result as a JSON line."""
    work = tempfile.mkdtemp(prefix="recflow-bench-train-")
    try:
        train, evaluation, oracle = common.criteo_data(args.rows, args.eval_rows, args.seed)
        if args.child != "tfra":
            warm_up()
        try:
            result = run_system(args.child, args, train, evaluation, work)
        except common.Unavailable as e:
            result = {"unavailable": str(e)}
        except ImportError as e:
            result = {"unavailable": f"{type(e).__name__}: {e}".splitlines()[0]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    common.emit_json("train_child", system=args.child, oracle_auc=oracle, **result)
    return 0


def spawn(system: str, argv: list[str]) -> dict:
    """Runs `child` for `system` in a new process: every job starts cold, as a real job does."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", system]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"bench": "train_child"')]
    if done.returncode != 0 or not lines:
        error = common._last_error_line(done.stderr + done.stdout)
        return {"unavailable": f"bench_train child exit {done.returncode}: {error}"}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child(args)
    results: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    oracle = float("nan")
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for repeat in range(args.repeats):  # systems interleaved, so drift hits all alike
        for system in SYSTEMS:
            if system not in args.systems or system in unavailable:
                continue
            label = f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"running {system}{label} ...", flush=True)
            r = spawn(system, argv)
            oracle = r.get("oracle_auc", oracle)
            if "unavailable" in r:
                unavailable[system] = r["unavailable"]
                print(f"  {system}: unavailable: {unavailable[system]}", flush=True)
                continue
            runs[system].append(r)
            print(f"  {r['job_seconds']:.1f}s, auc {r['auc']:.4f}", flush=True)
    for system, done in runs.items():
        if done:  # the run with the median job time; all job times alongside
            ordered = sorted(done, key=lambda r: r["job_seconds"])
            results[system] = {k: v for k, v in ordered[(len(ordered) - 1) // 2].items()
                               if k not in ("bench", "system", "oracle_auc")}  # fmt: skip
            results[system]["job_seconds_all"] = [r["job_seconds"] for r in done]

    examples = args.rows * args.epochs
    fused = results.get("recflow_fused")
    rows = []
    for system in SYSTEMS:
        if system in results:
            r = results[system]
            speedup = common.ratio(r["job_seconds"], fused["job_seconds"]) if fused else None
            rows.append([system, r["job_seconds"], examples / r["job_seconds"],
                         r["train_examples_per_sec"], r["auc"], speedup])  # fmt: skip
        elif system in unavailable:
            rows.append([system, None, None, None, None, None])
    print()
    common.print_table(
        ["system", "job s", "job ex/s", "train ex/s", "eval auc", "fused speedup"], rows,
        title=f"DeepFM, {args.rows} rows x {args.epochs} epoch(s), batch {args.batch_size}, dim {args.dim}, "
        f"hidden {args.hidden_units}, Adam lr {args.lr}, oracle auc {oracle:.4f}"
        + (f", median of {args.repeats} runs" if args.repeats > 1 else ""),
    )  # fmt: skip
    for system, message in unavailable.items():
        print(f"{system}: unavailable: {message}")

    ratios, checks = {}, {}
    if fused:
        for other, target in TARGETS.items():
            if other in results:
                value = results[other]["job_seconds"] / fused["job_seconds"]
                name = "fused_vs_" + other.replace("recflow_", "")
                ratios[name] = value
                checks[name] = {"target": target, "pass": value >= target}
        if "deepctr" in results:
            gap = fused["auc"] - results["deepctr"]["auc"]
            ratios["auc_gap_vs_deepctr"] = gap
            checks["auc_gap_vs_deepctr"] = {"target": -AUC_TOLERANCE, "pass": gap >= -AUC_TOLERANCE}
    if checks:
        print("\ntargets (fused speedup = other job s / fused job s):")
        for name, c in checks.items():
            value = f"{ratios[name]:+.4f}" if name.startswith("auc") else f"{ratios[name]:.2f}x"
            verdict = "PASS" if c["pass"] else "FAIL"
            print(f"  {name:<22} {value:>8}  (target >= {c['target']}): {verdict}")
    common.emit_json(
        "train", rows=args.rows, eval_rows=args.eval_rows, batch_size=args.batch_size,
        epochs=args.epochs, dim=args.dim, hidden=args.hidden_units, lr=args.lr, oracle_auc=oracle,
        repeats=args.repeats, systems=results, unavailable=unavailable, **ratios,
        passed={k: c["pass"] for k, c in checks.items()},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
