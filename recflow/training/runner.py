"""Step runners: how steps run, in this process or on PS workers, reported to the loop.

A runner owns the input of an epoch and how its steps run, and yields a
`StepReport` after each step (or wave of steps); `Trainer.train_on` is the one
loop that consumes them: counters, the bad-row check, stopping at a non-finite
loss, the progress bar and the callbacks live there only. A runner never calls
back into the trainer.

- `LocalRunner`: one `tf.data` iterator per epoch, saved in the checkpoint (the
  input position), one step at a time in this process; streams (`--follow`,
  Kafka) feed it their own iterators.
- `PSRunner`: the epoch's input splits (`recflow.distribute.splits`), handed out
  to the workers as `ClusterCoordinator` closures of whole chunks of batches; the
  split state is saved in the checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tensorflow as tf

from recflow.data import pipeline
from recflow.data.pipeline import NONFINITE, TRUNCATED
from recflow.quiet import native_stderr_silenced
from recflow.training.chunk import train_chunk

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepReport:
    """What a runner did since its previous report: one local step (or a batch whose
    every row was bad, `step == previous_step`), or one wave of PS chunks.

    Attributes:
        step: the global step after.
        previous_step: the global step before.
        rows: rows trained.
        bad: bad rows skipped.
        nonfinite: numeric values read as missing (inf, overflow, "nan").
        truncated: multi_hot rows cut to `max_values`.
        applied: rows whose updates reached the tables (PS: retried chunks again).
        loss: the last step's loss; None when no step ran.
        where: who computed a non-finite loss (`step 12`, a split), for the message.
        hint: what to check when the loss is not finite.
    """

    step: int
    previous_step: int
    rows: int = 0
    bad: int = 0
    nonfinite: int = 0
    truncated: int = 0
    applied: int = 0
    loss: float | None = None
    where: str = ""
    hint: str = ""


class LocalRunner:
    """Runs steps in this process, from a checkpointed `tf.data` iterator.

    Args:
        config: the run config.
        model: the model trained (its `train_step` is traced once, on the first step).
        make_input: `epoch -> tf.data.Dataset` of transformed training batches.
        files: the files the input reads (named when too many rows are bad).
    """

    def __init__(self, config, model, make_input: Callable, files: list[str] | None = None):
        self.config, self.model, self.make_input, self.files = config, model, make_input, files
        self.iterator = None
        self._step_fn = None
        self._first_step = True

    def start_epoch(self, epoch: int, last: bool = False) -> dict:
        """Builds the input of `epoch`; returns what the checkpoint saves of it (the iterator).

        After the `last` pass no iterator is built (its pipeline would start reading
        while the run evaluates and exports): a checkpoint without an input position
        starts its epoch at the beginning.
        """
        self.iterator = None if last else iter(self.make_input(epoch))
        return {"iterator": self.iterator}

    def epoch_reports(self, epoch: int, target: int | None) -> Iterator[StepReport]:
        """The steps of the rest of the epoch (or to `target` steps)."""
        return self.reports(self.iterator, target)

    def reports(self, iterator, target: int | None = None) -> Iterator[StepReport]:
        """One step per batch of `iterator` until it ends or the global step reaches `target`."""
        config, model = self.config, self.model
        if self._step_fn is None:
            # The engine and tower are plain tensor code: tracing without AutoGraph is
            # several times faster (the tower itself is still converted, see RankingModel).
            self._step_fn = tf.function(
                model.train_step, input_signature=[iterator.element_spec], autograph=False
            )
        step = int(model.global_step)
        while target is None or step < target:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            features, labels, batch_bad = batch
            size = int(tf.shape(labels[config.labels[0]])[0])
            counts = {
                "bad": int(batch_bad),
                "nonfinite": int(features[NONFINITE]),
                "truncated": int(features[TRUNCATED]),
            }
            if size == 0:  # every row of the batch was bad: no step
                model.bad_records.assign_add(counts["bad"])
                yield StepReport(step, step, **counts)
                continue
            if self._first_step and config.train.xla:
                with native_stderr_silenced():  # absl's XLA start-up lines
                    loss = float(self._step_fn(batch)["loss"])
            else:
                loss = float(self._step_fn(batch)["loss"])
            self._first_step = False
            step += 1
            hint = "" if np.isfinite(loss) else _out_of_range(config, batch)
            yield StepReport(
                step, step - 1, rows=size, applied=size, loss=loss, where=f"step {step}", hint=hint,
                **counts,
            )


def _fill(total: int, capacities: list[int]) -> list[int]:
    """`total` shared out as evenly as `capacities` allow (all of them if they hold less)."""
    takes = [0] * len(capacities)
    left = total
    while left > 0:
        open_ = [i for i, c in enumerate(capacities) if takes[i] < c]
        if not open_:
            break
        for i, share in zip(open_, _shares(left, len(open_))):
            add = min(share, capacities[i] - takes[i])
            takes[i] += add
            left -= add
    return takes


def _shares(total: int, parts: int) -> list[int]:
    """`total` cut into `parts` near-equal whole shares, larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class PSRunner:
    """Runs an epoch's input splits as chunks on the parameter-server workers.

    A wave schedules chunks, then joins: checkpoints (and every other callback)
    run between waves, when no closure is in flight. Synthetic chunks fill the
    steps up to the next hook boundary (`train.checkpoint_every_steps`,
    `export.every_steps`, `export.delta_every_steps`, the `train.steps` target)
    exactly, so those hooks run at their exact steps (the loss log at the first
    wave end at or after its step); a
    wave of files gives one file to each worker, each chunk to the end of its
    file (reading a file from the middle re-reads its start) or its share of
    the target, and hooks run at the first wave end at or after their step.

    Args:
        config: the run config.
        model: the model, built in `strategy`'s scope.
        strategy: the `ParameterServerStrategy`.
        coordinator: its `ClusterCoordinator`.
        workers: the number of worker tasks.
        transformed: `dataset -> dataset` applying the feature transforms (on a worker).
    """

    def __init__(self, config, model, strategy, coordinator, workers: int, transformed: Callable):
        from recflow.distribute import splits as splits_lib

        self.config, self.model, self.coordinator = config, model, coordinator
        self.transformed = transformed
        self.splits_lib = splits_lib
        self.workers = workers
        self.splits = splits_lib.make_splits(config, self.workers)
        self.files = [s.file for s in self.splits if s.file] or None
        self.state = splits_lib.SplitState(len(self.splits))
        self.synthetic = None
        if config.data.format == "synthetic":
            self.synthetic = splits_lib.SyntheticChunks(config)
        with strategy.scope():
            # Rows whose updates reached the parameter servers, retried chunks included.
            self.applied = tf.Variable(0, dtype=tf.int64, trainable=False, name="examples_applied")
        self._reported = 0  # `applied` at the previous report
        # Traced once and called by every chunk function (one per file and epoch): a new
        # file costs a trace of its input pipeline, not of the train step.
        self._step = tf.function(
            lambda batch, ahead: model.train_on_rows(batch, ahead, in_loop=True),
            autograph=False,
        )
        if config.train.prefetch_embeddings:
            # A slot per chunk of a wave: at most one per split, or per worker for files.
            slots = len(self.splits) if self.synthetic is not None else self.workers
            with strategy.scope():
                model.embedding.make_staging(slots)
        self._functions: dict = {}
        self._opened = False

    def start_epoch(self, epoch: int, last: bool = False) -> dict | None:
        """The split state, for the checkpoint, at the first epoch; later epochs start
        every split again (the checkpoint already holds the state)."""
        if not self._opened:
            self._opened = True
            return {"splits": self.state}
        self.state.reset()
        return None

    # ------------------------------------------------------------------ closures

    def _chunk_fn(self, split, epoch: int):
        """The traced function that trains a chunk of `split` (shared by synthetic splits)."""
        key = None if split.seekable else (split.index, epoch)
        if key not in self._functions:
            self._functions = {
                k: v for k, v in self._functions.items() if k is None or k[1] == epoch
            }
            self._functions[key] = self._make_chunk_fn(split, epoch)
        return self._functions[key]

    def _make_chunk_fn(self, split, epoch: int):
        splits_lib = self.splits_lib
        config, model, train_step, applied = self.config, self.model, self._step, self.applied
        prefetch = config.train.prefetch_embeddings

        def dataset(start, stop, seed, first, count):
            if split.seekable:
                ds = self.synthetic.dataset(start, stop, seed, first, count)
            else:
                ds = splits_lib.file_chunk_dataset(config, split.file, epoch, first, count)
            return pipeline.without_rewrites(self.transformed(ds))

        def chunk(start, stop, seed, first, count, slot):
            iterator = iter(dataset(start, stop, seed, first, count))
            return tuple(train_chunk(model, iterator, prefetch, applied, train_step, slot))

        return tf.function(chunk, autograph=False)

    def _schedule(self, split, epoch: int, first: int, count: int, slot: int):
        """Schedules a chunk; `slot`: its staging slot, distinct within the wave."""
        seed = self.config.data.seed + epoch * 1_000_003 + split.index
        values = (split.start, split.stop, seed, first, count, slot)
        args = [tf.constant(v, tf.int64) for v in values]
        return self.coordinator.schedule(self._chunk_fn(split, epoch), args=tuple(args))

    # ------------------------------------------------------------------ epoch

    def _boundary(self, step: int, target: int | None) -> int | None:
        """The next step a checkpoint, delta or export is scheduled at (or the target), or None.

        The loss log is not a boundary: it is written at the first wave end at or after
        its step, so chunks stay long (each costs its pipeline's start on the worker).
        """
        config = self.config
        every = [
            config.train.checkpoint_every_steps,
            config.export.every_steps,
            config.export.delta_every_steps,
        ]
        points = [(step // n + 1) * n for n in every if n]
        if target is not None:
            points.append(target)
        return min(points) if points else None

    def _batches(self, split) -> int | None:
        """The batches of a split when known without reading it (synthetic row ranges)."""
        if not split.seekable:
            return None
        return -(-(split.stop - split.start) // self.config.data.batch_size)

    def _plan(self, order, positions, step, boundary, target) -> list:
        """The chunks `(split, batches)` of the next wave.

        Synthetic splits (lengths known): chunks that fill the steps up to the next
        boundary exactly, shared out evenly over the first unfinished splits in order, at
        least one per worker when there are enough (so every worker trains in every
        wave); with no boundary, every split to its end. The coordinator queues chunks
        for free workers. Files: one chunk per worker, each to the end of its file, the
        `train.steps` target shared out.
        """
        splits_lib = self.splits_lib
        if self.splits[order[0]].seekable:
            splits = [self.splits[i] for i in order]
            remaining = [self._batches(s) - positions[s.index] for s in splits]
            if boundary is None:
                return [(s, n) for s, n in zip(splits, remaining) if n > 0]
            left = boundary - step
            used = min(self.workers, len(splits))
            while used < len(splits) and sum(remaining[:used]) < left:
                used += 1
            takes = _fill(left, remaining[:used])
            return [(s, n) for s, n in zip(splits, takes) if n > 0]
        wave = [self.splits[i] for i in order[: self.workers]]
        counts = (
            [splits_lib.UNLIMITED] * len(wave)
            if target is None
            else _shares(target - step, len(wave))
        )
        return [(split, count) for split, count in zip(wave, counts) if count > 0]

    def epoch_reports(self, epoch: int, target: int | None) -> Iterator[StepReport]:
        """Trains the unfinished splits of `epoch` (or to `target` steps), one report per
        wave (each row counted once, whatever was retried); the split state is written
        before each report, so a checkpoint taken then holds it."""
        splits_lib, model = self.splits_lib, self.model
        positions = self.state.read()
        order = [
            i
            for i in splits_lib.epoch_order(self.config, self.splits, epoch)
            if positions[i] != splits_lib.FINISHED
        ]
        step = int(model.global_step)
        while order and (target is None or step < target):
            boundary = self._boundary(step, target)
            plan = self._plan(order, positions, step, boundary, target)
            scheduled = [
                (split, count, self._schedule(split, epoch, positions[split.index], count, slot))
                for slot, (split, count) in enumerate(plan)
            ]
            self.coordinator.join()
            totals = dict.fromkeys(("rows", "bad", "nonfinite", "truncated"), 0)
            loss, where = None, ""
            for split, count, remote in scheduled:
                read, steps, rows, bad, nonfinite, truncated, chunk_loss, finite = remote.fetch()
                positions[split.index] += int(read)
                if read < count or positions[split.index] == self._batches(split):  # ran out
                    positions[split.index] = splits_lib.FINISHED
                    order.remove(split.index)
                for key, value in zip(totals, (rows, bad, nonfinite, truncated)):
                    totals[key] += int(value)
                if not finite:
                    loss, where = float(chunk_loss), str(split)
                elif steps and (loss is None or np.isfinite(loss)):
                    loss = float(chunk_loss)
            self.state.write(positions)
            previous, step = step, int(model.global_step)
            applied, self._reported = int(self.applied) - self._reported, int(self.applied)
            yield StepReport(
                step, previous, applied=applied, loss=loss, where=where,
                hint="check the numeric inputs (normalizers) or lower the learning rates",
                **totals,
            )


def _out_of_range(config, batch) -> str:
    """Names the first input of a batch that is not finite or above 1e4 in magnitude."""
    features, labels, _ = batch
    inputs = [(f"feature '{f.name}'", features[f.name]) for f in config.numeric_features]
    inputs += [(f"label '{label}'", labels[label]) for label in config.labels]
    for who, value in inputs:
        value = np.asarray(value, np.float64).reshape(-1)
        finite = np.isfinite(value)
        if not finite.all():
            return f"first input out of range: {who} = {value[~finite][0]:g}"
        if value.size and np.max(np.abs(value)) > 1e4:
            return (
                f"first input out of range: {who} reaches {np.max(np.abs(value)):g} "
                "(after its normalizer); add or fix its normalizer"
            )
    return "no input is out of range; lower the learning rates"
