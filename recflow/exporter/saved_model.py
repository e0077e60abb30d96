"""SavedModel export (README "Serving the export").

`serving_default` takes one raw column per feature and runs hashing,
splitting, normalization and the table lookups in the graph. The export holds
embedding rows only (no optimizer slots, no metadata) in core `DenseHashTable`s,
so it loads with `tf.saved_model.load` in a process without recflow. Their keys
are raw `(slot, id)` pairs (the id an int64 value or a string's fingerprint;
`recflow.features.keys`), so a reader of the tables sees the ids it trained on.

The version is the global step of the exported model, so versions are ordered
by training progress (TF Serving serves the highest): a restart that replays
steps keeps the versions it finds (a version is never rewritten), never an older model under a higher one.
`assets.extra/manifest.json` and the module's `global_step` record the step;
`assets.extra/structure.json` the model's identity (`recflow.models.identity`);
`assets.extra/recflow_config.yaml` holds the config without the model dir and
with data paths cut to their file names.

A retrieval model (`RetrievalModel`) exports two signatures instead, each over
its own side's raw columns: `query` -> {"embedding": [B, d]} and `candidate`
-> {"embedding": [B, d]}; `serving_default` is the `query` signature.
"""

from __future__ import annotations

import json
import os
import re

import tensorflow as tf
import yaml

from recflow.atomic import staged_dir, write_json
from recflow.config.convert import to_dict
from recflow.embedding.table import STOCK_LOAD, empty_buckets, segment_buckets
from recflow.features.keys import DELETED_KEY, EMPTY_KEY, raw_keys, slot_column
from recflow.features.transform import serving_dtype
from recflow.models import identity
from recflow.models.base import RankingModel, RetrievalModel
from recflow.models.inputs import Lookup


