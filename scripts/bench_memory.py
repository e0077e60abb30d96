"""Memory per key of one embedding table: steady, and the peaks of a rebuild, a checkpoint save
and a restore.

Each measurement runs in a fresh child process, so their peaks are separate. A
child builds an `EmbeddingEngine` with one table (dim `--dim`, Adagrad, ttl
eviction and admission, `expected_keys` = the key count, so the table never grows
while it is filled), fills it with N rows and N/4 admission counters, then runs
one operation:

    rebuild    `engine.rebuild` at a step where half the rows and three quarters of
               the counters are stale (ttl) or belong to admitted keys: what eviction
               does at every checkpoint
    tracked    the same through `lifecycle.evict_tracked`, which also reports the
               evicted ids (what a run with a delta chain does)
    save       `tf.train.Checkpoint.write` of the engine
    restore    a new engine restoring that checkpoint through `EmbeddingEngine.restore`,
               as every restore path does (the restore child fills nothing)

Bytes per key are RSS growth over the key count, the baseline being the RSS after
TensorFlow ran the same operations on a small table and before the measured table
was created:

    steady   RSS after filling (after gc and malloc_trim), minus the baseline
    peak     the high-water mark of RSS during the operation (VmHWM, reset right
             before it through /proc/self/clear_refs), minus the baseline
    ideal    16-byte key + 4 * (dim * 2 + 2) bytes of row

Target: every peak at most 1.5x steady.

Usage (defaults: 1M and 10M keys, dim 16):
    python scripts/bench_memory.py
    python scripts/bench_memory.py --keys 1000000 --dim 16 --ops rebuild,save

Prints a Markdown table; last line: {"bench": "memory", "results": [{...}, ...], ...}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)

TARGET = 1.5
OPS = ("rebuild", "tracked", "save", "restore")
TTL = 500  # rows last seen at step 1 are stale at step STEP; those seen at STEP are not
STEP = 1000
CHUNK = 1 << 15  # keys per insert while filling (small: few freed transients stay resident)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default="1000000,10000000", help="comma-separated key counts")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {','.join(OPS)}")
    p.add_argument("--child", metavar="OP", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)  # the checkpoint of save / restore
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- child


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _trimmed_rss() -> int:
    """RSS after gc and malloc_trim(0): freed arrays the allocator kept are handed back."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _status("VmRSS")


def _reset_peak() -> None:
    """Resets VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _engine(keys: int, dim: int):
    from recflow.config import config_from_dict
    from recflow.embedding.engine import EmbeddingEngine

    table = {
        "dim": dim,
        "optimizer": {"type": "adagrad"},
        "eviction": {"ttl_steps": TTL},
        "admission": {"min_count": 2},
        "expected_keys": keys,
    }
    config = config_from_dict(
        {
            "data": {"format": "synthetic", "label": "click"},
            "features": [{"name": "item", "kind": "categorical", "dtype": "int64", "table": "t"}],
            "tables": {"t": table},
            "model": {"type": "deepfm"},
        }
    )
    return EmbeddingEngine(config)


def _fill(engine, keys: int, seed: int = 7) -> None:
    """N rows (every other one last seen at step 1, the rest at `STEP`) and N/4 counters:
    N/8 of keys that have a row (stale), N/8 waiting (half of them idle past the ttl)."""
    import tensorflow as tf

    from recflow.features.keys import encode

    table = engine.physical_tables[0]
    layout = table.layout
    done = 0
    while done < keys:
        n = min(CHUNK, keys - done)
        seed_pair = tf.constant([seed, done], tf.int64)
        keys_ = encode(tf.random.stateless_uniform([n], seed_pair, None, None, tf.int64), 0)
        last = tf.where(tf.range(done, done + n) % 2 == 0, 1, STEP)
        emb = tf.random.stateless_normal([n, layout.dim], seed_pair)
        slots = tf.random.stateless_uniform([n, layout.slots_width], seed_pair, 0.1, 1.0)
        table.rows.insert(keys_, layout.pack(emb, slots, tf.fill([n], 3), last))
        stale = keys_[: n // 8]  # counters left behind by admitted keys
        waiting = encode(
            tf.random.stateless_uniform([n // 8], seed_pair + 1, None, None, tf.int64), 0
        )
        counter_keys = tf.concat([stale, waiting], 0)
        seen_last = tf.stack([tf.ones_like(counter_keys[:, 0], tf.int32),
                              tf.where(tf.range(tf.shape(counter_keys)[0]) % 2 == 0, 1, STEP)], 1)  # fmt: skip
        table.counters.insert(counter_keys, seen_last)
        done += n


def _buckets(engine) -> int:
    """Buckets of every segment of the table's rows."""
    import tensorflow as tf

    rows = engine.physical_tables[0].rows
    return sum(int(tf.shape(t.export()[0])[0]) for shard in rows.shards for t in shard)


