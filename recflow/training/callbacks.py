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
so far by this run); of the train end: `steps`, `examples` and `interrupted`
(whether a signal stopped training). A schedule of every N steps fires when the step reaches or
passes a multiple of N (`crossed`); a schedule of every S seconds
(`train.checkpoint_every_seconds`, `export.every_seconds`,
`export.delta_every_seconds`, for streams that never end) fires at the first step
end S seconds or more after it last fired (or after training began).

The built-in schedule runs, after a step: eviction -> table growth -> delta ->
export -> checkpoint. Each built-in callback acts on the run's `ModelDir`
(`recflow.training.model_dir`) or its tables, never on the trainer. Eviction
comes first so a delta holds only surviving rows (and growth sees the shards
eviction left); the
checkpoint comes last, so a kill anywhere before it replays from the previous
checkpoint and rewrites this step's delta and export, and the checkpoint
records the delta's step, so a resume continues the delta chain exactly.
User callbacks run after the built-in ones; setting `self.model.stop_training
= True` (as in Keras) ends training after the current step with a final
checkpoint. SIGTERM and SIGINT are handled by the trainer itself
(`Trainer.signals_stop`), the same way for the CLI and the Python API.
"""

from __future__ import annotations

import logging
import math
import time

import tensorflow as tf
import tf_keras as keras

from recflow.config.schema import Config
from recflow.embedding.engine import EmbeddingEngine
from recflow.training.model_dir import ModelDir

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


class _Scheduled(keras.callbacks.Callback):
    """A callback that acts on a model dir on a `Schedule` (its own, or one shared
    with another).

    Args:
        model_dir: the run's `ModelDir`.
        schedule: when it acts.
    """

    def __init__(self, model_dir: ModelDir, schedule: Schedule):
        super().__init__()
        self.model_dir = model_dir
        self.schedule = schedule

    def on_train_begin(self, logs=None):
        self.schedule.restart()


class EvictionCallback(_Scheduled):
    """Removes stale rows (`eviction.ttl_steps` / `max_keys`) at every checkpoint step
    (`ModelDir.evict`, the lifecycle rebuild)."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.model_dir.evict()


class GrowthCallback(keras.callbacks.Callback):
    """After every step (every wave of PS chunks), lays out again the table shards that the
    next step's inserts could make double a segment (`EmbeddingEngine.grow`), so a
    growing table keeps about 1.1x-1.3x the buckets of its keys
    (`recflow.embedding.table`, "Growth")."""

    def __init__(self, engine: EmbeddingEngine):
        super().__init__()
        self.engine = engine

    def on_train_batch_end(self, batch, logs=None):
        moved = self.engine.grow()
        if moved:
            logger.debug("step %d: tables grown, keys moved %s", batch, moved)


class DeltaCallback(_Scheduled):
    """Writes `deltas/<step>/` every `export.delta_every_steps` / `delta_every_seconds`."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.model_dir.write_delta()


class ExportCallback(_Scheduled):
    """Writes `export/<step>/` every `export.every_steps` / `every_seconds`."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.model_dir.export()


class CheckpointCallback(_Scheduled):
    """Checkpoints every `train.checkpoint_every_steps` / `checkpoint_every_seconds`
    (eviction ran just before, on the same schedule, see `EvictionCallback`), and at
    the end of training unless the step was just saved (with eviction, unless a
    signal interrupted training)."""

    def on_train_batch_end(self, batch, logs=None):
        if self.schedule.due(logs["previous_step"], batch):
            self.model_dir.save_checkpoint(evict=False)

    def on_train_end(self, logs=None):
        self.model_dir.save_final_checkpoint(evict=not (logs or {}).get("interrupted"))


