"""The training loop's hooks as Keras callbacks (`tf_keras.callbacks.Callback`).

The loop calls, in list order:

    on_train_begin(logs)
    on_epoch_begin(epoch, logs)
    on_train_batch_end(step, logs)    step: the global step after the step(s) just run
    on_epoch_end(epoch, logs)
    on_train_end(logs)

`logs` of a batch end: `loss` (the last step's), `previous_step` (the global step
before the steps just run: the local loop runs one step at a time, the
parameter-server loop a chunk of steps per worker) and `examples` (rows trained
so far by this run). A schedule of every N steps fires when the step reaches or
passes a multiple of N (`crossed`); a schedule of every S seconds
(`train.checkpoint_every_seconds`, `export.every_seconds`,
`export.delta_every_seconds`, for streams that never end) fires at the first step
end S seconds or more after it last fired (or after training began).

The built-in schedule runs, after a step: eviction -> delta -> export ->
checkpoint. Eviction comes first so a delta holds only surviving rows; the
checkpoint comes last, so a kill anywhere before it replays from the previous
checkpoint and rewrites this step's delta and export, and the checkpoint
records the delta's step, so a resume continues the delta chain exactly.
User callbacks run after the built-in ones; setting `self.model.stop_training
= True` (as in Keras) ends training after the current step with a final
checkpoint. SIGTERM and SIGINT are handled by the trainer itself
(`Trainer.signals_stop`), the same way for the CLI and the Python API.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import tensorflow as tf
import tf_keras as keras

logger = logging.getLogger(__name__)


def crossed(previous: int, step: int, every: int | None) -> bool:
    """Whether the steps `previous + 1 .. step` hold a multiple of `every` (> 0)."""
    return bool(every) and previous // every < step // every


class Schedule:
    """Every `steps` steps and/or every `seconds` seconds (either may be None).

    `due(previous, step)` is decided once per step, so callbacks that share a schedule
    (eviction and checkpoint) agree; a time schedule restarts when it fires.
    """

    def __init__(self, steps: int | None, seconds: float | None):
        self.steps, self.seconds = steps, seconds
        self._since = time.monotonic()
        self._step: int | None = None
        self._due = False

    def restart(self) -> None:
        self._since, self._step = time.monotonic(), None

    def due(self, previous: int, step: int) -> bool:
        if step != self._step:
            now = time.monotonic()
            late = self.seconds is not None and now - self._since >= self.seconds
            self._step, self._due = step, crossed(previous, step, self.steps) or late
            if self._due:
                self._since = now
        return self._due


class TrainerCallback(keras.callbacks.Callback):
    """A callback bound to a `Trainer` (for its model dir, checkpoint and export).

    Args:
        trainer: the trainer whose loop calls this callback.
    """

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer


class _Scheduled(TrainerCallback):
    """A callback that runs on a `Schedule` (its own, or one shared with another)."""

    def __init__(self, trainer, schedule: Schedule):
        super().__init__(trainer)
        self.schedule = schedule

    def on_train_begin(self, logs=None):
        self.schedule.restart()


class EvictionCallback(_Scheduled):
    """Removes stale rows (`eviction.ttl_steps` / `max_keys`) at every checkpoint step."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.trainer.evict()


class DeltaCallback(_Scheduled):
    """Writes `deltas/<step>/` every `export.delta_every_steps` / `delta_every_seconds`."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.trainer.write_delta()


class ExportCallback(_Scheduled):
    """Writes `export/<step>/` every `export.every_steps` / `every_seconds`."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.trainer.export()


class CheckpointCallback(_Scheduled):
    """Checkpoints every `train.checkpoint_every_steps` / `checkpoint_every_seconds`
    (eviction ran just before, on the same schedule, see `EvictionCallback`), and at
    the end of training unless the step was just saved."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.trainer.save_checkpoint(evict=False)

    def on_train_end(self, logs=None):
        self.trainer.save_final_checkpoint()


class TableHealth:
    """Counts per logical table between two table logs: what eviction removed and what was admitted.

    `Trainer.evict` runs eviction inside `evicting()`, which counts the rows each
    logical table lost; between two logs the rows a table gained are then its
    admissions: `keys now - keys at the previous log + evicted since`. Only
    tables with an eviction policy lose rows, so without one no count is taken.

    Args:
        trainer: the trainer whose embedding engine is counted.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self._logged: dict[str, int] | None = None  # keys per table at the previous log
        self._evicted: dict[str, int] = {}

    def _keys(self) -> dict[str, int]:
        return {name: s["keys"] for name, s in self.trainer.model.embedding.table_stats().items()}

    def _evicts(self) -> bool:
        config = self.trainer.config
        return any(config.table(name).eviction is not None for name in config.table_names())

    @contextlib.contextmanager
    def evicting(self):
        """The context eviction runs in: the rows it removes are counted per logical table."""
        if not self._evicts():
            yield
            return
        before = self._keys()
        yield
        for name, keys in self._keys().items():
            self._evicted[name] = self._evicted.get(name, 0) + before.get(name, 0) - keys

    def start(self) -> None:
        """The counts start here (training begins, after a restore)."""
        self._logged, self._evicted = self._keys(), {}

    def read(self) -> dict[str, dict]:
        """Per logical table: keys, waiting_keys and bytes now (as `recflow tables --json`),
        and evictions and admissions since the previous `read`."""
        stats = self.trainer.model.embedding.table_stats()
        logged = self._logged or {}
        out = {}
        for name, s in stats.items():
            evicted = self._evicted.get(name, 0)
            out[name] = {
                "keys": s["keys"],
                "waiting_keys": s["waiting_keys"],
                "bytes": s["bytes"],
                "evictions": evicted,
                "admissions": s["keys"] - logged.get(name, 0) + evicted,
            }
        self._logged = {name: s["keys"] for name, s in stats.items()}
        self._evicted = {}
        return out