def child(args) -> dict:
    import tensorflow as tf

    from recflow.embedding import lifecycle

    keys = int(args.keys)
    # Warm up: the same operations on a small table (kernels, traces, allocator arenas).
    scratch = _engine(1024, args.dim)
    _fill(scratch, 1024)
    scratch.rebuild(STEP)
    lifecycle.evict_tracked(scratch, STEP)
    with tempfile.TemporaryDirectory() as tmp:
        path = tf.train.Checkpoint(embedding=scratch).write(os.path.join(tmp, "ckpt"))
        small = _engine(1024, args.dim)
        small.restore(tf.train.Checkpoint(embedding=small), path).expect_partial()
    del scratch
    before = _trimmed_rss()
    engine = _engine(keys, args.dim)
    path = os.path.join(args.dir, "ckpt")
    if args.child != "restore":
        _fill(engine, keys)
    steady = _trimmed_rss()
    out = {"op": args.child, "keys": keys, "width": engine.physical_tables[0].layout.width}
    _reset_peak()
    if args.child == "rebuild":
        engine.rebuild(STEP)
    elif args.child == "tracked":
        lifecycle.evict_tracked(engine, STEP)
    elif args.child == "save":
        tf.train.Checkpoint(embedding=engine).write(path)
    else:
        engine.restore(tf.train.Checkpoint(embedding=engine), path).expect_partial()
    peak = _status("VmHWM")
    after = _trimmed_rss()
    table = engine.physical_tables[0]
    if args.child == "restore":
        steady = after  # what the restored table holds
    out.update(
        rss_before=before, rss_steady=steady, rss_peak=peak, rss_after=after,
        rows=int(table.rows.size()), counters=int(table.counters.size()), buckets=_buckets(engine),
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- parent


def _run_child(op: str, keys: int, dim: int, directory: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", op, "--keys", str(keys),
           "--dim", str(dim), "--dir", directory]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(
            f"bench_memory: child {op} {keys} failed: {common._last_error_line(done.stderr)}"
        )
    return json.loads(lines[-1])


def markdown(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(common.fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if "restore" in ops and "save" not in ops:
        ops.insert(ops.index("restore"), "save")  # restore reads what save wrote
    counts = [int(k) for k in args.keys.split(",") if k.strip()]
    ideal = 16 + 4 * (2 * args.dim + 2)
    results = []
    for count in counts:
        with tempfile.TemporaryDirectory(prefix="bench_memory_") as directory:
            steady = None
            for op in ops:
                r = _run_child(op, count, args.dim, directory)
                base = r["rss_before"]
                r["steady_per_key"] = (r["rss_steady"] - base) / count
                r["peak_per_key"] = (r["rss_peak"] - base) / count
                if op != "restore":
                    steady = r["steady_per_key"]
                r["table_steady_per_key"] = steady
                r["peak_vs_steady"] = r["peak_per_key"] / steady
                results.append(r)
                print(
                    f"  {count:,} keys, {op}: steady {r['steady_per_key']:.0f} B/key, "
                    f"peak {r['peak_per_key']:.0f} B/key ({r['peak_vs_steady']:.2f}x)",
                    flush=True,
                )
    rows = [
        [r["keys"], r["op"], r["table_steady_per_key"], r["peak_per_key"], r["peak_vs_steady"],
         r["steady_per_key"] if r["op"] == "restore" else None, r["rows"], r["counters"]]
        for r in results
    ]  # fmt: skip
    print()
    print(f"dim {args.dim}, Adagrad: ideal {ideal} B/key (row and key); RSS growth per key")
    print()
    print(
        markdown(
            [
                "keys",
                "operation",
                "steady B/key",
                "peak B/key",
                "peak / steady",
                "after restore B/key",
                "rows after",
                "counters after",
            ],
            rows,
        )  # fmt: skip
    )
    worst = max(r["peak_vs_steady"] for r in results)
    print(f"\nworst peak {worst:.2f}x steady (target <= {TARGET}): "
          f"{'PASS' if worst <= TARGET else 'FAIL'}")  # fmt: skip
    common.emit_json(
        "memory", dim=args.dim, ideal=ideal, results=results, worst_peak_vs_steady=worst,
        target=TARGET, passed=worst <= TARGET,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
