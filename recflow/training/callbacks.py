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

import logging
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


class LossLogger(TrainerCallback):
    """Writes the loss to TensorBoard (`MODEL_DIR/logs`) every `train.log_every_steps`."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self._writer = None

    def on_train_batch_end(self, batch, logs=None):
        if not crossed(logs["previous_step"], batch, self.trainer.config.train.log_every_steps):
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.trainer.model_dir, "logs"))
        with self._writer.as_default(step=batch):
            tf.summary.scalar("loss", logs["loss"])

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()


def default_callbacks(trainer) -> list[keras.callbacks.Callback]:
    """The built-in schedule, in the order it must run: evict, delta, export, checkpoint, log."""
    train, export = trainer.config.train, trainer.config.export
    checkpoint = Schedule(train.checkpoint_every_steps, train.checkpoint_every_seconds)
    return [
        EvictionCallback(trainer, checkpoint),
        DeltaCallback(trainer, Schedule(export.delta_every_steps, export.delta_every_seconds)),
        ExportCallback(trainer, Schedule(export.every_steps, export.every_seconds)),
        CheckpointCallback(trainer, checkpoint),
        LossLogger(trainer),
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