class TensorBoardLogger(TrainerCallback):
    """Writes the run to TensorBoard, in `MODEL_DIR/logs`.

    - every `train.log_every_steps`: `train/loss` (the last step's) and
      `train/examples_per_sec` (rows trained since the previous log over the
      wall time since it);
    - at every checkpoint step and at the end of training (after the checkpoint
      and its eviction), per logical table T: `tables/T/keys`,
      `tables/T/waiting_keys`, `tables/T/bytes`, and `tables/T/evictions` and
      `tables/T/admissions` since the previous table log (see `TableHealth`).
      Reading every table costs about what checkpointing it does, so it is not
      done at every loss log.

    Evaluations are written by `write_evaluation`.
    """

    def __init__(self, trainer):
        super().__init__(trainer)
        self._writer = None
        self._since = (0.0, 0)  # (time, examples) at the previous loss log
        self._tables_step = -1  # the step of the previous table log

    @property
    def writer(self):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.trainer.model_dir, "logs"))
        return self._writer

    def on_train_begin(self, logs=None):
        self._since = (time.perf_counter(), self.trainer.examples_trained)
        self.trainer.table_health.start()

    def on_train_batch_end(self, batch, logs=None):
        config = self.trainer.config.train
        if crossed(logs["previous_step"], batch, config.log_every_steps):
            now, examples = time.perf_counter(), logs["examples"]
            then, before = self._since
            self._since = (now, examples)
            with self.writer.as_default(step=batch):
                if logs["loss"] is not None:
                    tf.summary.scalar("train/loss", logs["loss"])
                if now > then:
                    tf.summary.scalar("train/examples_per_sec", (examples - before) / (now - then))
        if crossed(logs["previous_step"], batch, config.checkpoint_every_steps):
            self.write_tables(batch)

    def write_tables(self, step: int) -> None:
        self._tables_step = step
        with self.writer.as_default(step=step):
            for name, stats in self.trainer.table_health.read().items():
                for key, value in stats.items():
                    tf.summary.scalar(f"tables/{name}/{key}", value)

    def on_train_end(self, logs=None):
        step = int(self.trainer.model.global_step)
        if step != self._tables_step:  # not logged at this step's checkpoint already
            self.write_tables(step)
        self.writer.flush()


def write_evaluation(model_dir: str, step: int, result: dict) -> None:
    """Writes an evaluation's metrics to TensorBoard at `step`: `eval/<metric>`, and
    `eval/<head>/<metric>` for each head of a multi-task model; undefined ones
    (NaN) are left out."""
    writer = tf.summary.create_file_writer(os.path.join(model_dir, "logs"))
    with writer.as_default(step=step):
        for key, value in result.items():
            if key.startswith("eval_") or isinstance(value, (bool, str)) or value is None:
                continue
            if math.isfinite(value):
                tf.summary.scalar(f"eval/{key}", value)
    writer.close()


def default_callbacks(trainer) -> list[keras.callbacks.Callback]:
    """The built-in schedule, in the order it must run: evict, delta, export, checkpoint, log."""
    train, export = trainer.config.train, trainer.config.export
    checkpoint = Schedule(train.checkpoint_every_steps, train.checkpoint_every_seconds)
    return [
        EvictionCallback(trainer, checkpoint),
        DeltaCallback(trainer, Schedule(export.delta_every_steps, export.delta_every_seconds)),
        ExportCallback(trainer, Schedule(export.every_steps, export.every_seconds)),
        CheckpointCallback(trainer, checkpoint),
        TensorBoardLogger(trainer),
    ]


class CallbackList:
    """Calls a list of callbacks in order (bound to the model like Keras's `CallbackList`).

    Args:
        callbacks: the callbacks.
        model: set as each callback's `model`.
    """

    def __init__(self, callbacks, model):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            callback.set_model(model)

    def on_train_begin(self, logs=None):
        for c in self.callbacks:
            c.on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        for c in self.callbacks:
            c.on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, step, logs):
        for c in self.callbacks:
            c.on_train_batch_end(step, logs)

    def on_epoch_end(self, epoch, logs=None):
        for c in self.callbacks:
            c.on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None):
        for c in self.callbacks:
            c.on_train_end(logs)
