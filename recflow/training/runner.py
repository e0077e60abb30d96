"""Step runners: how the training loop runs steps, in this process or on PS workers.

`Trainer.fit` is one loop over a runner and the callbacks (see
`recflow.training.callbacks`). A runner owns the input of an epoch and how
its steps run:

- `LocalRunner`: one `tf.data` iterator per epoch, saved in the checkpoint (the
  input position), one step at a time in this process.
- `PSRunner`: the epoch's input splits (`recflow.distribute.splits`), handed out
  to the workers as `ClusterCoordinator` closures of whole chunks of batches; the
  split state is saved in the checkpoint.

Both call `callbacks.on_train_batch_end(global_step, logs)` after each step or
wave of chunks, so one schedule (eviction, delta, export, checkpoint) serves both.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from recflow.data import pipeline
from recflow.data.pipeline import NONFINITE, TRUNCATED
from recflow.errors import DataError
from recflow.quiet import native_stderr_silenced
from recflow.training.chunk import train_chunk
from recflow.training.progress import Progress, pass_position

logger = logging.getLogger(__name__)


class LocalRunner:
    """Runs steps in this process, from a checkpointed `tf.data` iterator.

    Args:
        trainer: the trainer (config, model, callbacks, counters).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.iterator = None
        self.files = trainer.train_files()
        # Steps of a pass, for the progress bar only: not counted when there is none.
        self.per_epoch = trainer.steps_per_epoch(self.files) if trainer.verbose else None
        self._step_fn = None
        self._first_step = True

    def open(self, epoch: tf.Variable) -> None:
        """Builds the iterator of `epoch` and restores the latest checkpoint (with its position)."""
        self.iterator = iter(self.trainer.epoch_dataset(int(epoch)))
        self.trainer.open_checkpoint(self.iterator, epoch=epoch)

    def next_epoch(self, epoch: tf.Variable, last: bool = False) -> None:
        """A fresh iterator for the (already advanced) `epoch`, in every later checkpoint.

        After the `last` pass no iterator is built (its pipeline would start reading
        while the run evaluates and exports): a checkpoint without an input position
        starts its epoch at the beginning, as `open` builds it.
        """
        self.iterator = None if last else iter(self.trainer.epoch_dataset(int(epoch)))
        self.trainer.open_checkpoint(self.iterator, restore=False, epoch=epoch)

    def run_epoch(self, epoch: int, target: int | None) -> int:
        """Trains the rest of the epoch (or to `target` steps); returns the examples trained."""
        done = pass_position(int(self.trainer.model.global_step), epoch, self.per_epoch)
        return self.run_steps(
            self.iterator, target=target, files=self.files, per_epoch=self.per_epoch, done=done
        )

    def epoch_steps(self, steps: int) -> None:
        """Records the steps of a whole pass (for the next passes' progress bar)."""
        if self.per_epoch is None:
            self.per_epoch = steps

    def run_steps(self, iterator, target=None, files=None, per_epoch=None, done=0) -> int:
        """See `Trainer.run_steps`; `done`: the steps of the pass done before (a resume)."""
        trainer = self.trainer
        config, model = trainer.config, trainer.model
        if self._step_fn is None:
            # The engine and tower are plain tensor code: tracing without AutoGraph is
            # several times faster (the tower itself is still converted, see RankingModel).
            self._step_fn = tf.function(
                model.train_step, input_signature=[iterator.element_spec], autograph=False
            )
        step = start = int(model.global_step)
        progbar = Progress(target or per_epoch, start if target else done, trainer.verbose)
        examples = bad = 0
        sample = 10 * config.data.batch_size  # rows read before the bad fraction is judged
        while (target is None or step < target) and not trainer.stop_requested:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            features, labels, batch_bad = batch
            size = int(tf.shape(labels[config.labels[0]])[0])
            bad += int(batch_bad)
            trainer.nonfinite_values += int(features[NONFINITE])
            trainer.truncated_rows += int(features[TRUNCATED])
            if examples + bad >= sample:
                trainer.check_bad_rows(examples, bad, files)
            if size == 0:  # every row of the batch was bad: no step
                model.bad_records.assign_add(int(batch_bad))
                continue
            if self._first_step and config.train.xla:
                with native_stderr_silenced():  # absl's XLA start-up lines
                    loss = float(self._step_fn(batch)["loss"])
            else:
                loss = float(self._step_fn(batch)["loss"])
            self._first_step = False
            step += 1
            examples += size
            if not np.isfinite(loss):
                raise DataError(f"step {step}: the loss is {loss}; {_out_of_range(config, batch)}")
            progbar.update(step if target else done + step - start, [("loss", loss)])
            trainer.examples_trained += size
            trainer.examples_applied += size
            trainer.callbacks.on_train_batch_end(
                step,
                {"loss": loss, "previous_step": step - 1, "examples": trainer.examples_trained},
            )
        trainer.rows_read += examples + bad
        trainer.bad_rows += bad
        trainer.check_bad_rows(examples, bad, files)
        return examples


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
        trainer: a `PSTrainer` (strategy, coordinator, role).
    """

    def __init__(self, trainer):
        from recflow.distribute import splits as splits_lib

        self.trainer = trainer
        self.splits_lib = splits_lib
        self.workers = len(trainer.role.cluster["worker"])
        self.splits = splits_lib.make_splits(trainer.config, self.workers)
        self.state = splits_lib.SplitState(len(self.splits))
        self.synthetic = None
        if trainer.config.data.format == "synthetic":
            self.synthetic = splits_lib.SyntheticChunks(trainer.config)
        with trainer.strategy.scope():
            # Rows whose updates reached the parameter servers, retried chunks included.
            self.applied = tf.Variable(0, dtype=tf.int64, trainable=False, name="examples_applied")
        model = trainer.model
        # Traced once and called by every chunk function (one per file and epoch): a new
        # file costs a trace of its input pipeline, not of the train step.
        self._step = tf.function(
            lambda batch, ahead: model.train_on_rows(batch, ahead, in_loop=True),
            autograph=False,
        )
        if trainer.config.train.prefetch_embeddings:
            # A slot per chunk of a wave: at most one per split, or per worker for files.
            slots = len(self.splits) if self.synthetic is not None else self.workers
            with trainer.strategy.scope():
                model.embedding.make_staging(slots)
        self._functions: dict = {}

    def open(self, epoch: tf.Variable) -> None:
        """Restores the latest checkpoint, split state included."""
        self.trainer.open_checkpoint(epoch=epoch, splits=self.state)

    def next_epoch(self, epoch: tf.Variable, last: bool = False) -> None:
        self.state.reset()

    def epoch_steps(self, steps: int) -> None:
        pass  # the progress bar has no total under PS

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
        trainer, splits_lib = self.trainer, self.splits_lib
        config, model, train_step, applied = trainer.config, trainer.model, self._step, self.applied
        prefetch = config.train.prefetch_embeddings

        def dataset(start, stop, seed, first, count):
            if split.seekable:
                ds = self.synthetic.dataset(start, stop, seed, first, count)
            else:
                ds = splits_lib.file_chunk_dataset(config, split.file, epoch, first, count)
            return pipeline.without_rewrites(trainer._transformed(ds))

        def chunk(start, stop, seed, first, count, slot):
            iterator = iter(dataset(start, stop, seed, first, count))
            return tuple(train_chunk(model, iterator, prefetch, applied, train_step, slot))

        return tf.function(chunk, autograph=False)

    def _schedule(self, split, epoch: int, first: int, count: int, slot: int):
        """Schedules a chunk; `slot`: its staging slot, distinct within the wave."""
        seed = self.trainer.config.data.seed + epoch * 1_000_003 + split.index
        values = (split.start, split.stop, seed, first, count, slot)
        args = [tf.constant(v, tf.int64) for v in values]
        return self.trainer.coordinator.schedule(self._chunk_fn(split, epoch), args=tuple(args))

    # ------------------------------------------------------------------ epoch

    def _boundary(self, step: int, target: int | None) -> int | None:
        """The next step a checkpoint, delta or export is scheduled at (or the target), or None.

        The loss log is not a boundary: it is written at the first wave end at or after
        its step, so chunks stay long (each costs its pipeline's start on the worker).
        """
        config = self.trainer.config
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
        return -(-(split.stop - split.start) // self.trainer.config.data.batch_size)

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

    def run_epoch(self, epoch: int, target: int | None) -> int:
        """Trains the unfinished splits of `epoch` (or to `target` steps); returns the
        examples trained (each row once, whatever was retried)."""
        trainer, splits_lib = self.trainer, self.splits_lib
        model = trainer.model
        positions = self.state.read()
        order = [
            i
            for i in splits_lib.epoch_order(trainer.config, self.splits, epoch)
            if positions[i] != splits_lib.FINISHED
        ]
        step = int(model.global_step)
        progbar = Progress(target, step, trainer.verbose)
        examples = bad_rows = 0
        while order and (target is None or step < target) and not trainer.stop_requested:
            boundary = self._boundary(step, target)
            plan = self._plan(order, positions, step, boundary, target)
            scheduled = [
                (split, count, self._schedule(split, epoch, positions[split.index], count, slot))
                for slot, (split, count) in enumerate(plan)
            ]
            trainer.coordinator.join()
            loss = None
            for split, count, remote in scheduled:
                read, steps, rows, bad, nonfinite, truncated, chunk_loss, finite = remote.fetch()
                if not finite:
                    raise DataError(
                        f"{split}: the loss is {float(chunk_loss)}; check the numeric inputs "
                        "(normalizers) or lower the learning rates"
                    )
                positions[split.index] += int(read)
                if read < count or positions[split.index] == self._batches(split):  # ran out
                    positions[split.index] = splits_lib.FINISHED
                    order.remove(split.index)
                examples, bad_rows = examples + int(rows), bad_rows + int(bad)
                trainer.rows_read += int(rows) + int(bad)
                trainer.bad_rows += int(bad)
                trainer.nonfinite_values += int(nonfinite)
                trainer.truncated_rows += int(truncated)
                trainer.examples_trained += int(rows)
                if steps:
                    loss = float(chunk_loss)
            self.state.write(positions)
            trainer.check_bad_rows(
                examples, bad_rows, [s.file for s in self.splits if s.file] or None
            )
            previous, step = step, int(model.global_step)
            trainer.examples_applied = int(self.applied)
            if step > previous:
                progbar.update(step, [("loss", loss if loss is not None else float("nan"))])
                trainer.callbacks.on_train_batch_end(
                    step,
                    {"loss": loss, "previous_step": previous, "examples": trainer.examples_trained},
                )
        return examples


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
