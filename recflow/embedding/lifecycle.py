"""Table lifecycle outside the step (eager, at checkpoints): eviction and delta export."""

from __future__ import annotations

import json
import os

import numpy as np

from recflow.atomic import staged_dir
from recflow.embedding.engine import EmbeddingEngine


def evict(engine: EmbeddingEngine, step: int) -> dict[str, int]:
    """Removes stale rows (`ttl_steps`), the least frequent beyond `max_keys`, and idle or
    stale admission counters, by rebuilding the affected shards.

    Returns the number of rows evicted per physical table.
    """
    return engine.rebuild(step)


def write_delta(
    engine: EmbeddingEngine, deltas_dir: str, since_step: int, step: int, extra: dict | None = None
) -> str:
    """Writes `deltas/<step>/`: manifest.json + one <table>.npz per logical table.

    Each npz holds the raw ids (`keys`, int64, the slot removed) and embeddings
    (`values`, float32 [n, dim]) of the rows updated after `since_step`. `extra`:
    more manifest fields (a stream's sequence number and offsets).
    """
    final = os.path.join(deltas_dir, str(step))
    rows = engine.updated_rows(since_step)
    with staged_dir(final) as tmp:
        manifest = {**(extra or {}), "step": step, "since_step": since_step, "tables": {}}
        for name, (keys, values) in rows.items():
            np.savez(
                os.path.join(tmp, f"{name}.npz"),
                keys=keys.astype(np.int64),
                values=values.astype(np.float32),
            )
            manifest["tables"][name] = {"rows": int(keys.size), "dim": int(values.shape[1])}
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
    return final