class ServingModule(tf.Module):
    """A frozen copy of a trained model's serving path.

    Args:
        model: the trained model; its dense weights are shared, its tables copied.
        step: the global step it serves (`global_step`).

    `refresh` copies the model's current rows and step in again, so one module
    (traced once) serves every periodic export of a run.
    """

    def __init__(self, model: RankingModel, step: int = 0):
        super().__init__(name="recflow_serving")
        config = model.config
        # A closure, not an attribute: the module must not track (and save) the model.
        self._serving_rows = model.embedding.serving_rows
        self.global_step = tf.Variable(step, dtype=tf.int64, trainable=False, name="global_step")
        engine = model.embedding
        self.tables = []
        dims = []
        for index, physical in enumerate(engine.physical_tables):
            keys, emb = engine.serving_rows(index)
            with tf.device("/cpu:0"):
                table = tf.lookup.experimental.DenseHashTable(
                    key_dtype=tf.int64,
                    value_dtype=tf.float32,
                    default_value=tf.zeros([physical.spec.dim]),
                    empty_key=EMPTY_KEY,
                    deleted_key=DELETED_KEY,
                    initial_num_buckets=serving_buckets(int(keys.shape[0])),
                    name=physical.spec.name.replace(".", "_") + "_serving",
                )
                table.insert(keys, emb)
            self.tables.append(table)
            dims.append(physical.spec.dim)
        self._dims = dims

        def read(i, keys):
            return tf.reshape(self.tables[i].lookup(raw_keys(keys)), [-1, dims[i]])

        # The model's forward pass over raw columns, reading this module's tables.
        lookup = Lookup(lambda ids: engine.embed_with(ids, read), raw=True)

        def serve(raw):
            logits = model.forward(raw, lookup=lookup)
            return {h.output: h.export_output(logits[h.name]) for h in model.heads}

        def signature(names):
            features = [config.feature(n) for n in names]
            return {f.name: tf.TensorSpec([None], serving_dtype(f), name=f.name) for f in features}

        if isinstance(model, RetrievalModel):
            # Each side's signature feeds only its own columns: the tower computes that side.
            head = model.heads[0].name
            self.query = tf.function(
                lambda raw: {"embedding": model.forward(raw, lookup=lookup)[head]["query"]},
                input_signature=[signature(model.query_features)],
            )
            self.candidate = tf.function(
                lambda raw: {"embedding": model.forward(raw, lookup=lookup)[head]["candidate"]},
                input_signature=[signature(model.candidate_features)],
            )
            self.serving_default = self.query.get_concrete_function()
            self.serving_signatures = {
                "serving_default": self.serving_default,
                "query": self.serving_default,
                "candidate": self.candidate.get_concrete_function(),
            }
        else:
            # Only the concrete function is kept: a tf.function attribute would be traced
            # again when the module is saved.
            self.serving_default = tf.function(
                serve, input_signature=[signature(f.name for f in config.features)], autograph=False
            ).get_concrete_function()
            self.serving_signatures = {"serving_default": self.serving_default}
        # Traced first: a model restored without a step creates its weights here.
        self.dense_variables = list(model.variables)
        self.apply_delta = self._trace_apply_delta(model)

    def _trace_apply_delta(self, model: RankingModel):
        """`apply_delta(delta)`: brings this module's tables, dense weights and step to a
        delta's (layout in `recflow.embedding.lifecycle`), in place, with core ops only.

        `delta` holds `step` (int64 scalar), `dense` (every dense weight, flattened and
        concatenated [size] float32) and per logical table `<table>/ids` [n] int64,
        `<table>/values` [n, dim] float32 and `<table>/evicted` [m] int64. Evicted ids
        get the default (zero) row, the one an unknown id reads: nothing is erased from
        the `DenseHashTable`s (DESIGN.md section 9); a new full export drops them.
        Returns {"step": step}. A function of the module, not a signature: a TF Serving
        client must not be able to change the model.

        The graph is traced at every first export of a process, so it is kept small: one
        check of every table's lengths, and per serving table one insert of the evicted
        ids and one of the new rows, all logical tables at once (their keys differ by
        slot, so the order between tables does not matter).
        """
        weights = dense_weights(model)
        sizes = [int(v.shape.num_elements()) for v in weights]
        tables = []  # per serving table: (slots, logical names, dim)
        spec = {
            "step": tf.TensorSpec([], tf.int64, name="step"),
            "dense": tf.TensorSpec([None], tf.float32, name="dense"),
        }
        for physical in model.embedding.plan:
            names = [logical.name for logical in physical.logical]
            tables.append(([physical.slot(n) for n in names], names, physical.dim))
            for name in names:
                for part, shape, dtype in DELTA_PARTS:
                    shape = [None, physical.dim] if shape == 2 else [None]
                    spec[f"{name}/{part}"] = tf.TensorSpec(
                        shape, dtype, name=delta_input_name(f"{name}/{part}")
                    )
        names = [name for _, table_names, _ in tables for name in table_names]

        def apply(delta):
            # Every check before the first write: a malformed delta changes nothing.
            checks = [tf.debugging.assert_equal(tf.size(delta["dense"]), sum(sizes),
                                                message="dense: wrong size")]
            if names:
                rows = tf.stack([tf.shape(delta[f"{n}/values"])[0] for n in names])
                ids = tf.stack([tf.size(delta[f"{n}/ids"]) for n in names])
                same = tf.equal(rows, ids)
                first = tf.gather(tf.constant(names), tf.argmin(tf.cast(same, tf.int32)))
                checks.append(tf.debugging.Assert(
                    tf.reduce_all(same),
                    [tf.strings.join([first, ": values and ids differ in length"])],
                ))
            with tf.control_dependencies(checks):
                for table, (slots, table_names, dim) in zip(self.tables, tables):
                    evicted = _served_keys([delta[f"{n}/evicted"] for n in table_names], slots)
                    table.insert(evicted, tf.zeros(tf.stack([tf.shape(evicted)[0], dim])))
                    table.insert(
                        _served_keys([delta[f"{n}/ids"] for n in table_names], slots),
                        tf.concat([delta[f"{n}/values"] for n in table_names], 0),
                    )
                for variable, part in zip(weights, tf.split(delta["dense"], sizes) if sizes else []):
                    variable.assign(tf.reshape(part, variable.shape))
                self.global_step.assign(delta["step"])
            return {"step": tf.identity(delta["step"])}

        return tf.function(apply, input_signature=[spec], autograph=False).get_concrete_function()

    def refresh(self, step: int) -> None:
        """Copies the model's current rows (evicted keys leave) and `step` into the module."""
        self.global_step.assign(step)
        for index, table in enumerate(self.tables):
            keys, emb = self._serving_rows(index)
            with tf.device("/cpu:0"):
                empty_buckets(table.resource_handle, serving_buckets(int(keys.shape[0])), self._dims[index])
                table.insert(keys, emb)


