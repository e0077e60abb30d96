"""A model's identity: what decides what its variables mean, recorded in every
checkpoint and export, and compared before a model dir is read.

Reordering two feature lines, flipping `embedding.fusion` or changing a table's
dim must not read a trained model's rows from the wrong slots or its weights
into the wrong places. `structure(model)` describes everything that fixes the
meaning of the variables:

- `features`: each feature's `identity()`: its kind, id dtype and logical table
  (sequences: their `max_len`; numeric: their normalizer's type and bucket boundaries);
- `tables`: dim and sparse optimizer type (the row layout) of each logical table;
- `fusion`: which logical tables share each physical table, in slot order;
- `model`: class and params (without a layer's `dtype` that keeps float32 weights:
  a DNN's `mixed_bfloat16` only changes how it computes); `task`: type and heads;
  the dense optimizer type;
- `dense`: each trainable dense weight's shape by its attribute path (`dense_paths`):
  a tower whose code changed (a layer added, a width changed) with the same params
  would otherwise restore part of the checkpoint into the rest of the model, with fresh
  weights where the code added them. A structure recorded before it was kept has none:
  then it is not compared;
- `parameter_servers`: the number of shards every table is split into, recorded
  but not compared: a checkpoint resumed on another count has its rows moved to
  their new shards as it is restored (`recflow.embedding.reshard`).

Features and tables are keyed by name, so the order of config lines changes
nothing (the config loader also sorts features by name, which makes the slot
assignment and the tower's input order independent of it). What only changes
how training proceeds (learning rates, steps, schedules, data paths) is left
out, so it may change on resume.
"""

from __future__ import annotations

import json
from typing import Any

import tensorflow as tf

from recflow.embedding.planner import LINEAR_SUFFIX
from recflow.errors import RecflowError
from recflow.layers.dnn import DTYPES as DNN_DTYPES

VARIABLE = "structure"  # the checkpointed tf.Variable holding the JSON
EXPORT_FILE = "structure.json"  # in an export's assets.extra/


def structure(model) -> dict:
    """The identity of a built `RankingModel` (plain JSON-able values)."""
    config = model.config
    engine = model.embedding
    features = {f.name: f.identity() for f in config.features}
    tables, fusion = {}, {}
    for physical in engine.plan:
        fusion[physical.name] = [t.name for t in physical.logical]
        for t in physical.logical:
            tables[t.name] = {"dim": t.dim, "optimizer": t.optimizer.type}
    task = config.task
    return {
        "features": features,
        "tables": tables,
        "fusion": fusion,
        "model": {"type": config.model.type, "params": _without_compute_dtypes(_plain(config.model.params))},
        "task": {
            "type": task.type,
            "heads": {t.name: {"label": t.label, "type": t.type} for t in task.tasks},
        },
        "dense_optimizer": _dense_optimizer(config.train.optimizer.type),
        "dense": {path: v.shape.as_list() for path, v in sorted(dense_paths(model).items()) if v.trainable},
        "parameter_servers": engine.placement.num_shards,
    }


def dense_paths(model) -> dict[str, tf.Variable]:
    """The model's variables outside the embedding engine, each under one stable path:
    its shortest attribute path without Keras's private tracking lists (layer names
    such as `dense_3` depend on what else the process built; attribute paths do not).
    The embedding engine's own variables are left out under every path (Keras also
    tracks the engine as `_self_tracked_trackables/N`)."""
    engine = {id(v) for v in model.embedding.variables}
    best: dict[int, tuple] = {}
    for path, variable in model._flatten(predicate=lambda v: isinstance(v, tf.Variable), with_path=True):
        if not path or path[0] in ("embedding", "optimizer") or id(variable) in engine:
            continue
        private = sum(1 for p in path if isinstance(p, str) and p.startswith("_"))
        rank = (private, len(path), tuple(map(str, path)))
        if id(variable) not in best or rank < best[id(variable)][0]:
            best[id(variable)] = (rank, "/".join(map(str, path)), variable)
    return {name: variable for _, name, variable in best.values()}


# Recorded, but free to change on resume: the restore adapts to them.
_ELASTIC = frozenset({"parameter_servers"})


def _dense_optimizer(type_name: str) -> str:
    """`train.optimizer.type` as the class it names: Keras names are read in any case."""
    return type_name if ":" in type_name else type_name.lower()


def dumps(value: dict) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _without_compute_dtypes(value):
    """`value` without the `dtype` keys that name a policy of `DNN_DTYPES`, at any depth:
    their weights are float32 in each, so the choice only changes how a layer computes,
    as `train.xla` does."""
    if isinstance(value, dict):
        return {
            k: _without_compute_dtypes(v)
            for k, v in value.items()
            if not (k == "dtype" and v in DNN_DTYPES)
        }
    if isinstance(value, list):
        return [_without_compute_dtypes(v) for v in value]
    return value


def _plain(value):
    """`value` as JSON would give it back (tuples become lists), so a saved
    structure compares equal to a computed one."""
    return json.loads(json.dumps(value, default=str))


def differences(saved: dict, current: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, saved value, current value) of each leaf that differs; a key
    present on one side only has `None` on the other."""
    out = []
    for key in sorted(set(saved) | set(current), key=str):
        path = f"{prefix}.{key}" if prefix else str(key)
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(differences(a, b, path))
        elif a != b:
            out.append((path, a, b))
    return out


def changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """`differences` that change what the variables mean (not `parameter_servers`; not
    `dense` when `saved` was recorded without it)."""
    if "dense" not in saved:
        current = {k: v for k, v in current.items() if k != "dense"}
    return [c for c in differences(saved, current) if c[0] not in _ELASTIC]


def _shown(value) -> str:
    if value is None:
        return "absent"
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def check(saved: dict | None, current: dict, where: str) -> None:
    """Raises RecflowError (one line) when `saved` (read from `where`) differs from `current`.

    The line lists every difference, e.g. `tables.user.dim: 8 in runs/a, 16 in
    this config`, and says how to go on.
    """
    found = [] if saved is None else changes(saved, current)
    if not found:
        return
    shown = "; ".join(
        f"{path}: {_shown(a)} in {where}, {_shown(b)} in this config" for path, a, b in found[:8]
    )
    more = f" (and {len(found) - 8} more)" if len(found) > 8 else ""
    raise RecflowError(
        f"{where}: the config changes what the trained model's variables mean: {shown}{more}"
        f"{_fusion_hint(saved, current)}; restore the config it was trained with, or train a new "
        "model dir from it with `recflow train CONFIG --model-dir NEW --warm-start OLD`"
    )


def _fusion_hint(saved: dict, current: dict) -> str:
    """Why the fusion plan changed, when it did: the fused groups the config does not keep."""
    now = [sorted(m) for m in current.get("fusion", {}).values()]
    changed = [
        sorted(m) for m in saved.get("fusion", {}).values()
        if len(m) > 1 and sorted(m) not in now and not m[0].endswith(LINEAR_SUFFIX)  # those follow their tables
    ]
    if not changed:
        return ""
    groups = " and ".join(", ".join(m) for m in changed)
    return (
        f" (the tables fuse differently: {groups} shared one physical table. Tables share one "
        "when their dim, initializer, optimizer with its parameters, admission and eviction agree, "
        "so a setting changed on one table of a group, or one that makes another table agree with "
        "them, changes the plan: change it on every table of the group, or on none)"
    )
