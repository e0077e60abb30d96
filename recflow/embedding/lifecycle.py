"""Table lifecycle between steps (at checkpoints): eviction and delta export.

A delta, `deltas/<step>/`, holds everything a serving copy of the model needs to
move from the previous delta's step to this one (docs/online-learning.md, "Deltas"):

    manifest.json   {"format": 2, "sequence": n (1, 2, ... consecutive), "step",
                     "since_step", "written_at" (unix seconds), "structure_sha256",
                     "tables": {name: {"rows", "dim", "evicted"}},
                     "dense": {"size": total floats, "variables": [[name, shape], ...]},
                     "files": {file name: sha256 of its bytes}}
    <table>.npz     per logical table: `keys` (raw ids [n] int64, the slot removed),
                    `values` (embeddings [n, dim] float32) of the rows updated after
                    `since_step`, and `evicted` (raw ids [m] int64 evicted after it)
    dense.npy       every dense weight of the model, flattened and concatenated in
                    `dense.variables` order [size] float32 (not an npz: every *.npz is a table)

Format 1 (no `sequence`, `evicted`, `dense`) is a subset: its readers keep working.
Applying a delta: evicted ids first read the default row again, then the rows are
written, then the dense weights (`ServingModule.apply_delta`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time

import numpy as np

from recflow.embedding.engine import EmbeddingEngine

DELTA_FORMAT = 2
DENSE_FILE = "dense.npy"


def evict_tracked(engine: EmbeddingEngine, step: int) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """Removes stale rows (`ttl_steps`), the least frequent beyond `max_keys`, and idle or
    stale admission counters, by rebuilding the affected shards; returns the rows evicted
    per physical table and the raw ids each logical table lost (sorted, int64): what the
    next delta must tell a serving copy to forget."""
    return engine.rebuild_tracked(step)


def merge_ids(pending: dict[str, np.ndarray], more: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The union, per logical table, of two {name: ids} maps (sorted, distinct)."""
    out = dict(pending)
    for name, ids in more.items():
        out[name] = np.union1d(out.get(name, np.zeros(0, np.int64)), ids).astype(np.int64)
    return out


def ids_to_bytes(ids: dict[str, np.ndarray]) -> bytes:
    """{name: ids} as npz bytes (kept in a checkpointed string variable); b"" when empty."""
    if not ids:
        return b""
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.asarray(v, np.int64) for name, v in ids.items()})
    return buffer.getvalue()


def ids_from_bytes(data: bytes) -> dict[str, np.ndarray]:
    if not data:
        return {}
    with np.load(io.BytesIO(data)) as arrays:
        return {name: arrays[name] for name in arrays.files}


def write_delta(
    engine: EmbeddingEngine,
    directory: str,
    since_step: int,
    step: int,
    *,
    sequence: int,
    structure_sha256: str,
    dense: list[tuple[str, np.ndarray]],
    evicted: dict[str, np.ndarray] | None = None,
    extra: dict | None = None,
) -> None:
    """Writes the delta of `step` into `directory`, an empty dir (layout in the module
    docstring); the model dir stages it and renames it to `deltas/<step>/`
    (`recflow.training.model_dir.ModelDir.write_delta`).

    Args:
        engine: the model's tables; rows updated after `since_step` are written.
        sequence: this delta's number in its chain (the previous one's plus one).
        structure_sha256: `structure_fingerprint` of the model.
        dense: (name, value) of every dense weight, in the serving module's order.
        evicted: raw ids evicted after `since_step`, per logical table.
        extra: more manifest fields (a Kafka stream's `kafka_offsets`).
    """
    rows = engine.updated_rows(since_step)
    evicted = evicted or {}
    manifest = {
        **(extra or {}),
        "format": DELTA_FORMAT,
        "sequence": int(sequence),
        "step": step,
        "since_step": since_step,
        "written_at": time.time(),
        "structure_sha256": structure_sha256,
        "tables": {},
        "files": {},
    }
    for name, (keys, values) in rows.items():
        gone = np.asarray(evicted.get(name, np.zeros(0, np.int64)), np.int64)
        _save(directory, f"{name}.npz", manifest, keys=keys.astype(np.int64),
              values=values.astype(np.float32), evicted=gone)
        manifest["tables"][name] = {
            "rows": int(keys.size), "dim": int(values.shape[1]), "evicted": int(gone.size)
        }
    flat = [np.asarray(v, np.float32).reshape(-1) for _, v in dense]
    weights = np.concatenate(flat) if flat else np.zeros(0, np.float32)
    _save(directory, DENSE_FILE, manifest, weights)
    manifest["dense"] = {
        "size": int(weights.size),
        "variables": [[name, list(np.shape(v))] for name, v in dense],
    }
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)


def _save(directory: str, name: str, manifest: dict, array=None, **arrays) -> None:
    """Writes `array` (.npy) or `arrays` (.npz) and records the file's sha256."""
    path = os.path.join(directory, name)
    if array is not None:
        np.save(path, array)
    else:
        np.savez(path, **arrays)
    with open(path, "rb") as f:
        manifest["files"][name] = hashlib.sha256(f.read()).hexdigest()


def structure_fingerprint(structure: dict) -> str:
    """sha256 of a model structure's canonical JSON (`recflow.models.identity`); an
    export's `assets.extra/structure.json` gives the same value."""
    text = json.dumps(structure, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
