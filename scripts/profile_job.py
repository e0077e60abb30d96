"""Where a whole `recflow train` job spends its time: one job under cProfile, a phase table.

Writes the Criteo-like CSV files (as scripts/bench_train.py does), then runs
`recflow train configs/criteo_bench.yaml --set data.format=csv ...` in this process
under cProfile and prints the cumulative seconds of the functions that make up each
phase. Phases nest (the trace is part of the train loop; every tf.function trace,
the data pipelines' included, is in "all tf.function traces"), so the column does
not add up to the total. cProfile slows Python-heavy phases (tracing) more than
TF-kernel-heavy ones.

Usage:
    python scripts/profile_job.py                       # 240k rows, 60k eval rows, 1 epoch
    python scripts/profile_job.py --epochs 3 --top 30   # + the 30 costliest functions

Last line: {"bench": "profile_job", "phases": {name: seconds}, "total_seconds": ...}
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402

# phase -> (file suffix, function name) candidates; the cumulative times of those found add up.
PHASES = {
    "import tensorflow": [("recflow/cli.py", "import_tensorflow")],
    "Trainer construction (model build)": [("recflow/training/trainer.py", "__init__")],
    "train (fit, all epochs)": [("recflow/training/trainer.py", "fit")],
    "  train pipeline build": [("recflow/training/trainer.py", "epoch_dataset")],
    "  input cache build (parse once)": [("recflow/data/cache.py", "_build")],
    "  train-step loop (incl. its trace)": [("recflow/training/trainer.py", "train_on")],
    "  train_step trace (Python)": [("recflow/models/base.py", "train_step")],
    "  final checkpoint": [("recflow/training/trainer.py", "finish")],
    "evaluation": [("recflow/training/trainer.py", "evaluate")],
    "export": [("recflow/training/model_dir.py", "export")],
    "all tf.function traces": [("polymorphic_function/tracing_compilation.py", "trace_function")],
    "all AutoGraph conversions": [("autograph/impl/api.py", "converted_call")],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=240_000)
    p.add_argument("--eval-rows", type=int, default=60_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--fusion", choices=["true", "false"], default="true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=0, help="also print the N costliest functions")
    return p.parse_args(argv)


def phase_seconds(stats: pstats.Stats) -> dict[str, float]:
    found = {}
    for phase, candidates in PHASES.items():
        total = None
        for (file, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
            if name in [n for f, n in candidates if file.endswith(f)]:
                # A recursive function appears once; nested tf.functions re-enter the tracer.
                total = max(total or 0.0, ct) if phase.startswith("all ") else (total or 0.0) + ct
        if total is not None:
            found[phase] = total
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="recflow-profile-")
    try:
        train, evaluation, _ = common.criteo_data(args.rows, args.eval_rows)
        paths = common.write_csv(os.path.join(work, "data"), train, evaluation)
        del train, evaluation
        overrides = common.deepfm_config(
            args.rows, args.eval_rows, batch_size=args.batch_size, epochs=args.epochs,
            dim=args.dim, fusion=args.fusion == "true", model_dir=os.path.join(work, "run"), csv=paths,
        )  # fmt: skip
        argv = ["train", os.path.join(common.REPO, "configs", "criteo_bench.yaml"), "--quiet"]
        for item in overrides + args.set:
            argv += ["--set", item]
        from recflow import cli

        profiler = cProfile.Profile()
        began = time.perf_counter()
        profiler.enable()
        code = cli.main(argv)
        profiler.disable()
        total = time.perf_counter() - began
        if code != 0:
            print(f"recflow train exited {code}", file=sys.stderr)
            return code
        stats = pstats.Stats(profiler)
        phases = phase_seconds(stats)
        rows = [[name, seconds] for name, seconds in phases.items()]
        rows.append(["total (under the profiler)", total])
        print()
        common.print_table(["phase", "seconds"], rows, title="recflow train, one job under cProfile")
        if args.top:
            print()
            stats.sort_stats("cumulative").print_stats(args.top)
        common.emit_json("profile_job", phases=phases, total_seconds=total)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
