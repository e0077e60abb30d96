"""recflow's DeepFM from a config alone vs DeepCTR's DeepFM, on the same Criteo-like rows.

Writes the synthetic Criteo-like rows (label, I1..I13 with empty values, C1..C26
hex strings with empty values) as CSV files to a temp dir, trains recflow from
configs/criteo_bench.yaml pointed at them (nothing else: hashing, normalizing,
embeddings and the model come from the config), trains DeepCTR's DeepFM on the
same rows (LabelEncoder vocabularies over train + eval, log1p numerics, the same
embedding dim, hidden units, Adam learning rate, batch size and epochs), and
scores both on the same eval rows with one AUC function
(`recflow.metrics.auc`).

One epoch of a few dozen large batches leaves a seed-to-seed AUC spread of about
+-0.005 for either system, so both train once per model seed (`--model-seeds`:
recflow's `train.seed`, DeepCTR's `seed`) and the verdict compares
the median AUCs (robust to one diverged run). The data seed (`--seed`) is fixed.

Usage (defaults: 200k train rows, 50k eval rows, batch / epochs / lr from the config):
    python scripts/compare_deepctr.py
    python scripts/compare_deepctr.py --rows 20000 --eval-rows 5000 --model-seeds 1

Prints a table and, last, one JSON line:
    {"bench": "compare_deepctr", "recflow_auc": MEDIAN, "deepctr_auc": MEDIAN, "auc_diff": ..., ...}

`--defaults`: recflow's *defaults* against DeepCTR's, on every synthetic schema
(demo, criteo, sequence). Each schema's shipped config (configs/deepfm_demo.yaml,
criteo_bench.yaml, din.yaml with model deepfm) loses every optimizer line (train.
optimizer, train.sparse_optimizer, tables.*.optimizer), so recflow runs on its
defaults; DeepCTR's DeepFM runs on its own (Adam 1e-3, l2 1e-5) with the same
features (same normalized numbers), vocabularies over train + eval, DNN units,
batch size and epochs. Target: recflow's median AUC at or above DeepCTR's on
every schema. `--set` overrides apply to recflow only (try other defaults):
    python scripts/compare_deepctr.py --defaults --rows 100000 --eval-rows 20000
    python scripts/compare_deepctr.py --defaults --set 'train.sparse_optimizer={type: adagrad}'
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
        "--model-seeds", default="1,2,3",
        help="comma-separated model seeds; each system trains once per seed (default 1,2,3)",
    )  # fmt: skip
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
        help="'no worse': median recflow AUC >= median DeepCTR AUC - this (default 0.001)",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides"
    )
    p.add_argument(
        "--defaults", action="store_true",
        help="recflow's defaults (no optimizer lines) vs DeepCTR's, on every synthetic schema",
    )  # fmt: skip
    p.add_argument(
        "--schemas", default="demo,criteo,sequence", help="with --defaults: the schemas to run"
    )
    p.add_argument(
        "--keep", metavar="DIR",
        help="write data and model dir here and keep them (use a new DIR per run: a model dir resumes)",
    )  # fmt: skip
    return p.parse_args(argv)


SCHEMA_CONFIGS = {  # schema -> (shipped config, overrides that make it a DeepFM)
    "demo": ("deepfm_demo.yaml", []),
    "criteo": ("criteo_bench.yaml", []),
    "sequence": ("din.yaml", ["model={type: deepfm, params: {dnn: {hidden_units: [64, 32]}}}"]),
}


def defaults_config(schema: str, args, seed: int, model_dir: str):
    """A schema's shipped config with every optimizer line removed (recflow's defaults)."""
    from recflow.config.loader import apply_overrides, config_from_dict, read_yaml

    name, extra = SCHEMA_CONFIGS[schema]
    raw = read_yaml(os.path.join(common.REPO, "configs", name))
    train = raw.setdefault("train", {})
    train.pop("optimizer", None)
    train.pop("sparse_optimizer", None)
    for table in (raw.get("tables") or {}).values():
        table.pop("optimizer", None)
    raw["task"] = {"type": "binary", "metrics": ["auc", "logloss"]}
    overrides = [
        *extra,
        "data.format=synthetic",
        f"data.synthetic={{rows: {args.rows}, eval_rows: {args.eval_rows}, seed: {args.seed}, "
        f"schema: {schema}}}",
        f"train.epochs={args.epochs or 1}",
        f"train.seed={seed}",
        f"train.model_dir={model_dir}",
        "train.checkpoint_every_steps=null",
        *([f"data.batch_size={args.batch_size}"] if args.batch_size else []),
        *args.set,
    ]
    return config_from_dict(apply_overrides(raw, overrides))


def run_defaults(args) -> int:
    """recflow's defaults vs DeepCTR's DeepFM defaults, median of the model seeds per schema."""
    import numpy as np

    from recflow.data.synthetic import generate

    seeds = [int(x) for x in args.model_seeds.split(",") if x.strip()]
    work = args.keep or tempfile.mkdtemp(prefix="recflow-defaults-")
    rows, results = [], {}
    try:
        for schema in [s.strip() for s in args.schemas.split(",") if s.strip()]:
            probe = defaults_config(schema, args, seeds[0], work)
            sparse = probe.sparse_optimizer(probe.table_names()[0])
            train, _ = generate(probe.data.synthetic, "train")
            evaluation, oracle = generate(probe.data.synthetic, "eval")
            rf, dc = [], []
            for seed in seeds:
                model_dir = os.path.join(work, f"{schema}-seed{seed}")
                config = defaults_config(schema, args, seed, model_dir)
                rf.append(common.run_recflow(config, model_dir)["auc"])
                dc.append(common.run_deepctr_config(config, train, evaluation, seed=seed)["auc"])
                print(f"{schema} seed {seed}: recflow {rf[-1]:.4f}  deepctr {dc[-1]:.4f}", flush=True)
            r, d = float(np.median(rf)), float(np.median(dc))
            results[schema] = {"recflow": rf, "deepctr": dc, "oracle": oracle}
            rows.append([schema, f"{sparse.type} {sparse.learning_rate:g}", r, d, r - d, oracle,
                         "PASS" if r >= d else "FAIL"])  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    common.print_table(
        ["schema", "recflow sparse opt", "recflow auc", "deepctr auc", "diff", "oracle", "target"],
        rows,
        title=f"defaults, DeepFM, {args.rows} rows x {args.epochs or 1} epoch(s), "
        f"median of model seeds {seeds}",
    )
    common.emit_json(
        "compare_deepctr_defaults", rows=args.rows, eval_rows=args.eval_rows, model_seeds=seeds,
        overrides=args.set, results=results, all_pass=all(row[-1] == "PASS" for row in rows),
    )  # fmt: skip
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.defaults:
        return run_defaults(args)
    import numpy as np

    from recflow.config import load_config

    seeds = [int(x) for x in args.model_seeds.split(",") if x.strip()]

    work = args.keep or tempfile.mkdtemp(prefix="recflow-compare-")
    os.makedirs(work, exist_ok=True)
    try:
        began = time.perf_counter()
        train, evaluation, oracle = common.criteo_data(args.rows, args.eval_rows, args.seed)
        overrides = []
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

        recflow_runs, deepctr_runs = [], []
        for seed in seeds:
            model_dir = os.path.join(work, f"model-seed{seed}")
            seeded = load_config(
                args.config,
                [*overrides, *args.set, f"train.seed={seed}", f"train.model_dir={model_dir}"],
            )
            rf = common.run_recflow(seeded, model_dir, export=True)
            dc = common.run_deepctr(train, evaluation, l2=args.deepctr_l2, seed=seed, **shared)
            print(
                f"seed {seed}: recflow auc {rf['auc']:.4f} ({rf['job_seconds']:.1f}s), "
                f"deepctr auc {dc['auc']:.4f} ({dc['job_seconds']:.1f}s)",
                flush=True,
            )
            recflow_runs.append(rf)
            deepctr_runs.append(dc)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    def mean(runs, key):
        return float(np.mean([r[key] for r in runs]))

    examples = args.rows * shared["epochs"]
    rf_aucs, dc_aucs = [r["auc"] for r in recflow_runs], [r["auc"] for r in deepctr_runs]
    rf_auc, dc_auc = float(np.median(rf_aucs)), float(np.median(dc_aucs))
    rf_job, dc_job = mean(recflow_runs, "job_seconds"), mean(deepctr_runs, "job_seconds")
    rf_eps, dc_eps = (
        mean(recflow_runs, "examples_per_sec"),
        mean(deepctr_runs, "fit_examples_per_sec"),
    )
    diff = rf_auc - dc_auc
    rows = [
        ["recflow (config only)", rf_auc, float(np.mean(rf_aucs)), min(rf_aucs), max(rf_aucs),
         rf_job, examples / rf_job, rf_eps],
        ["deepctr DeepFM", dc_auc, float(np.mean(dc_aucs)), min(dc_aucs), max(dc_aucs),
         dc_job, examples / dc_job, dc_eps],
    ]  # fmt: skip
    print()
    common.print_table(
        ["system", "median auc", "mean auc", "min auc", "max auc", "job s", "job ex/s",
         "train ex/s"], rows,
        title=f"DeepFM, {args.rows} rows x {shared['epochs']} epoch(s), batch {shared['batch_size']}, "
        f"dim {shared['dim']}, hidden {list(hidden)}, Adam lr {lr}; model seeds {seeds} "
        "(times: means)",
    )  # fmt: skip
    no_worse = diff >= -args.tolerance
    print(
        f"\nauc diff (recflow - deepctr, medians): {diff:+.4f}   per seed: "
        + ", ".join(f"{r['auc'] - d['auc']:+.4f}" for r, d in zip(recflow_runs, deepctr_runs))
        + f"   oracle auc {oracle:.4f}"
    )
    print(f"no worse than DeepCTR (tolerance {args.tolerance}): {'PASS' if no_worse else 'FAIL'}")
    print(
        "job = build + train + eval (recflow also exports; DeepCTR also label-encodes); "
        "train ex/s: recflow trainer's examples_per_sec, DeepCTR's fit() only"
    )
    rf_parts = {k: mean(recflow_runs, f"{k}_seconds") for k in ("build", "fit", "eval", "export")}
    dc_parts = {k: mean(deepctr_runs, f"{k}_seconds") for k in ("prep", "build", "fit", "eval")}
    print(
        "mean seconds: recflow "
        + ", ".join(f"{k} {v:.1f}" for k, v in rf_parts.items())
        + "; deepctr "
        + ", ".join(f"{k} {v:.1f}" for k, v in dc_parts.items())
        + " (prep = LabelEncoder + log1p)"
    )
    common.emit_json(
        "compare_deepctr",
        rows=args.rows, eval_rows=args.eval_rows, source=args.source, **shared, model_seeds=seeds,
        recflow_auc=rf_auc, deepctr_auc=dc_auc, auc_diff=diff, oracle_auc=oracle,
        recflow_aucs=rf_aucs, deepctr_aucs=dc_aucs,
        seeds_recflow_no_worse=sum(r >= d - args.tolerance for r, d in zip(rf_aucs, dc_aucs)),
        recflow_logloss=mean(recflow_runs, "logloss"),
        recflow_job_seconds=rf_job, deepctr_job_seconds=dc_job,
        recflow_examples_per_sec=rf_eps, deepctr_examples_per_sec=dc_eps,
        recflow_seconds=rf_parts, deepctr_seconds=dc_parts,
        deepctr_l2=args.deepctr_l2, tolerance=args.tolerance, no_worse=no_worse,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
