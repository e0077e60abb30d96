"""Embedding lookups per second: recflow's fused engine path vs tf.gather vs a bare hash table.

Preloads `--keys` keys (spread over `--features` features, Zipf-distributed ids)
and times, each inside a `tf.function`, warmed up, on batches of
`--batch` x `--features` ids:

    engine_fused     EmbeddingEngine.embed: one fused physical table for all features;
                     encode (slot, mixed id) -> concat -> unique -> DenseHashTable lookup of packed
                     rows [emb | optimizer slots | meta] -> slice emb -> gather per feature
    table_unique     concat -> unique (keys.unique) -> ShardedTable.lookup (route to segments, lookup,
                     stitch) -> gather (the engine's core, without per-feature assembly)
    hash_bare        one DenseHashTable of [dim] rows, lookup of all keys (no unique, no segments)
    variable_gather  tf.gather on a tf.Variable [keys, dim] (a fixed vocabulary, no hashing)

lookups/s = batch * features / (median seconds per batch over `--repeats` repeats of
`--steps` batches). Target: engine_fused / variable_gather >= 0.8.

Usage (defaults: 1M keys, dim 16, 26 features, batch 4096, adagrad rows):
    python scripts/bench_lookup.py
    python scripts/bench_lookup.py --keys 100000 --repeats 3

Last line: {"bench": "lookup", "lookups_per_sec": {...}, "fused_vs_gather": ..., ...}
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402  (sets TF_USE_LEGACY_KERAS before TF loads)

TARGET = 0.8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000, help="keys preloaded (default 1000000)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    p.add_argument(
        "--features", type=int, default=26, help="features reading the fused table (default 26)"
    )
    p.add_argument("--batch", type=int, default=4096, help="rows per batch (default 4096)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    p.add_argument(
        "--ids", choices=["hashed", "dense"], default="hashed",
        help="hashed: random int64 ids, as string features get from their fingerprint (default); "
        "dense: ids 0..vocab-1 of every feature, as small int64 ids (user ids) give",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", choices=["sgd", "adagrad", "adam", "ftrl"], default="adagrad",
        help="sets the packed row width of the engine's table (default adagrad: dim*2+2 floats)",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=7, help="timed repeats; the median counts (default 7)"
    )
    p.add_argument("--steps", type=int, default=20, help="batches per repeat (default 20)")
    p.add_argument(
        "--pool", type=int, default=8, help="distinct batches cycled through (default 8)"
    )
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args(argv)


def zipf_ranks(rng, vocab: int, shape, a: float):
    """Row numbers in [0, vocab) with P(k) ~ 1 / (k + 1)^a, over randomly permuted rows."""
    import numpy as np

    p = 1.0 / np.arange(1, vocab + 1) ** a
    ranks = rng.choice(vocab, size=shape, p=p / p.sum())
    return rng.permutation(vocab)[ranks]


def time_fn(fn, batches, repeats: int, steps: int) -> float:
    """Median seconds per call of `fn(batch)`, cycling through `batches`, after a warm-up."""
    for b in batches:
        fn(b)
    per_call = []
    for _ in range(repeats):
        began = time.perf_counter()
        out = None
        for i in range(steps):
            out = fn(batches[i % len(batches)])
        _ = [t.numpy() for t in (out.values() if isinstance(out, dict) else [out])][:1]
        per_call.append((time.perf_counter() - began) / steps)
    return common.median(per_call)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import tensorflow as tf

    from recflow.config import config_from_dict
    from recflow.embedding.engine import EmbeddingEngine
    from recflow.features.keys import DELETED_KEY, EMPTY_KEY, KEY_WIDTH, encode, unique

    names = [f"f{i}" for i in range(args.features)]
    vocab = args.keys // args.features
    n_keys = vocab * args.features
    config = config_from_dict({
        "data": {"format": "synthetic", "label": "label"},
        "features": [{"name": n, "kind": "categorical", "dtype": "int64", "dim": args.dim} for n in names],
        "train": {"sparse_optimizer": {"type": args.optimizer}},
    })  # fmt: skip
    engine = EmbeddingEngine(config)
    if len(engine.physical_tables) != 1:
        raise SystemExit(
            f"bench_lookup: expected one fused table, got {len(engine.physical_tables)}"
        )
    group = engine.physical_tables[0]
    width = group.layout.width
    rng = np.random.default_rng(args.seed)

    # Feature f's row r has id vocab_ids[f, r]: its table key encode(id, slot), Variable row f*vocab+r.
    if args.ids == "hashed":
        vocab_ids = rng.integers(-(2**63), 2**63 - 1, (args.features, vocab), dtype=np.int64)
    else:
        vocab_ids = np.tile(np.arange(vocab, dtype=np.int64), (args.features, 1))

    # Preload: every id of every feature gets a row (engine: packed rows; others: emb only).
    began = time.perf_counter()
    bare = tf.lookup.experimental.DenseHashTable(
        tf.int64, tf.float32, tf.zeros([args.dim]), EMPTY_KEY, DELETED_KEY, name="bare"
    )
    variable = tf.Variable(tf.random.normal([n_keys, args.dim], stddev=0.01, seed=args.seed))
    chunk = 1 << 18
    for f, use in enumerate(group.uses):
        keys = encode(tf.constant(vocab_ids[f]), use.slot)
        for start in range(0, vocab, chunk):
            k = keys[start : start + chunk]
            group.rows.insert(k, tf.random.normal([tf.shape(k)[0], width], stddev=0.01))
            bare.insert(k, tf.random.normal([tf.shape(k)[0], args.dim], stddev=0.01))
    loaded = int(group.rows.size())
    print(
        f"preloaded {loaded:,} keys ({args.features} features x {vocab:,} ids), engine row width "
        f"{width} floats ({args.optimizer}), dim {args.dim}, in {time.perf_counter() - began:.1f}s",
        flush=True,
    )

    # The same Zipf ids for every path: per-feature ids, their engine keys and their Variable rows.
    batches_ids, batches_keys, batches_rows = [], [], []
    slots = np.array([u.slot for u in group.uses], np.int64)
    for _ in range(args.pool):
        rows = zipf_ranks(rng, vocab, (args.batch, args.features), args.zipf).astype(np.int64)
        ids = np.take_along_axis(vocab_ids.T, rows, axis=0)  # [batch, features]
        batches_ids.append({n: tf.constant(ids[:, i]) for i, n in enumerate(names)})
        batches_keys.append(
            tf.concat([encode(tf.constant(ids[:, i]), int(s)) for i, s in enumerate(slots)], 0)
        )
        batches_rows.append(
            tf.constant(rows + np.arange(args.features, dtype=np.int64)[None, :] * vocab)
        )
    unique_per_batch = int(np.mean([len(np.unique(k.numpy(), axis=0)) for k in batches_keys]))

    spec_ids = {n: tf.TensorSpec([None], tf.int64) for n in names}

    @tf.function(input_signature=[spec_ids])
    def engine_fused(ids):
        return engine.embed(ids)

    @tf.function(input_signature=[tf.TensorSpec([None, KEY_WIDTH], tf.int64)])
    def table_unique(keys):
        distinct, index = unique(keys)
        rows = group.rows.lookup(distinct)[:, : args.dim]
        return tf.gather(rows, index)

    @tf.function(input_signature=[tf.TensorSpec([None, KEY_WIDTH], tf.int64)])
    def hash_bare(keys):
        return tf.reshape(bare.lookup(keys), [-1, args.dim])

    @tf.function(input_signature=[tf.TensorSpec([None, args.features], tf.int64)])
    def variable_gather(rows):
        return tf.gather(variable, rows)

    paths = {
        "engine_fused": (engine_fused, batches_ids),
        "table_unique": (table_unique, batches_keys),
        "hash_bare": (hash_bare, batches_keys),
        "variable_gather": (variable_gather, batches_rows),
    }
    lookups = args.batch * args.features
    seconds, rates = {}, {}
    for name, (fn, batches) in paths.items():
        seconds[name] = time_fn(fn, batches, args.repeats, args.steps)
        rates[name] = lookups / seconds[name]
        print(f"  {name}: {rates[name] / 1e6:.2f} M lookups/s", flush=True)

    gather = rates["variable_gather"]
    rows = [[n, seconds[n] * 1e3, rates[n] / 1e6, rates[n] / gather] for n in paths]
    print()
    common.print_table(
        ["path", "ms / batch", "M lookups/s", "vs gather"], rows,
        title=f"{args.batch} x {args.features} Zipf({args.zipf}) ids per batch (~{unique_per_batch:,} unique), "
        f"{loaded:,} keys ({args.ids} ids), dim {args.dim}, median of {args.repeats} x {args.steps} batches",
    )  # fmt: skip
    ratio = rates["engine_fused"] / gather
    print(
        f"\nengine_fused / variable_gather = {ratio:.2f} (target >= {TARGET}): "
        f"{'PASS' if ratio >= TARGET else 'FAIL'}"
    )
    common.emit_json(
        "lookup", keys=loaded, dim=args.dim, features=args.features, batch=args.batch,
        row_width=width, optimizer=args.optimizer, ids=args.ids, unique_per_batch=unique_per_batch,
        lookups_per_sec=rates, ms_per_batch={k: v * 1e3 for k, v in seconds.items()},
        fused_vs_gather=ratio, target=TARGET, passed=ratio >= TARGET,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
