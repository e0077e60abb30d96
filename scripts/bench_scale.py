"""Cost curve of the DeepFM job: seconds per row as rows grow, bytes per key as keys grow.

Every point is one whole `recflow train` job (configs/criteo_bench.yaml: DeepFM on
26 string + 13 numeric Criteo-like columns, Adam, batch 4096, 1 epoch, CSV input) in a
fresh process, timed from its metrics.json `timing` and measured from outside
(peak RSS: the child's `ru_maxrss` from `os.wait4`).

rows axis   0.25M, 1M and 4M training rows (`--rows`). The rows are the synthetic
            Criteo set written in chunks of up to 1M rows, each chunk its own seed, so
            4M rows are 4M generated rows, not one chunk repeated. Reported: whole-job
            and training-loop seconds per 100k rows. Target: the training loop's
            seconds per row at the largest size within 1.2x of the smallest.
keys axis   0.2M, 2M and 20M distinct keys (`--keys`) of one more feature, `ids`
            (multi_hot, `--ids-per-row` ids per row, its own table of dim 8 with
            Adagrad, not fused with the others), over the same `--key-rows` rows for
            every point: row r holds ids (r * K + j) mod N, j < K, so exactly N distinct
            ids appear, each equally often. Reported per point:
              steady B/key   the `ids` table's bucket arrays (`num_buckets` x
                             (16-byte key + 4 x row width)) / its keys, after training
              ideal B/key    16-byte key + 4 x (dim x (1 + slots) + 2 metadata)
              marginal peak  (peak RSS - peak RSS of the smallest point) / extra keys:
                             what each further key costs the process at its peak
              ckpt s/M keys  a fresh process restores the engine and writes one
                             checkpoint of it (`tf.train.Checkpoint.write`), timed
            Target: steady bytes per key at the largest size within 1.4x of ideal.

Output: a text table, `--out` (default bench_scale.md) with the Markdown tables,
`--chart` (default bench_scale.png) with the two curves, then the JSON last line.

Usage:
    python scripts/bench_scale.py                                   # the full curve (~25 min)
    python scripts/bench_scale.py --rows 20000,80000 --keys 20000,200000 --key-rows 20000

Last line: {"bench": "scale", "rows": [...], "keys": [...], "passed": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)

ROW_TARGET = 1.2  # training-loop seconds per row, largest vs smallest row count
KEY_TARGET = 1.4  # steady table bytes per key vs ideal, largest key count
CHUNK = 1_000_000  # rows generated per seed
EVAL_ROWS = 20_000
KEY_BYTES = 16  # recflow.embedding.rows.KEY_BYTES
IDS_DIM = 8
IDS_SLOTS = 1  # Adagrad: one slot per value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="250000,1000000,4000000", help="rows axis (comma-separated)")
    p.add_argument("--keys", default="200000,2000000,20000000", help="keys axis (comma-separated)")
    p.add_argument("--key-rows", type=int, default=400_000, help="rows of every keys-axis job")
    p.add_argument("--ids-per-row", type=int, default=50, help="ids of the `ids` feature per row")
    p.add_argument("--data-dir", default=None, help="keep the generated CSV files here (reused)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    p.add_argument("--out", default="bench_scale.md")
    p.add_argument("--chart", default="bench_scale.png")
    p.add_argument("--checkpoint-child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def sizes(text: str) -> list[int]:
    return sorted(int(float(s)) for s in text.split(",") if s.strip())


# ----------------------------------------------------------------------------- data


def write_rows(path: str, rows: int, ids: tuple[int, int] | None = None) -> str:
    """`rows` Criteo-like training rows in chunks of CHUNK (seed 7 + chunk), with an
    `ids` column of (K, N) ids per row when `ids` is given. Reused when present."""
    if os.path.exists(path):
        return path
    from recflow.data.writer import write_columns

    tmp = path + ".part"
    written = 0
    with open(tmp, "w", encoding="utf-8") as out:
        for chunk, start in enumerate(range(0, rows, CHUNK)):
            n = min(CHUNK, rows - start)
            train, _, _ = common.criteo_data(n, 1, seed=7 + chunk)
            train = dict(train)
            if ids is not None:
                k, distinct = ids
                first = (np.arange(start, start + n, dtype=np.int64) * k)[:, None]
                values = (first + np.arange(k, dtype=np.int64)) % distinct
                train["ids"] = np.array(["|".join(map(str, r)) for r in values.tolist()], dtype=object)
            part = f"{tmp}.{chunk}"
            write_columns(part, train, "csv", labels=[common.LABEL])
            with open(part, encoding="utf-8") as f:
                header = f.readline()
                if chunk == 0:
                    out.write(header)
                shutil.copyfileobj(f, out)
            os.remove(part)
            written += n
    os.replace(tmp, path)
    return path


def write_eval(path: str, ids: bool) -> str:
    if os.path.exists(path):
        return path
    from recflow.data.writer import write_columns

    _, evaluation, _ = common.criteo_data(1, EVAL_ROWS, seed=7)
    evaluation = dict(evaluation)
    if ids:
        evaluation["ids"] = np.array([str(i) for i in range(EVAL_ROWS)], dtype=object)
    write_columns(path + ".part", evaluation, "csv", labels=[common.LABEL])
    os.replace(path + ".part", path)
    return path


# ----------------------------------------------------------------------------- jobs


def run_job(config: str, train_csv: str, eval_csv: str, model_dir: str, timeout: float) -> dict:
    """One `recflow train` process: its metrics.json plus `job_seconds` and `peak_rss`
    (the child's own `ru_maxrss`, from `os.wait4`)."""
    overrides = common.deepfm_config(rows=0, eval_rows=0, model_dir=model_dir, csv=(train_csv, eval_csv))
    command = [sys.executable, "-m", "recflow.cli", "train", config, "--quiet"]
    for item in overrides:
        command += ["--set", item]
    log = os.path.join(os.path.dirname(model_dir), os.path.basename(model_dir) + ".log")
    began = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        child = subprocess.Popen(command, cwd=common.REPO, stdout=out, stderr=subprocess.STDOUT)
        timer = threading.Timer(timeout, child.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)
        finally:
            timer.cancel()
    seconds = time.perf_counter() - began
    child.returncode = code = os.waitstatus_to_exitcode(status)
    if code:
        with open(log, encoding="utf-8") as f:
            raise common.Unavailable(f"recflow train exit {code}: {common._last_error_line(f.read())}")
    with open(os.path.join(model_dir, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    metrics["job_seconds"] = seconds
    metrics["peak_rss"] = usage.ru_maxrss * 1024
    return metrics


def ids_config(path: str, k: int) -> str:
    """configs/criteo_bench.yaml plus the `ids` feature and its own Adagrad table."""
    import yaml

    with open(os.path.join(common.REPO, "configs", "criteo_bench.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["features"].append({"name": "ids", "kind": "multi_hot", "column": "ids", "max_values": k, "table": "ids"})
    raw.setdefault("tables", {})["ids"] = {"dim": IDS_DIM, "optimizer": {"type": "adagrad", "learning_rate": 0.05}}
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


def checkpoint_child(model_dir: str) -> int:
    """Restores the engine of `model_dir`, writes one checkpoint of it, prints the JSON."""
    import tensorflow as tf

    from recflow.training.tables import restore_engine

    engine = restore_engine(model_dir)
    keys = sum(s["keys"] for s in engine.table_stats().values())
    arrays = {}
    for table in engine.physical_tables:
        buckets = sum(table.rows.num_buckets(i) for i in range(table.rows.num_shards))
        for spec in table.spec.logical:
            arrays[spec.name] = {
                "physical_buckets": buckets,
                "physical_keys": int(table.rows.size().numpy()),
                "width": table.layout.width,
            }
    holder = tf.Module()
    holder.embedding = engine
    target = tempfile.mkdtemp(prefix="bench-scale-ckpt-")
    try:
        began = time.perf_counter()
        tf.train.Checkpoint(model=holder).write(os.path.join(target, "ckpt"))
        seconds = time.perf_counter() - began
    finally:
        shutil.rmtree(target, ignore_errors=True)
    print(json.dumps({"keys": keys, "checkpoint_seconds": seconds, "arrays": arrays}))
    return 0


def checkpoint_probe(model_dir: str, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--checkpoint-child", model_dir],
        cwd=common.REPO, capture_output=True, text=True, timeout=timeout,
    )
    if done.returncode:
        raise common.Unavailable(f"checkpoint probe: {common._last_error_line(done.stderr + done.stdout)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- axes


def rows_axis(args, work: str) -> list[dict]:
    data = args.data_dir or work
    eval_csv = write_eval(os.path.join(data, "eval.csv"), ids=False)
    results = []
    for rows in sizes(args.rows):
        train_csv = write_rows(os.path.join(data, f"train_{rows}.csv"), rows)
        config = os.path.join(common.REPO, "configs", "criteo_bench.yaml")
        m = run_job(config, train_csv, eval_csv, os.path.join(work, f"rows_{rows}"), args.timeout)
        timing = m["timing"]
        trained = m.get("examples") or rows
        results.append({
            "rows": rows,
            "job_seconds": m["job_seconds"],
            "train_seconds": timing["train"],
            "job_s_per_100k": 1e5 * m["job_seconds"] / trained,
            "train_s_per_100k": 1e5 * timing["train"] / trained,
            "peak_rss_gb": m["peak_rss"] / 1e9,
            "auc": m.get("auc"),
        })
        shutil.rmtree(os.path.join(work, f"rows_{rows}"), ignore_errors=True)
    return results


def keys_axis(args, work: str) -> list[dict]:
    data = args.data_dir or work
    eval_csv = write_eval(os.path.join(data, "eval_ids.csv"), ids=True)
    k = args.ids_per_row
    config = ids_config(os.path.join(work, "criteo_ids.yaml"), k)
    ideal = KEY_BYTES + 4 * (IDS_DIM * (1 + IDS_SLOTS) + 2)
    results = []
    for distinct in sizes(args.keys):
        if distinct > args.key_rows * k:
            raise SystemExit(f"--keys {distinct}: more than --key-rows x --ids-per-row ids")
        train_csv = write_rows(os.path.join(data, f"train_ids_{distinct}.csv"), args.key_rows, (k, distinct))
        model_dir = os.path.join(work, f"keys_{distinct}")
        m = run_job(config, train_csv, eval_csv, model_dir, args.timeout)
        probe = checkpoint_probe(model_dir, args.timeout)
        arrays = probe["arrays"]["ids"]
        steady = arrays["physical_buckets"] * (KEY_BYTES + 4 * arrays["width"]) / arrays["physical_keys"]
        results.append({
            "keys": distinct,
            "ids_keys": arrays["physical_keys"],
            "steady_bytes_per_key": steady,
            "ideal_bytes_per_key": ideal,
            "steady_vs_ideal": steady / ideal,
            "peak_rss_gb": m["peak_rss"] / 1e9,
            "all_keys": probe["keys"],
            "checkpoint_seconds": probe["checkpoint_seconds"],
            "checkpoint_s_per_m_keys": 1e6 * probe["checkpoint_seconds"] / max(probe["keys"], 1),
            "train_s_per_100k": 1e5 * m["timing"]["train"] / (m.get("examples") or args.key_rows),
        })
        shutil.rmtree(model_dir, ignore_errors=True)
    base = results[0]
    for r in results[1:]:
        extra_keys = r["all_keys"] - base["all_keys"]
        if r["peak_rss_gb"] and base["peak_rss_gb"] and extra_keys > 0:
            r["marginal_peak_bytes_per_key"] = 1e9 * (r["peak_rss_gb"] - base["peak_rss_gb"]) / extra_keys
    return results


# ----------------------------------------------------------------------------- report


def report(args, rows: list[dict], keys: list[dict]) -> dict:
    row_ratio = rows[-1]["train_s_per_100k"] / rows[0]["train_s_per_100k"] if len(rows) > 1 else None
    key_ratio = keys[-1]["steady_vs_ideal"] if keys else None
    passed = {
        f"train time per row, {rows[-1]['rows']:,} vs {rows[0]['rows']:,} rows <= {ROW_TARGET}x": (
            row_ratio is not None and row_ratio <= ROW_TARGET
        ),
        f"steady bytes per key at {keys[-1]['keys']:,} keys <= {KEY_TARGET}x ideal": (
            key_ratio is not None and key_ratio <= KEY_TARGET
        ),
    }
    row_table = [
        [f"{r['rows']:,}", common.fmt(r["job_seconds"], 1), common.fmt(r["train_seconds"], 1),
         common.fmt(r["job_s_per_100k"], 2), common.fmt(r["train_s_per_100k"], 2),
         common.fmt(r["peak_rss_gb"], 2), common.fmt(r["auc"], 4)]
        for r in rows
    ]
    key_table = [
        [f"{r['keys']:,}", f"{r['ids_keys']:,}", common.fmt(r["steady_bytes_per_key"], 1),
         common.fmt(r["ideal_bytes_per_key"], 0), common.fmt(r["steady_vs_ideal"], 2),
         common.fmt(r.get("marginal_peak_bytes_per_key"), 0), common.fmt(r["peak_rss_gb"], 2),
         common.fmt(r["checkpoint_s_per_m_keys"], 2), common.fmt(r["train_s_per_100k"], 2)]
        for r in keys
    ]
    row_headers = ["rows", "job s", "train s", "job s/100k rows", "train s/100k rows", "peak RSS GB", "AUC"]
    key_headers = ["distinct ids", "ids keys", "steady B/key", "ideal B/key", "vs ideal",
                   "marginal peak B/key", "peak RSS GB", "ckpt s/M keys", "train s/100k rows"]
    common.print_table(row_headers, row_table, title="rows axis (1 epoch, CSV)")
    common.print_table(key_headers, key_table, title=f"keys axis ({args.key_rows:,} rows, {args.ids_per_row} ids per row)")
    for name, ok in passed.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(f"## Rows axis\n\n{_markdown(row_headers, row_table)}\n\n")
        f.write(f"## Keys axis ({args.key_rows:,} rows, {args.ids_per_row} ids per row)\n\n{_markdown(key_headers, key_table)}\n")
    _chart(args.chart, rows, keys)
    return {"row_ratio": row_ratio, "key_ratio": key_ratio, "passed": passed}


def _markdown(headers, table) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    return "\n".join(lines)


def _chart(path: str, rows: list[dict], keys: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{path}: not written (matplotlib is not installed)")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["rows"] for r in rows]
    left.plot(x, [r["train_s_per_100k"] for r in rows], "o-", label="training loop")
    left.plot(x, [r["job_s_per_100k"] for r in rows], "s--", label="whole job")
    left.set_xscale("log")
    left.set_xlabel("training rows")
    left.set_ylabel("seconds per 100k rows")
    left.set_ylim(bottom=0)
    left.legend()
    left.set_title("time per row")
    kx = [r["keys"] for r in keys]
    right.plot(kx, [r["steady_bytes_per_key"] for r in keys], "o-", label="steady (table arrays)")
    right.plot(kx, [r["ideal_bytes_per_key"] for r in keys], ":", label="ideal")
    marginal = [(r["keys"], r["marginal_peak_bytes_per_key"]) for r in keys if "marginal_peak_bytes_per_key" in r]
    if marginal:
        right.plot(*zip(*marginal), "s--", label="marginal peak RSS")
    right.set_xscale("log")
    right.set_xlabel("distinct ids")
    right.set_ylabel("bytes per key")
    right.set_ylim(bottom=0)
    right.legend()
    right.set_title("memory per key")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"{path}: written")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.checkpoint_child:
        return checkpoint_child(args.checkpoint_child)
    work = tempfile.mkdtemp(prefix="bench-scale-")
    if args.data_dir:
        os.makedirs(args.data_dir, exist_ok=True)
    try:
        rows = rows_axis(args, work)
        keys = keys_axis(args, work)
        summary = report(args, rows, keys)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    common.emit_json("scale", rows=rows, keys=keys, **summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