class TableHealth:
    """Counts per logical table between two table logs: what eviction removed and what was admitted.

    The lifecycle rebuild (`ModelDir.evict`) adds the rows each logical table lost to
    `ModelDir.evicted_rows`; between two logs the rows a table gained are then its
    admissions: `keys now - keys at the previous log + evicted since`.

    Args:
        engine: the embedding engine whose tables are counted.
        model_dir: the model dir whose rebuilds evict rows.
    """

    def __init__(self, engine: EmbeddingEngine, model_dir: ModelDir):
        self.engine, self.model_dir = engine, model_dir
        self._logged: dict[str, int] | None = None  # keys per table at the previous log
        self._evicted: dict[str, int] = {}  # `model_dir.evicted_rows` at the previous log

    def start(self) -> None:
        """The counts start here (training begins, after a restore)."""
        self._logged = {name: s["keys"] for name, s in self.engine.table_stats().items()}
        self._evicted = dict(self.model_dir.evicted_rows)

    def read(self) -> dict[str, dict]:
        """Per logical table: keys, waiting_keys and bytes now (as `recflow tables --json`),
        and evictions and admissions since the previous `read`."""
        stats = self.engine.table_stats()
        logged = self._logged or {}
        total = self.model_dir.evicted_rows
        out = {}
        for name, s in stats.items():
            evicted = total.get(name, 0) - self._evicted.get(name, 0)
            out[name] = {
                "keys": s["keys"],
                "waiting_keys": s["waiting_keys"],
                "bytes": s["bytes"],
                "evictions": evicted,
                "admissions": s["keys"] - logged.get(name, 0) + evicted,
            }
        self._logged = {name: s["keys"] for name, s in stats.items()}
        self._evicted = dict(total)
        return out


class TensorBoardLogger(keras.callbacks.Callback):
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

    Args:
        logs_dir: where the event files go (`ModelDir.logs_dir`).
        health: the table counts (`TableHealth`).
        train: the run's `train` config (`log_every_steps`, `checkpoint_every_steps`).
    """

    def __init__(self, logs_dir: str, health: TableHealth, train):
        super().__init__()
        self.logs_dir, self.health, self.train = logs_dir, health, train
        self._writer = None
        self._since = (0.0, 0)  # (time, examples) at the previous loss log
        self._tables_step = -1  # the step of the previous table log

    @property
    def writer(self):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.logs_dir)
        return self._writer

    def on_train_begin(self, logs=None):
        self._since = (time.perf_counter(), (logs or {}).get("examples", 0))
        self.health.start()

    def on_train_batch_end(self, batch, logs=None):
        config = self.train
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
            for name, stats in self.health.read().items():
                for key, value in stats.items():
                    tf.summary.scalar(f"tables/{name}/{key}", value)

    def on_train_end(self, logs=None):
        step = logs["steps"]
        if step != self._tables_step:  # not logged at this step's checkpoint already
            self.write_tables(step)
        self.writer.flush()


def write_evaluation(logs_dir: str, step: int, result: dict) -> None:
    """Writes an evaluation's metrics to TensorBoard (`logs_dir`: `ModelDir.logs_dir`) at
    `step`: `eval/<metric>`, and `eval/<head>/<metric>` for each head of a multi-task
    model; undefined ones (NaN) are left out."""
    writer = tf.summary.create_file_writer(logs_dir)
    with writer.as_default(step=step):
        for key, value in result.items():
            if key.startswith("eval_") or isinstance(value, (bool, str)) or value is None:
                continue
            if math.isfinite(value):
                tf.summary.scalar(f"eval/{key}", value)
    writer.close()


def default_callbacks(
    model_dir: ModelDir, config: Config, engine: EmbeddingEngine
) -> list[keras.callbacks.Callback]:
    """The built-in schedule of `config`, in the order it must run: evict, grow the
    tables, delta, export, checkpoint, log (the table counts of `engine`)."""
    train, export = config.train, config.export
    checkpoint = Schedule(train.checkpoint_every_steps, train.checkpoint_every_seconds)
    return [
        EvictionCallback(model_dir, checkpoint),
        GrowthCallback(engine),
        DeltaCallback(model_dir, Schedule(export.delta_every_steps, export.delta_every_seconds)),
        ExportCallback(model_dir, Schedule(export.every_steps, export.every_seconds)),
        CheckpointCallback(model_dir, checkpoint),
        TensorBoardLogger(model_dir.logs_dir, TableHealth(engine, model_dir), train),
    ]


class CallbackList:
    """Calls a list of callbacks in order (bound to the model like Keras's `CallbackList`).

    Args:
        callbacks: the callbacks.
        model: set as each callback's `model`.
    """

    def __init__(self, callbacks, model):
        self.model = model
        self.callbacks = []
        for callback in callbacks:
            self.append(callback)

    def append(self, callback) -> None:
        """Adds `callback` at the end of the list (bound to the model)."""
        callback.set_model(self.model)
        self.callbacks.append(callback)

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
