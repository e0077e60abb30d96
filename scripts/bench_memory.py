"""Memory per key of recflow's embedding tables: measured RSS vs the ideal packed row.

For each optimizer, a fresh child process builds the engine's storage for one
physical table (a `ShardedTable` of `DenseHashTable` shards, row width from
`RowLayout(dim, optimizer slots)`), inserts `--keys` random keys in chunks, and
measures the growth of its resident set (VmRSS of /proc/self/status, after
gc) and the peak (VmHWM). It reports bytes per key against

    ideal       8-byte key + 4 * (dim * (1 + optimizer slots) + 2 metadata) bytes
    ideal emb   8-byte key + 4 * dim bytes (embedding only, what serving needs)
    buckets     DenseHashTable's own storage: buckets * (8 + 4 * width) bytes; the bucket
                count starts at 4096 and doubles whenever the load passes 0.8, so at
                N keys it is the power of two >= N / 0.8 (1.25x-2.5x the ideal)

Usage (defaults: 1,000,000 keys, dim 16, adagrad and adam):
    python scripts/bench_memory.py
    python scripts/bench_memory.py --keys 4000000 --dim 32 --optimizers sgd,adagrad,adam,ftrl

Last line: {"bench": "memory", "results": {optimizer: {...}}, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)

KEY_BYTES = 8
MAX_LOAD = 0.8  # DenseHashTable doubles its buckets past this load factor
INITIAL_BUCKETS = 1 << 12  # recflow.embedding.table.INITIAL_BUCKETS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000, help="keys to load (default 1000000)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    p.add_argument(
        "--optimizers", default="adagrad,adam",
        help="comma-separated, of sgd,adagrad,adam,ftrl (default adagrad,adam)",
    )  # fmt: skip
    p.add_argument("--chunk", type=int, default=1 << 17, help="keys per insert (default 131072)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--child", metavar="OPTIMIZER", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def expected_buckets(keys: int) -> int:
    buckets = INITIAL_BUCKETS
    while keys > MAX_LOAD * buckets:
        buckets *= 2
    return buckets


def child(args) -> dict:
    """Loads the keys into one table in this process; returns the measurements."""
    import gc

    import tensorflow as tf

    from recflow.config.schema import AdagradConfig, AdamConfig, FtrlConfig, SGDConfig
    from recflow.embedding.optimizers import make_optimizer
    from recflow.embedding.placement import ModPlacement
    from recflow.embedding.rows import RowLayout
    from recflow.embedding.table import ShardedTable

    configs = {"sgd": SGDConfig, "adagrad": AdagradConfig, "adam": AdamConfig, "ftrl": FtrlConfig}
    optimizer = make_optimizer(configs[args.child]())
    layout = RowLayout(args.dim, optimizer.num_slots)
    width = layout.width
    # Warm up TF (kernels, allocator) on a throwaway table before the baseline.
    scratch = ShardedTable("scratch", width, ModPlacement(1))
    scratch.insert(tf.constant([1, 2], tf.int64), tf.zeros([2, width]))
    del scratch
    table = ShardedTable("bench", width, ModPlacement(1))
    gc.collect()
    before = common.rss_bytes()
    began = time.perf_counter()
    done = 0
    while done < args.keys:
        n = min(args.chunk, args.keys - done)
        seed = tf.constant([args.seed, done], tf.int64)
        keys = tf.random.stateless_uniform([n], seed, 0, 1 << 55, dtype=tf.int64)
        values = tf.random.stateless_normal([n, width], seed)
        table.insert(keys, values)
        done += n
        del keys, values
    seconds = time.perf_counter() - began
    gc.collect()
    after = common.rss_bytes()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    # Freed bucket arrays of earlier doublings may stay in the allocator's heap: hand them back.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = common.rss_bytes()
    except (OSError, AttributeError):
        trimmed = after
    size = int(table.size())
    buckets = int(tf.size(table.shards[0].export()[0]))  # export returns every bucket
    return {
        "optimizer": args.child, "slots": optimizer.num_slots, "width": width, "keys": size,
        "rss_before": before, "rss_after": after, "rss_trimmed": trimmed, "rss_peak": peak, "buckets": buckets,
        "insert_seconds": seconds,
    }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    results = {}
    for name in optimizers:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--keys", str(args.keys),
               "--dim", str(args.dim), "--chunk", str(args.chunk), "--seed", str(args.seed)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            raise SystemExit(
                f"bench_memory: child for {name} failed: {common._last_error_line(done.stderr)}"
            )
        r = json.loads(lines[-1])
        keys, width = r["keys"], r["width"]
        grown = r["rss_after"] - r["rss_before"]
        r.update(
            bytes_per_key=grown / keys,
            trimmed_bytes_per_key=(r["rss_trimmed"] - r["rss_before"]) / keys,
            ideal_bytes_per_key=KEY_BYTES + 4 * width,
            ideal_emb_bytes_per_key=KEY_BYTES + 4 * args.dim,
            bucket_bytes_per_key=r["buckets"] * (KEY_BYTES + 4 * width) / keys,
            expected_buckets=expected_buckets(keys),
            load_factor=keys / r["buckets"],
            peak_bytes_per_key=(r["rss_peak"] - r["rss_before"]) / keys,
        )
        r["vs_ideal"] = r["bytes_per_key"] / r["ideal_bytes_per_key"]
        r["vs_ideal_emb"] = r["bytes_per_key"] / r["ideal_emb_bytes_per_key"]
        results[name] = r
        print(f"  {name}: {r['bytes_per_key']:.1f} bytes/key", flush=True)

    rows = [
        [n, r["width"], r["keys"], r["buckets"], r["load_factor"], r["bytes_per_key"],
         r["trimmed_bytes_per_key"], r["peak_bytes_per_key"], r["ideal_bytes_per_key"], r["bucket_bytes_per_key"],
         r["vs_ideal"], r["ideal_emb_bytes_per_key"], r["vs_ideal_emb"]]
        for n, r in results.items()
    ]  # fmt: skip
    print()
    common.print_table(
        ["optimizer", "row floats", "keys", "buckets", "load", "RSS B/key", "trimmed B/key", "peak B/key", "ideal B/key",
         "buckets B/key", "RSS/ideal", "emb ideal", "RSS/emb ideal"], rows,
        title=f"{args.keys:,} random keys, dim {args.dim}, one DenseHashTable shard "
        f"(row = emb + slots + 2 meta floats)",
    )  # fmt: skip
    print(
        f"\nbuckets B/key = buckets * (8 + 4 * row floats) / keys: DenseHashTable's arrays alone; "
        f"buckets double past load {MAX_LOAD}, so they are 1.25x-2.5x the ideal depending on where "
        f"N falls between powers of two (at {args.keys:,} keys: {expected_buckets(args.keys):,} buckets). "
        f"trimmed: RSS growth after malloc_trim(0), i.e. without freed arrays of earlier "
        f"doublings that the allocator kept; peak: VmHWM growth."
    )
    common.emit_json("memory", keys=args.keys, dim=args.dim, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
