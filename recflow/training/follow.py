"""Online learning: `recflow train --follow` trains on files as they appear.

`data.train` is watched as a stream: new files are trained once each, in name
order. The checkpoint records the files consumed and the file in progress
(with its input position), so a restart neither skips nor repeats a file.
Deltas and export versions are written on their schedules; a stop request
(SIGTERM, Ctrl-C) ends with a final checkpoint and export.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import tensorflow as tf

from recflow.data import sources
from recflow.errors import DataError
from recflow.training.trainer import Trainer, saved_value


class StreamState(tf.Module):
    """The files consumed and the file in progress, saved in each checkpoint."""

    def __init__(self):
        super().__init__(name="stream")
        self.consumed = tf.Variable("[]", dtype=tf.string, trainable=False, name="consumed")
        self.current = tf.Variable("", dtype=tf.string, trainable=False, name="current")

    def consumed_files(self) -> list[str]:
        return json.loads(self.consumed.numpy().decode())

    def current_file(self) -> str:
        return self.current.numpy().decode()

    def mark_done(self, file: str) -> None:
        self.consumed.assign(json.dumps(self.consumed_files() + [file]))
        self.current.assign("")


def follow(
    trainer: Trainer,
    poll_seconds: float = 1.0,
    on_file: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Trains on each new file of `data.train` until `trainer.request_stop()`.

    Args:
        trainer: a Trainer on the run's model dir.
        poll_seconds: how often to look for new files when idle.
        on_file: called with (file, examples, global step) after each file.

    Returns:
        A summary: steps, examples, files consumed.
    """
    trainer.prepare_model_dir()
    state = StreamState()
    saved = saved_value(trainer.checkpoint_dir, "stream/current")
    in_progress = saved.decode() if saved is not None else ""
    iterator = iter(trainer.dataset("train", epochs=1, files=[in_progress])) if in_progress else None
    trainer.open_checkpoint(iterator, stream=state)  # restores model, tables, stream state (and position)
    began, examples, start_step = time.perf_counter(), 0, int(trainer.model.global_step)
    trainer.callbacks.on_train_begin()
    while not trainer.stop_requested:
        if iterator is None:
            file = _next_file(trainer.config, state)
            if file is None:
                time.sleep(poll_seconds)
                continue
            iterator = iter(trainer.dataset("train", epochs=1, files=[file]))
            trainer.open_checkpoint(iterator, restore=False, stream=state)
            state.current.assign(file)
        trained = trainer.run_steps(iterator, files=[state.current_file()])
        examples += trained
        if trainer.stop_requested:
            break  # the file stays in progress; its input position goes into the checkpoint
        file = state.current_file()
        state.mark_done(file)
        trainer.save_checkpoint()
        iterator = None
        if on_file is not None:
            on_file(file, trained, int(trainer.model.global_step))
    summary = trainer.finish(examples, time.perf_counter() - began, start_step)
    summary["files_consumed"] = state.consumed_files()
    return summary


def _next_file(config, state: StreamState) -> str | None:
    """The first file of `data.train`, in name order, not consumed yet."""
    try:
        listed = sources.expand(config.data.train, "data.train")
    except DataError:  # no file yet is normal for a stream
        return None
    done = set(state.consumed_files())
    return next((f for f in listed if f not in done), None)
