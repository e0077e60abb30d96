"""Admission counters under a stream of mostly one-off keys: flat with `ttl_steps`, growing without.

Streams `--steps` batches of `--batch` ids into one table with
`admission.min_count` 3: a share `--hot` of each batch comes from a small hot
set (those keys get rows), the rest are fresh one-off ids that only ever hold
an admission counter. Every `--checkpoint-every` steps the engine rebuilds its
shards as a checkpoint does. Two runs side by side:

    ttl       eviction.ttl_steps = --ttl: idle waiting keys are dropped at each rebuild
    no_ttl    no eviction: every one-off key keeps its counter forever

and the waiting keys and the counters' bucket bytes are printed over time.
Target: with ttl, the counters' memory at the end is within 10% of its value
halfway (flat); without ttl it keeps growing with the stream.

Usage:
    python scripts/bench_long_tail.py
    python scripts/bench_long_tail.py --steps 4000 --batch 8192

Last line: {"bench": "long_tail", "ttl": [...], "no_ttl": [...], "flat": true, ...}
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="batches streamed (default 2000)")
    p.add_argument("--batch", type=int, default=4096, help="ids per batch (default 4096)")
    p.add_argument("--hot", type=float, default=0.2, help="share of hot ids (default 0.2)")
    p.add_argument("--ttl", type=int, default=200, help="ttl_steps of the ttl run (default 200)")
    p.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between rebuilds (default 100)"
    )
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args(argv)


def stream(args, ttl: int | None) -> list[dict]:
    import numpy as np
    import tensorflow as tf

    from recflow.config import config_from_dict
    from recflow.embedding.engine import EmbeddingEngine
    from recflow.embedding.rows import KEY_BYTES

    table = {"dim": 8, "admission": {"min_count": 3}}
    if ttl is not None:
        table["eviction"] = {"ttl_steps": ttl}
    config = config_from_dict({
        "data": {"format": "synthetic", "label": "click", "batch_size": args.batch},
        "features": [{"name": "id", "kind": "categorical", "dtype": "int64", "table": "t"}],
        "tables": {"t": table},
        "model": {"type": "deepfm"},
    })  # fmt: skip
    engine = EmbeddingEngine(config)
    physical = engine.physical_tables[0]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.int64)])
    def step_fn(ids, step):
        states = engine.prepare({"id": ids}, step)
        engine.apply(states, [None], step)

    rng = np.random.default_rng(args.seed)
    hot_ids = rng.integers(0, 1 << 40, 10_000)
    n_hot = int(args.batch * args.hot)
    counter_bytes = KEY_BYTES + 4 * 2  # a counter bucket: key + [sightings, last step]
    out = []
    for step in range(1, args.steps + 1):
        ids = np.concatenate([
            rng.choice(hot_ids, n_hot),
            (1 << 41) + step * args.batch + np.arange(args.batch - n_hot),  # never seen again
        ])  # fmt: skip
        step_fn(tf.constant(ids, tf.int64), tf.constant(step, tf.int64))
        if step % args.checkpoint_every == 0:
            engine.rebuild(step)
            stats = engine.table_stats()["t"]
            buckets = physical.counters.num_buckets(0)
            out.append({
                "step": step, "keys": stats["keys"], "waiting_keys": stats["waiting_keys"],
                "counter_buckets": buckets, "counter_bytes": buckets * counter_bytes,
            })  # fmt: skip
            print(f"  {'ttl' if ttl else 'no_ttl'} step {step}: {stats}", flush=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = {"ttl": stream(args, args.ttl), "no_ttl": stream(args, None)}
    rows = [
        [a["step"], a["keys"], a["waiting_keys"], a["counter_bytes"] / 2**20,
         b["waiting_keys"], b["counter_bytes"] / 2**20]
        for a, b in zip(runs["ttl"], runs["no_ttl"])
    ]  # fmt: skip
    print()
    common.print_table(
        ["step", "keys (rows)", f"waiting, ttl {args.ttl}", "counters MiB", "waiting, no ttl",
         "counters MiB"], rows,
        title=f"{args.batch} ids per step, {args.hot:.0%} from 10k hot ids, the rest one-off; "
        f"admission min_count 3; rebuild every {args.checkpoint_every} steps",
    )  # fmt: skip
    ttl = runs["ttl"]
    half, end = ttl[len(ttl) // 2]["counter_bytes"], ttl[-1]["counter_bytes"]
    flat = end <= 1.1 * half
    grows = runs["no_ttl"][-1]["counter_bytes"] > 1.5 * runs["no_ttl"][len(ttl) // 2]["counter_bytes"]
    print(
        f"\nttl: counters {half / 2**20:.1f} MiB halfway, {end / 2**20:.1f} MiB at the end "
        f"(flat: {'PASS' if flat else 'FAIL'}); no ttl grows: {grows}"
    )
    common.emit_json("long_tail", flat=flat, no_ttl_grows=grows, **runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
