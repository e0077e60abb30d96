"""Where a run's seconds go: the `timing` section of metrics.json.

    startup  process start -> training begins (imports, config, model construction)
    trace    tracing the training step into a graph (its Python side; the graph's
             optimization at the first run counts under train)
    train    the training loop, all passes (input, steps, periodic checkpoints,
             deltas and exports)
    eval     evaluation
    export   SavedModel exports, periodic ones included (the export at the end runs
             beside the evaluation: their seconds overlap)
    steady_examples_per_sec  examples / s over passes 2.. of a run from step 0
             (present with 2 passes or more): the rate once everything is traced
    cpu      the CPU seconds (user + system, all threads of the process) of each
             phase: on a machine shared with other work they move much less than
             the wall seconds, and they show where the input pipeline's threads
             add work beside the steps (the final export's and the evaluation's
             both count the CPU of the seconds they share)
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

PHASES = ("startup", "trace", "train", "eval", "export")


def process_start() -> float | None:
    """The wall-clock time (`time.time()`) this process started, or None where unknown."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # seconds after boot
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - started)


class Timing:
    """Accumulates the seconds of a run's phases.

    Args:
        began: the wall-clock start of the run (default: the process start, else now).
    """

    def __init__(self, began: float | None = None):
        self.began = began if began is not None else (process_start() or time.time())
        self.seconds = {name: 0.0 for name in PHASES}
        self.cpu = {name: 0.0 for name in PHASES}
        self._train_began: float | None = None
        # perf_counter at the end of each training pass; None until pass 0 begins here
        self._passes: list[float] | None = None
        self.traces = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        """Adds the seconds of the `with` body to phase `name`."""
        began, cpu = time.perf_counter(), time.process_time()
        if name == "train" and self._train_began is None:
            self.seconds["startup"] = max(time.time() - self.began, 0.0)
            self.cpu["startup"] = cpu  # the process's CPU seconds so far
            self._train_began = began
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - began
            self.cpu[name] += time.process_time() - cpu

    def traced(self, fn):
        """`fn` (a function traced by tf.function) with its tracing time added to `trace`."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            began, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.traces += 1
                self.seconds["trace"] += time.perf_counter() - began
                self.cpu["trace"] += time.process_time() - cpu

        return wrapper

    def pass_begins(self, index: int) -> None:
        """Marks the start of training pass `index` (0-based): the previous pass ended."""
        if index == 0:
            self._passes = []
        elif self._passes is not None and len(self._passes) == index - 1:
            self._passes.append(time.perf_counter())

    def steady_examples_per_sec(self, examples: int, passes: int) -> float | None:
        """Examples / s over passes 2..`passes` of a run of `examples` in equal passes."""
        if passes < 2 or self._passes is None or len(self._passes) < passes:
            return None
        elapsed = self._passes[passes - 1] - self._passes[0]
        return examples * (passes - 1) / passes / elapsed if elapsed > 0 else None

    def as_dict(self, examples: int = 0, passes: int = 0) -> dict:
        """The `timing` section: each phase's seconds, the steady rate when known, and
        `cpu`: each phase's CPU seconds."""
        out = {name: round(self.seconds[name], 3) for name in PHASES}
        out["cpu"] = {name: round(self.cpu[name], 3) for name in PHASES}
        steady = self.steady_examples_per_sec(examples, passes)
        if steady is not None:
            out["steady_examples_per_sec"] = round(steady, 1)
        return out
