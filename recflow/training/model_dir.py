"""The model dir: one owner for what a run keeps on disk (DESIGN.md section 5).

`ModelDir` is the one writer of a model dir: its paths are `recflow.layout.Layout`'s,
and it owns the state that goes with them:

- the writer lock (`recflow.training.lock.writer`, taken before the model is
  built, without TensorFlow): one writer per model dir, and the temps of killed
  writers removed under it;
- checkpoints: open (the model, its optimizer, the delta chain, the model
  structure, the input position and a runner's or stream's objects), restore
  the newest one that reads back whole (damaged newer ones are set aside, see
  `recflow.training.checkpoints`), save (a save that raised leaves nothing
  staged);
- the lifecycle rebuild (`evict`, on the checkpoint schedule), which keeps the
  ids it removes for the next delta once a delta chain is on;
- the delta chain (`recflow.training.deltas`: one sequence counter; a Kafka
  stream adds its offsets through `delta_info`) and export versions (a whole
  version is never rewritten; a damaged one is set aside and written again);
- `metrics.json` and `config.yaml`.

Directories (exports, deltas) are written to a temp dir beside their place and
renamed into it, one mechanism for both (`recflow.atomic.staged_dir`): a crash
never leaves half of one. A delta replaces one of its step that the checkpoint
does not record (the old one stays whole until the new one is complete).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from typing import Callable

import tensorflow as tf
import yaml
from google.protobuf.message import DecodeError
from tensorflow.core.protobuf import saved_model_pb2

from recflow.atomic import staged_dir, write_json
from recflow.config.loader import dump_config
from recflow.config.schema import Config
from recflow.data import cache as input_cache
from recflow.embedding import lifecycle, reshard
from recflow.embedding.engine import check_checkpoint
from recflow.errors import DataError, RecflowError
from recflow.exporter.saved_model import Exporter, dense_weights, existing_versions, saved_structure
from recflow.layout import Layout
from recflow.models import identity
from recflow.models.base import RankingModel
from recflow.training import checkpoints
from recflow.training.deltas import DeltaChain, set_aside_stale_deltas
from recflow.training.lock import ensure_dir

logger = logging.getLogger(__name__)


class ModelDir(Layout):
    """The model dir of one model: its checkpoints, deltas, exports and metrics.

    Args:
        path: the model dir.
        model: the model whose state it keeps (built).
        config: the run config (`train.keep_checkpoints`, `export.keep`, the delta
            schedule; written as `config.yaml` by a training run).
        status: says what a long step is doing (a restore, a reshard); default silent.
        timing: a `recflow.training.timing.Timing` whose `export` phase counts the exports.

    Attributes:
        delta_info: `() -> dict` of more manifest fields, asked for at each delta
            written (a Kafka stream's `kafka_offsets`), or None.
        evicted_rows: rows the lifecycle rebuild removed so far, per logical table
            (tables with an eviction policy only).
    """

    def __init__(
        self,
        path: str,
        model: RankingModel,
        config: Config,
        status: Callable[[str], None] | None = None,
        timing=None,
    ):
        super().__init__(path)
        self.model = model
        self.config = config
        self._status = status or (lambda message: None)
        self._timing = timing
        # What the variables mean (`recflow.models.identity`), in every checkpoint.
        self.structure = identity.structure(model)
        self._structure = tf.Variable(identity.dumps(self.structure), trainable=False, name=identity.VARIABLE)
        self.deltas = DeltaChain()
        self.delta_info: Callable[[], dict] | None = None
        self.evicted_rows: dict[str, int] = {}
        self._exporter = Exporter(model)  # one serving module, refreshed per export
        self._checkpoint: tf.train.Checkpoint | None = None
        self._manager: tf.train.CheckpointManager | None = None
        self._saved_step = -1
        self._record_config = False  # a training run writes config.yaml once its checkpoint restored

    def prepare(self) -> None:
        """Creates the model dir for a training run; the next restore writes its config.yaml
        (only then: the config must first prove it fits the model dir's checkpoint)."""
        ensure_dir(self.path)
        self._record_config = True

    # ------------------------------------------------------------------ checkpoints

    def saved_value(self, name: str):
        """A top-level variable of the newest readable checkpoint (None when none holds it),
        read before the checkpoint is opened (see `checkpoints.saved_value`)."""
        return checkpoints.saved_value(self.checkpoint_dir, name)

    def open_checkpoint(
        self, iterator=None, restore: bool = True, restore_position: bool = True, **extra
    ) -> None:
        """Creates the checkpoint of the model, the optimizer, the delta chain, the input
        position (`iterator`) and `extra` objects; restores the latest one when `restore`.

        Args:
            iterator: a `tf.data` iterator whose position goes into the checkpoint.
            restore: restore the newest readable checkpoint (False: a new input pass of
                a run already restored; the next save records it).
            restore_position: restore the iterator's position and its record
                (`recflow.data.cache.VARIABLE`) too (False: the iterator starts its pass
                over; the next save records its position).
            **extra: more trackable objects to save under their names (e.g. `epoch`).

        Raises:
            RecflowError: the checkpoint was written for another model structure or an
                unreadable key format, or no checkpoint present reads back whole.
            DataError: the checkpoint's input position does not fit `iterator`'s
                pipeline (a data setting that shapes it changed).
        """
        model = self.model
        objects = {
            "model": model,
            "optimizer": model.optimizer,
            **self.deltas.checkpointed(),
            identity.VARIABLE: self._structure,
            **extra,
        }
        if iterator is not None:
            objects["iterator"] = iterator
        self._checkpoint = tf.train.Checkpoint(**objects)
        latest = None
        if restore:
            # The newest checkpoint that reads back whole; the index file is rebuilt
            # to match before the manager reads it.
            latest = checkpoints.readable_checkpoint(self.checkpoint_dir)
            checkpoints.repair_checkpoints(self.checkpoint_dir, latest)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, self.checkpoint_dir, max_to_keep=self.config.train.keep_checkpoints
        )
        if not restore:
            self._saved_step = -1  # the next checkpoint must record the new objects
            return
        if latest:
            check_checkpoint(latest)
            self._check_identity(latest)
            self._warn_moved_columns()
            self._status(f"Restoring {latest}")
            # The input position is read on its own, after the rest: what fails there is
            # the position (without it, the record of it is left out too).
            left_out = {"iterator"} if restore_position else {"iterator", input_cache.VARIABLE}
            rest = tf.train.Checkpoint(**{k: v for k, v in objects.items() if k not in left_out})
            model.embedding.restore(rest, latest).expect_partial()
            if iterator is not None and restore_position:
                try:
                    tf.train.Checkpoint(iterator=iterator).read(latest).expect_partial()
                except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError):
                    raise DataError(
                        f"{latest}: its input position does not fit this config's input pipeline "
                        "(a data setting that shapes it changed since); go back to the data "
                        "settings the checkpoint was written with to finish its epoch"
                    ) from None
            self._reshard(latest)
            self._saved_step = int(model.global_step)
            logger.info("restored %s at step %d", latest, self._saved_step)
        set_aside_stale_deltas(self.deltas_dir, int(model.global_step))
        self.deltas.adopt(self.deltas_dir, int(model.global_step))
        if self._record_config:  # only once the model dir's checkpoint is known to fit
            dump_config(self.config, self.config_path)

    def _check_identity(self, checkpoint: str) -> None:
        """Refuses (one line, nothing written) a checkpoint whose variables mean something
        else under this config: see `recflow.models.identity`."""
        saved = checkpoints.recorded_structure(tf.train.load_checkpoint(checkpoint))
        if saved is None:
            raise RecflowError(
                f"{self.path}: its checkpoint {os.path.basename(checkpoint)} records no model "
                "structure (written by an older recflow), so it cannot be checked against this "
                "config; train a new model dir"
            )
        identity.check(saved, self.structure, self.path)

    def _warn_moved_columns(self) -> None:
        """Warns when a feature reads another column than the model dir's last run did
        (its config.yaml). The identity leaves columns out, so that a column renamed in
        the data can follow its feature; but a feature pointed at another feature's
        column looks its ids up in the wrong table."""
        try:
            with open(self.config_path, encoding="utf-8") as f:
                before = yaml.safe_load(f)["features"]
            read = {f["name"]: f.get("column") or f["name"] for f in before}
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            return  # no readable record of the last run's columns: nothing to compare
        moved = [
            f"{f.name!r} reads column {f.source!r} (trained on {read[f.name]!r})"
            for f in self.config.features
            if f.name in read and read[f.name] != f.source
        ]
        if moved:
            logger.warning(
                "%s: %s; fine for a column renamed in the data, but another feature's column "
                "would look its ids up in this feature's table",
                self.path,
                "; ".join(moved),
            )

    def _reshard(self, checkpoint: str) -> None:
        """Moves the restored checkpoint's rows to their shards when it was written with
        another number of shards (parameter servers): see `recflow.embedding.reshard`."""
        engine = self.model.embedding
        saved = reshard.saved_shards(checkpoint)
        if saved and saved != engine.placement.num_shards:
            # A warning, not a status line: a launched chief runs quiet, and its log must
            # tell that the cluster's size changed.
            logger.warning(
                "Resharding the tables of %s: %d -> %d shards",
                os.path.basename(checkpoint), saved, engine.placement.num_shards,
            )
            reshard.reshard(engine, checkpoint)

    def restore(self) -> int:
        """Restores the latest checkpoint (without input position) unless one is open;
        returns the global step (0: no checkpoint)."""
        if self._checkpoint is None:
            self.open_checkpoint()
        return int(self.model.global_step)

    @property
    def saved_step(self) -> int:
        """The step of the checkpoint last written or restored (-1: none yet)."""
        return self._saved_step

    def save_checkpoint(self, evict: bool = True) -> str:
        """Runs the lifecycle rebuild (unless `evict` is False: done already), then writes
        a checkpoint of everything; a save that raises (a full disk) leaves nothing staged.

        No rebuild follows a delta of the same step (a run's last step, a followed file's
        end): the delta holds the step's rows, and so must the checkpoint and the export
        of that step, or the chain applied to an export would differ from the export at
        the same step. Those rows go at the next scheduled eviction, in the next delta."""
        step = int(self.model.global_step)
        if evict and int(self.deltas.step) != step:
            self.evict()
        try:
            path = self._manager.save(checkpoint_number=step)
        except BaseException:
            checkpoints.discard_failed_save(self.checkpoint_dir, step)
            raise
        self._saved_step = step
        return path

    def state_changed(self) -> None:
        """Something the checkpoint saves changed outside a step (a new epoch began): the
        final checkpoint is written even at the step saved last."""
        self._saved_step = -1

    def save_final_checkpoint(self, evict: bool = True) -> None:
        """The end-of-training checkpoint, unless this step was just saved.

        `evict`: the rebuild runs at it when training ended; not when a signal
        interrupted it: the resumed run then goes on exactly as one never interrupted
        (whose schedule has no eviction at this step).
        """
        if self._saved_step != int(self.model.global_step):
            self.save_checkpoint(evict=evict)

    # ------------------------------------------------------------------ lifecycle

    def evict(self) -> None:
        """The lifecycle rebuild at the current step: removes stale rows (`eviction.ttl_steps`
        / `max_keys`) and stale admission counters.

        Once a delta chain is on (deltas scheduled, or one written by `recflow export
        --delta`) the ids removed are kept for the next delta; the rows each logical
        table lost add to `evicted_rows`.
        """
        step = int(self.model.global_step)
        evicted, gone = lifecycle.evict_tracked(self.model.embedding, step)
        if gone and self.deltas.started(self._deltas_scheduled()):
            self.deltas.forget(gone)
        for name, ids in gone.items():
            self.evicted_rows[name] = self.evicted_rows.get(name, 0) + int(ids.size)
        if any(evicted.values()):
            logger.info("step %d: evicted %s", step, evicted)

    def _deltas_scheduled(self) -> bool:
        export = self.config.export
        return export.delta_every_steps is not None or export.delta_every_seconds is not None

    # ------------------------------------------------------------------ deltas, exports

    def write_delta(self) -> str:
        """Writes `deltas/<step>/`: rows updated and ids evicted since the previous delta,
        and the dense weights (layout in `recflow.embedding.lifecycle`); returns its path.

        The previous delta's step and sequence number and the ids evicted since come
        from the checkpoint, so a resumed run writes the same deltas as one never
        stopped. A delta of this step that the checkpoint records is kept; one it does
        not record is replaced.
        """
        step = int(self.model.global_step)
        final = os.path.join(self.deltas_dir, str(step))
        if os.path.isdir(final) and int(self.deltas.step) == step:
            return final
        with staged_dir(final, replace=True) as tmp:
            self.deltas.write(
                self.model.embedding, tmp, step,
                structure_sha256=lifecycle.structure_fingerprint(self.structure),
                dense=[(v.name, v.numpy()) for v in dense_weights(self.model)],
                extra=self.delta_info() if self.delta_info is not None else None,
            )  # fmt: skip
        self.deltas.advance(step)
        return final

    def export(self) -> str:
        """Writes `export/<global step>/` (a SavedModel, see `recflow.exporter.saved_model`)
        and keeps the newest `export.keep` versions; returns its path.

        A whole version is never rewritten: an existing export of the same step and
        model structure (a replayed step, or `recflow export` run twice) is kept as it
        is. A damaged one of that structure (see `export_problem`) is moved to
        `export/.damaged/<step>`, with a warning naming it, and written again.

        Raises:
            RecflowError: an export of this step exists for another model structure.
        """
        step = int(self.model.global_step)
        final = os.path.join(self.export_dir, str(step))
        with self._timing.phase("export") if self._timing else contextlib.nullcontext():
            if os.path.isdir(final):
                saved = saved_structure(final)
                if saved is None or identity.changes(saved, self.structure):
                    differs = "none recorded" if saved is None else (
                        identity.changes(saved, self.structure)[0][0] + " differs"
                    )
                    raise RecflowError(
                        f"{final}: an export of step {step} exists for another model structure "
                        f"({differs}); versions are never rewritten: move it away, or train on "
                        "to a later step"
                    )
                problem = export_problem(final)
                if problem is None:
                    logger.info("%s exists (same step, same structure): kept", final)
                    return final
                aside = os.path.join(self.export_dir, DAMAGED_DIR, str(step))
                shutil.rmtree(aside, ignore_errors=True)  # one set aside before: this one is newer
                os.makedirs(os.path.dirname(aside), exist_ok=True)
                os.replace(final, aside)
                logger.warning("%s: damaged export (%s), moved to %s; writing it again", final, problem, aside)
            with staged_dir(final) as tmp:
                self._exporter.save(tmp, step)
            keep = self.config.export.keep
            if keep:
                for old in existing_versions(self.export_dir)[:-keep]:
                    shutil.rmtree(os.path.join(self.export_dir, str(old)), ignore_errors=True)
        return final

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict:
        """`metrics.json` as last written ({} when there is none, or it does not parse)."""
        try:
            with open(self.metrics_path, encoding="utf-8") as f:
                written = json.load(f)
        except (OSError, ValueError):
            return {}
        return written if isinstance(written, dict) else {}

    def write_metrics(self, result: dict, merge: bool = False) -> None:
        """Writes `metrics.json` (strict JSON); `merge`: over the metrics already there."""
        write_json(self.metrics_path, {**self.metrics(), **result} if merge else result)

    def missing_at_end(self, step: int) -> list[str]:
        """What a run that ended at `step` left unwritten: its `metrics` and (unless
        `export.at_end` is off) its `export`, missing or not whole; [] when it ended."""
        missing = [] if self.metrics().get("steps") == step else ["metrics"]
        final = os.path.join(self.export_dir, str(step))
        if self.config.export.at_end and not (os.path.isdir(final) and export_problem(final) is None):
            missing.insert(0, "export")
        return missing


DAMAGED_DIR = ".damaged"  # export/.damaged/<step>: versions that did not read back whole


def export_problem(path: str) -> str | None:
    """None when the SavedModel at `path` reads back whole, else why not (one line): its
    saved_model.pb must parse and every tensor of its variables read back (TF checks
    each one's length and CRC32C, see `checkpoints.verify_checkpoint`)."""
    try:
        with open(os.path.join(path, "saved_model.pb"), "rb") as f:
            saved_model_pb2.SavedModel.FromString(f.read())
    except OSError as e:
        return f"saved_model.pb: {e.strerror}"
    except DecodeError:
        return "saved_model.pb does not parse"
    variables = os.path.join(path, "variables", "variables")
    if not os.path.exists(variables + ".index"):
        return "variables/variables.index is missing"
    return checkpoints.verify_checkpoint(variables)