def _served_keys(ids: list[tf.Tensor], slots: list[int]) -> tf.Tensor:
    """The keys [n, 2] in a serving table, (slot, raw id), of the raw ids `ids[i]` [n_i]
    of logical table `slots[i]`, concatenated."""
    return tf.stack([slot_column(ids, slots), tf.concat(ids, 0)], axis=1)


# The per-table inputs of `apply_delta`: (name, rank, dtype).
DELTA_PARTS = (("ids", 1, tf.int64), ("values", 2, tf.float32), ("evicted", 1, tf.int64))


def delta_input_name(name: str) -> str:
    """A graph-safe placeholder name for an `apply_delta` input."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def dense_weights(model: RankingModel) -> list[tf.Variable]:
    """The model's dense float weights, in a fixed order: what a delta carries and
    `apply_delta` assigns (table routes and counters are integers, not carried)."""
    return [v for v in model.variables if v.dtype.is_floating]


def serving_buckets(keys: int) -> int:
    """The fewest buckets (a power of two) that hold `keys` without growing (a stock
    `DenseHashTable`: it doubles past `STOCK_LOAD`)."""
    return segment_buckets(keys, segments=1, load=STOCK_LOAD)[0]


def existing_versions(export_dir: str) -> list[int]:
    if not os.path.isdir(export_dir):
        return []
    return sorted(int(d) for d in os.listdir(export_dir) if re.fullmatch(r"\d+", d))


def portable_config(config) -> dict:
    """The config as a plain mapping for an export: no model dir, data paths cut to
    their file names (an export is copied to serving hosts; it must not leak them)."""
    raw = to_dict(config)
    raw.get("train", {}).pop("model_dir", None)
    data = raw.get("data", {})
    for key in ("train", "eval"):
        if data.get(key):
            data[key] = [os.path.basename(str(p).rstrip("/")) for p in data[key]]
    return raw


class Exporter:
    """Writes SavedModels of one model, reusing one `ServingModule`.

    The serving module is built (and its signatures traced) on the first export;
    later exports refresh its tables and step from the model and save it again.
    Where and as which version: `recflow.training.model_dir.ModelDir.export`.

    Args:
        model: the model to export (its current weights at each export).
    """

    def __init__(self, model: RankingModel):
        self.model = model
        self.module: ServingModule | None = None

    def save(self, directory: str, step: int | None = None) -> None:
        """Writes the SavedModel of the model at `step` (default: its global step) into
        `directory`, with its `assets.extra` (config, manifest, structure)."""
        model = self.model
        if step is None:
            step = int(model.global_step)
        if self.module is None:
            self.module = ServingModule(model, step)
        else:
            self.module.refresh(step)
        tf.saved_model.save(
            self.module, directory, signatures=self.module.serving_signatures, options=SAVE_OPTIONS
        )
        extra = os.path.join(directory, "assets.extra")
        os.makedirs(extra, exist_ok=True)
        with open(os.path.join(extra, "recflow_config.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(portable_config(model.config), f, sort_keys=False)
        write_json(os.path.join(extra, "manifest.json"), {"step": step, "version": step})
        write_json(os.path.join(extra, identity.EXPORT_FILE), identity.structure(model))


def saved_structure(export: str) -> dict | None:
    """The model structure an export records (`assets.extra/structure.json`), or None."""
    try:
        with open(os.path.join(export, "assets.extra", identity.EXPORT_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# The serving graph only: no debug info, no gradient functions of custom gradients.
SAVE_OPTIONS = tf.saved_model.SaveOptions(
    save_debug_info=False, experimental_custom_gradients=False
)


def export_saved_model(model: RankingModel, directory: str, step: int | None = None) -> str:
    """Writes a SavedModel of `model` to `directory` (a new dir, renamed into place once
    complete) with a new `Exporter`; returns `directory`. A model dir's versions:
    `recflow.training.model_dir.ModelDir.export`."""
    with staged_dir(directory) as tmp:
        Exporter(model).save(tmp, step)
    return directory
