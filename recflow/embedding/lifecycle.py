"""Table lifecycle outside the step: eviction and delta export (eager, at checkpoints)."""

from __future__ import annotations

import json
import os

import numpy as np
import tensorflow as tf

from recflow.atomic import staged_dir
from recflow.embedding.engine import EmbeddingEngine
from recflow.features.keys import ID_MASK, slot_of


def evict(engine: EmbeddingEngine, step: int) -> dict[str, int]:
    """Removes stale rows (`ttl_steps`) and the least frequent beyond `max_keys`.

    Returns the number of rows evicted per physical table.
    """
    evicted = {}
    for group in engine.groups:
        policy = group.spec.eviction
        if policy is None:
            continue
        removed = 0
        for shard in range(group.table.num_shards):
            keys, _, count, last = (t.numpy() for t in engine.logical_rows(group, shard))
            drop = np.zeros(keys.size, bool)
            if policy.ttl_steps is not None:
                drop |= last <= step - policy.ttl_steps
            if policy.max_keys is not None:
                # Each shard keeps its share of max_keys, least frequent (then oldest) out first.
                limit = -(-policy.max_keys // group.table.num_shards)
                alive = np.flatnonzero(~drop)
                if alive.size > limit:
                    order = np.lexsort((last[alive], count[alive]))
                    drop[alive[order[: alive.size - limit]]] = True
            if drop.any():
                group.table.shards[shard].erase(tf.constant(keys[drop]))
                removed += int(drop.sum())
        evicted[group.spec.name] = removed
    return evicted


def updated_rows(engine: EmbeddingEngine, since_step: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per logical table: (keys, embeddings) of rows updated after `since_step`.

    Keys are the raw 55-bit ids (the logical table's slot removed).
    """
    out = {}
    for group in engine.groups:
        keys, emb, _, last = (t.numpy() for t in engine.logical_rows(group))
        fresh = last > since_step
        slots = slot_of(keys)
        for slot, logical in enumerate(group.spec.logical):
            pick = fresh & (slots == slot)
            ids = keys[pick] & ID_MASK
            out[logical.name] = (ids.astype(np.int64), emb[pick].astype(np.float32))
    return out


def write_delta(engine: EmbeddingEngine, deltas_dir: str, since_step: int, step: int) -> str:
    """Writes `deltas/<step>/` (manifest.json + one <table>.npz per logical table)."""
    final = os.path.join(deltas_dir, str(step))
    rows = updated_rows(engine, since_step)
    with staged_dir(final) as tmp:
        manifest = {"step": step, "since_step": since_step, "tables": {}}
        for name, (keys, values) in rows.items():
            np.savez(os.path.join(tmp, f"{name}.npz"), keys=keys, values=values)
            manifest["tables"][name] = {"rows": int(keys.size), "dim": int(values.shape[1])}
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
    return final
