"""recflow's DeepFM from a config alone vs DeepCTR's DeepFM, on the same Criteo-like rows.

Writes the synthetic Criteo-like rows (label, I1..I13 with empty values, C1..C26
hex strings with empty values) as CSV files to a temp dir, trains recflow from
configs/criteo_bench.yaml pointed at them (nothing else: hashing, normalizing,
embeddings and the model come from the config), trains DeepCTR's DeepFM on the
same rows (LabelEncoder vocabularies over train + eval, log1p numerics, the same
embedding dim, hidden units, Adam learning rate, batch size and epochs), and
scores both on the same eval rows with one AUC function
(`recflow.training.metrics.auc`).

Usage (defaults: 200k train rows, 50k eval rows, batch / epochs / lr from the config):
    python scripts/compare_deepctr.py
    python scripts/compare_deepctr.py --rows 20000 --eval-rows 5000 --batch-size 1024

Prints a table and, last, one JSON line:
    {"bench": "compare_deepctr", "recflow_auc": ..., "deepctr_auc": ..., "auc_diff": ..., ...}
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="train rows (default 200000)")
    p.add_argument("--eval-rows", type=int, default=50_000, help="eval rows (default 50000)")
    p.add_argument("--seed", type=int, default=7, help="data seed (default 7)")
    p.add_argument(
        "--config", default=os.path.join(common.REPO, "configs", "criteo_bench.yaml"),
        help="recflow config (default configs/criteo_bench.yaml)",
    )  # fmt: skip
    p.add_argument(
        "--source", choices=["csv", "synthetic"], default="csv",
        help="csv: recflow reads CSV files written to a temp dir (default); "
        "synthetic: recflow reads the in-memory rows (format: synthetic)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, help="both systems (default: the config's)")
    p.add_argument("--epochs", type=int, help="both systems (default: the config's)")
    p.add_argument(
        "--lr", type=float, help="Adam learning rate, dense and sparse (default: the config's)"
    )
    p.add_argument(
        "--deepctr-l2", type=float, default=0.0,
        help="DeepCTR l2_reg_embedding / l2_reg_linear (default 0: recflow's objective; DeepCTR's own default is 1e-5)",
    )  # fmt: skip
    p.add_argument(
        "--tolerance", type=float, default=0.001,
        help="'no worse' allows recflow this much below DeepCTR's AUC (seed noise; default 0.001)",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides"
    )
    p.add_argument(
        "--keep", metavar="DIR",
        help="write data and model dir here and keep them (use a new DIR per run: a model dir resumes)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from recflow.config import load_config

    work = args.keep or tempfile.mkdtemp(prefix="recflow-compare-")
    os.makedirs(work, exist_ok=True)
    try:
        began = time.perf_counter()
        train, evaluation, oracle = common.criteo_data(args.rows, args.eval_rows, args.seed)
        overrides = [f"train.model_dir={os.path.join(work, 'model')}"]
        if args.source == "csv":
            train_csv, eval_csv = common.write_csv(os.path.join(work, "data"), train, evaluation)
            overrides += ["data.format=csv", f"data.train={train_csv}", f"data.eval={eval_csv}"]
        else:
            overrides += [
                "data.format=synthetic",
                f"data.synthetic={{rows: {args.rows}, eval_rows: {args.eval_rows}, "
                f"seed: {args.seed}, schema: criteo}}",
            ]
        if args.batch_size:
            overrides.append(f"data.batch_size={args.batch_size}")
        if args.epochs:
            overrides.append(f"train.epochs={args.epochs}")
        if args.lr:
            overrides.append(f"train.optimizer.learning_rate={args.lr}")
            overrides.append(f"train.sparse_optimizer.learning_rate={args.lr}")
        config = load_config(args.config, overrides + args.set)
        print(
            f"data: {args.rows} train / {args.eval_rows} eval rows ({args.source}), "
            f"oracle eval AUC {oracle:.4f}, prepared in {time.perf_counter() - began:.1f}s",
            flush=True,
        )

        # The DeepCTR side takes every shared setting from the resolved recflow config.
        dims = {config.table(f.table_name).dim for f in config.sparse_features}
        if len(dims) != 1:
            raise SystemExit(f"compare_deepctr: expected one embedding dim, got {sorted(dims)}")
        hidden = tuple(config.model.params.get("dnn", {}).get("hidden_units", (256, 128)))
        lr = config.train.optimizer.learning_rate
        shared = {
            "dim": dims.pop(), "hidden": hidden, "batch_size": config.data.batch_size,
            "epochs": config.train.total_epochs, "lr": lr,
        }  # fmt: skip
        sparse = config.train.sparse_optimizer
        print(
            f"shared: {shared}; recflow sparse optimizer {sparse.type} lr {sparse.learning_rate}",
            flush=True,
        )

        rf = common.run_recflow(config, config.train.model_dir, export=True)
        print(f"recflow done: auc {rf['auc']:.4f} in {rf['job_seconds']:.1f}s", flush=True)
        dc = common.run_deepctr(train, evaluation, l2=args.deepctr_l2, seed=args.seed, **shared)
        print(f"deepctr done: auc {dc['auc']:.4f} in {dc['job_seconds']:.1f}s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    examples = args.rows * shared["epochs"]
    diff = rf["auc"] - dc["auc"]
    rows = [
        ["recflow (config only)", rf["auc"], rf["job_seconds"], examples / rf["job_seconds"],
         rf["examples_per_sec"]],
        ["deepctr DeepFM", dc["auc"], dc["job_seconds"], examples / dc["job_seconds"],
         dc["fit_examples_per_sec"]],
    ]  # fmt: skip
    print()
    common.print_table(
        ["system", "eval auc", "job s", "job ex/s", "train ex/s"], rows,
        title=f"DeepFM, {args.rows} rows x {shared['epochs']} epoch(s), batch {shared['batch_size']}, "
        f"dim {shared['dim']}, hidden {list(hidden)}, Adam lr {lr}",
    )  # fmt: skip
    verdict = "PASS" if diff >= -args.tolerance else "FAIL"
    print(
        f"\nauc diff (recflow - deepctr): {diff:+.4f}   oracle auc {oracle:.4f}   "
        f"no worse than DeepCTR (tolerance {args.tolerance}): {verdict}"
    )
    print(
        "job = build + train + eval (recflow also exports; DeepCTR also label-encodes); "
        "train ex/s: recflow trainer's examples_per_sec, DeepCTR's fit() only"
    )
    print(
        f"recflow: build {rf['build_seconds']:.1f}s, fit {rf['fit_seconds']:.1f}s, "
        f"eval {rf['eval_seconds']:.1f}s, export {rf['export_seconds']:.1f}s; "
        f"deepctr: label-encode + log1p {dc['prep_seconds']:.1f}s, build {dc['build_seconds']:.1f}s, "
        f"fit {dc['fit_seconds']:.1f}s, predict {dc['eval_seconds']:.1f}s"
    )
    common.emit_json(
        "compare_deepctr",
        rows=args.rows, eval_rows=args.eval_rows, source=args.source, **shared,
        recflow_auc=rf["auc"], deepctr_auc=dc["auc"], auc_diff=diff, oracle_auc=oracle,
        recflow_logloss=rf.get("logloss"),
        recflow_job_seconds=rf["job_seconds"], deepctr_job_seconds=dc["job_seconds"],
        recflow_examples_per_sec=rf["examples_per_sec"],
        deepctr_examples_per_sec=dc["fit_examples_per_sec"],
        recflow_seconds={k: rf[f"{k}_seconds"] for k in ("build", "fit", "eval", "export")},
        deepctr_seconds={k: dc[f"{k}_seconds"] for k in ("prep", "build", "fit", "eval")},
        deepctr_l2=args.deepctr_l2, no_worse=diff >= -args.tolerance,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
