"""Training on `tf.distribute.ParameterServerStrategy`, driven by the chief task.

Tables are split into one shard per PS task (see `ModPlacement`); dense
variables are partitioned by a min-size partitioner. The loop is the trainer's
(`Trainer.train_on`); only the runner differs: `PSRunner` hands the epoch's
input splits to the workers as `ClusterCoordinator` closures, so each row is
read once, by one worker (see `recflow.distribute.splits`). A worker that dies
has its closure rerun on another one. The chief owns checkpoints (dense + tables
+ split state), eviction, deltas, evaluation and export.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Callable

import numpy as np
import tensorflow as tf

from recflow.config.schema import Config
from recflow.data import records, split_positions
from recflow.distribute import splits as splits_lib
from recflow.distribute.chunk import train_chunk
from recflow.distribute.cluster import TaskRole, make_strategy, ps_devices
from recflow.embedding.placement import ModPlacement
from recflow.training.runner import StepReport
from recflow.training.trainer import Trainer


def ps_trainer(config: Config, role: TaskRole, verbose: int = 1, callbacks=None) -> Trainer:
    """The chief's `Trainer`: its model built in the strategy's scope, over one table
    shard per PS task, and its steps run by a `PSRunner` on the workers.

    Args:
        config: the run config.
        role: this (chief) task's role, from TF_CONFIG.
        verbose: 0 silent, 1 a progress bar.
        callbacks: more Keras callbacks (see `Trainer`).
    """
    strategy, coordinator = make_strategy(role)
    placement = ModPlacement(role.num_ps, ps_devices(role.num_ps))
    workers = len(role.cluster["worker"])

    def runner(config, model, transformed):
        return PSRunner(config, model, strategy, coordinator, workers, transformed)

    return Trainer(
        config, verbose=verbose, placement=placement, callbacks=callbacks,
        strategy=strategy, make_runner=runner,
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
        self.config, self.model, self.coordinator = config, model, coordinator
        self.transformed = transformed
        self.splits_lib = splits_lib
        self.workers = workers
        self.splits = splits_lib.make_splits(config, self.workers)
        self.files = [s.file for s in self.splits if s.file] or None
        self.state = splits_lib.SplitState(self.splits, config.data)
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
            return {split_positions.CHECKPOINT_KEY: self.state}
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
            return records.without_rewrites(self.transformed(ds))

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


