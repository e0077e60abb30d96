"""The training progress bar: Keras's, right after a resume.

A pass resumed from a checkpoint starts part-way: the bar starts at the steps
already done (`119/196` is not shown for a pass that ends at 196/196), and the
ETA and per-step time come from the steps run since the bar started, not from
the resumed ones (which took no time in this process).
"""

from __future__ import annotations

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
