"""What a person watching a run sees: a progress bar for a file run, a live line for a stream.

A pass resumed from a checkpoint starts part-way: the bar starts at the steps
already done (`119/196` is not shown for a pass that ends at 196/196), and the
ETA and per-step time come from the steps run since the bar started, not from
the resumed ones (which took no time in this process).

A stream (`--follow`, `data.format: kafka`) has no total to draw a bar against:
`StreamStatus` prints its rate and how far it is behind its source instead.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

import tf_keras as keras


class Progress(keras.utils.Progbar):
    """A `tf_keras.utils.Progbar` that starts at step `done` of `target`.

    Args:
        target: the steps of the whole pass (or run), None when unknown.
        done: the steps of it done before this process started it.
        verbose: 0 silent, 1 the bar.
    """

    def __init__(self, target: int | None, done: int = 0, verbose: int = 1):
        super().__init__(target, verbose=verbose, stateful_metrics=["loss"])
        self.done = done

    def _estimate_step_duration(self, current, now):
        # Keras divides the time since the bar started by `current`: only the steps
        # run since then took that time.
        return super()._estimate_step_duration(current - self.done, now)


def pass_position(step: int, epoch: int, per_epoch: int | None) -> int:
    """The steps of pass `epoch` done at global `step`, when every pass has `per_epoch` steps."""
    if not per_epoch:
        return 0
    return min(max(step - epoch * per_epoch, 0), per_epoch)


class StreamStatus(keras.callbacks.Callback):
    """A stream run's live line, at most every `every_seconds` of training:
    `step 1200  1,850 ex/s  lag 3,400 messages` (the rate over the interval).

    Args:
        lag: what the stream is behind its source, as shown after `lag` (None: unknown).
        every_seconds: the least time between two lines.
        out: the stream written to (default: the current `sys.stdout`).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        lag: Callable[[], str | None],
        every_seconds: float = 10.0,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        self.lag, self.every, self.out, self.clock = lag, every_seconds, out, clock
        self._since = (0.0, 0)  # (time, examples) at the previous line

    def on_train_begin(self, logs=None):
        self._since = (self.clock(), 0)

    def on_train_batch_end(self, batch, logs=None):
        now, (then, before) = self.clock(), self._since
        if now - then < self.every:
            return
        examples = logs["examples"]
        self._since = (now, examples)
        lag = self.lag()
        line = f"step {batch}  {(examples - before) / (now - then):,.0f} ex/s  lag {lag if lag is not None else '?'}"
        print(line, file=self.out or sys.stdout, flush=True)
