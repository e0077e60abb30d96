"""`recflow train CONFIG --warm-start FROM_DIR`: a new model dir that starts from
another one's rows and weights wherever they still fit.

This is how a production model gets a feature added or removed without losing
its embeddings: the changed config cannot resume the old model dir (its
identity differs, see `recflow.models.identity`), but it can start from it.

What is carried over, read from FROM_DIR's newest readable checkpoint (FROM_DIR
is only read):

- **rows** of every logical table that exists in both configs with the same dim and
  the same id dtype (an int64 id's key is its value, a string's its fingerprint: rows
  keyed one way are never found the other): each id keeps its embedding and sighting count, and its optimizer slots when
  the sparse optimizer type is the same (otherwise they start as the optimizer
  initializes them). The rows count as last seen at step 0 of the new run, so
  `eviction.ttl_steps` measures from the warm start. Keys still waiting for
  admission are not carried (they hold only a counter);
- **dense weights** (trainable or not: a batch norm's moving statistics too) whose
  variable path and shape are the same, when the model class is the same and the
  tower sees the same inputs: the same features (kind, id dtype, table and that
  table's dim), as `tower_inputs` describes them. Otherwise every dense weight
  starts fresh: a first layer's rows follow its inputs' order and widths, so after a
  feature was added, removed, renamed or swapped for another of the same width, its
  kernel would multiply other inputs than it was trained on (carried by shape alone,
  a swapped feature silently took the other's weights).

Everything else (new tables, new layers, the dense optimizer's state, the step)
starts fresh: the new model dir begins at step 0.
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from recflow.config.loader import load_config
from recflow.embedding.placement import ModPlacement
from recflow.embedding.planner import LINEAR_SUFFIX
from recflow.errors import RecflowError
from recflow.layout import Layout
from recflow.models import build_model, identity
from recflow.training.checkpoints import readable_checkpoint, recorded_structure

logger = logging.getLogger(__name__)


def _source_model(source: str):
    """The model of `source` (a model dir), restored from its newest readable checkpoint;
    returns (model, the checkpoint, the structure it records)."""
    layout = Layout(source)
    config_path = layout.config_path
    if not os.path.isfile(config_path):
        raise RecflowError(f"--warm-start {source}: not a model dir (no config.yaml)")
    latest = readable_checkpoint(layout.checkpoint_dir)
    if latest is None:
        raise RecflowError(f"--warm-start {source}: no checkpoint to start from")
    config = load_config(config_path)
    saved = recorded_structure(tf.train.load_checkpoint(latest))
    if saved is None:
        raise RecflowError(f"--warm-start {latest}: written by an older recflow (no recorded structure)")
    model = build_model(config, ModPlacement(saved["parameter_servers"]))
    model.build_weights()
    identity.check(saved, identity.structure(model), source)  # its config.yaml must match
    model.embedding.restore(tf.train.Checkpoint(model=model), latest).expect_partial()
    return model, latest, saved


def id_dtypes(config) -> dict[str, str]:
    """The id dtype of every logical table (its features share one: `check_references`),
    its first-order table (`<table>.linear`) included."""
    out = {}
    for feature in config.sparse_features:
        out[feature.table_name] = out[feature.table_name + LINEAR_SUFFIX] = feature.dtype
    return out


def warm_start(model, source: str) -> dict:
    """Copies into `model` (fresh, at step 0) what still fits of model dir `source`.

    Returns:
        A report: `tables` {name: rows carried}, `fresh_tables`, `slots_reset` (tables
        whose optimizer changed), `dense` {carried, fresh: [paths]}, `from` (the checkpoint).
    """
    if int(model.global_step) != 0:
        raise RecflowError("--warm-start applies to a new model dir only")
    old, checkpoint, old_structure = _source_model(source)
    old_rows = old.embedding.logical_rows()
    old_tables = {t.name: t for p in old.embedding.plan for t in p.logical}
    old_dtypes, dtypes = id_dtypes(old.config), id_dtypes(model.config)
    carried, fresh, slots_reset = {}, [], []
    for physical in model.embedding.plan:
        for table in physical.logical:
            before = old_tables.get(table.name)
            if before is None or before.dim != table.dim or old_dtypes[table.name] != dtypes[table.name]:
                fresh.append(table.name)
                continue
            same_slots = before.optimizer.type == table.optimizer.type
            if not same_slots:
                slots_reset.append(table.name)
            carried[table.name] = model.embedding.load_rows(
                table.name, old_rows[table.name], keep_slots=same_slots
            )
    dense_carried, dense_fresh, why = 0, [], None
    if old.config.model.type != model.config.model.type:
        why = f"the model class changed ({old.config.model.type} -> {model.config.model.type})"
    elif tower_inputs(old_structure) != tower_inputs(identity.structure(model)):
        why = "the tower's inputs changed"
    old_vars = identity.dense_paths(old) if why is None else {}
    counters = {id(model.global_step), id(model.bad_records)}  # the new run's own, from 0
    for path, variable in sorted(identity.dense_paths(model).items()):
        if id(variable) in counters:
            continue
        source_var = old_vars.get(path)
        if source_var is not None and source_var.shape == variable.shape and source_var.dtype == variable.dtype:
            variable.assign(source_var)
            dense_carried += 1
        else:
            dense_fresh.append(path)
    report = {
        "from": checkpoint,
        "tables": carried,
        "fresh_tables": sorted(fresh),
        "slots_reset": sorted(slots_reset),
        "dense": {"carried": dense_carried, "fresh": dense_fresh, **({"why_fresh": why} if why else {})},
    }
    logger.info("warm start from %s: %s", checkpoint, report)
    return report


def tower_inputs(structure: dict) -> dict:
    """What the tower's inputs are, from a model's identity: each feature's identity with
    the dim of its table (a numeric feature's width is 1)."""
    tables = structure["tables"]
    return {
        name: {**feature, "dim": tables[feature["table"]]["dim"] if "table" in feature else 1}
        for name, feature in structure["features"].items()
    }


def describe(report: dict) -> str:
    """One line for the console."""
    tables = ", ".join(f"{name} ({rows} rows)" for name, rows in sorted(report["tables"].items()))
    parts = [f"warm start from {report['from']}: rows of {tables or 'no table'}"]
    if report["fresh_tables"]:
        parts.append(f"fresh tables: {', '.join(report['fresh_tables'])}")
    if report["slots_reset"]:
        parts.append(f"optimizer slots reset: {', '.join(report['slots_reset'])}")
    dense = report["dense"]
    why = f" ({dense['why_fresh']})" if "why_fresh" in dense else ""
    parts.append(f"dense: {dense['carried']} variables carried, {len(dense['fresh'])} fresh{why}")
    return "; ".join(parts)
