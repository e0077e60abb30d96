"""Step runners: how steps run, in this process or on PS workers, reported to the loop.

A runner owns the input of an epoch and how its steps run, and yields a
`StepReport` after each step (or wave of steps); `Trainer.train_on` is the one
loop that consumes them: counters, the bad-row check, stopping at a non-finite
loss, the progress bar and the callbacks live there only. A runner never calls
back into the trainer.

- `LocalRunner`: one `tf.data` iterator per epoch, saved in the checkpoint (the
  input position), one step at a time in this process; its epochs read the
  parsed rows of an input cache when the run has one (`recflow.data.cache`);
  streams (`--follow`, Kafka) feed it their own iterators.
- `recflow.distribute.ps_runner.PSRunner`: the epoch's input splits, handed out
  to the workers as `ClusterCoordinator` closures of whole chunks of batches; the
  split state is saved in the checkpoint.

A runner has `files` (what its input reads), `start_epoch(epoch, last)` (builds
the epoch's input; returns what the checkpoint saves of it, as `ModelDir.
open_checkpoint`'s keyword arguments, or None when the checkpoint already holds it)
and `epoch_reports(epoch, target)`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tensorflow as tf

from recflow.data.cache import FROM_FILES, ORDER, VARIABLE, InputCache
from recflow.data.records import NONFINITE, TRUNCATED
from recflow.errors import DataError, listed
from recflow.quiet import native_stderr_silenced

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

    With an input cache, the epochs from `cache.first_epoch` on read its rows. The
    checkpoint records beside the position where it was read (`cache.VARIABLE`: the
    files, or the cache's record layout, and `data.shuffle`; "" when it holds no
    position), and a resumed epoch goes on reading the way it began, whatever
    `data.cache` says now: a position only means something in its own pipeline.

    Args:
        config: the run config.
        model: the model trained (its `train_step` is traced once, on the first step).
        make_input: `(epoch, cache=None, by_record=False) -> tf.data.Dataset` of
            transformed training batches (from the cache when one is given).
        files: the files the input reads (named when too many rows are bad).
        cache: the run's input cache, or None.
        resumed: the restored checkpoint's `cache.VARIABLE` value (None: no checkpoint).
        on_traced: called with the batches' `element_spec` once the step is traced, before
            its first call: that call builds the step's kernels in TensorFlow's C++ runtime
            for about 0.4 s with the GIL released, time for Python work to overlap (the
            evaluation's predict trace, `Evaluator.prepare`).
    """

    def __init__(
        self,
        config,
        model,
        make_input: Callable,
        files: list[str] | None = None,
        cache: InputCache | None = None,
        resumed: str | None = None,
        on_traced: Callable | None = None,
    ):
        self.config, self.model, self.make_input, self.files = config, model, make_input, files
        self.cache, self._resumed = cache, resumed
        self._on_traced = on_traced
        self.iterator = None
        self._step_fn = None
        self._first_step = True
        self._source = tf.Variable("", trainable=False, name=VARIABLE)
        self._next: tuple | None = None  # (epoch, cached, Future of its iterator): `_make_next`

    def start_epoch(self, epoch: int, last: bool = False) -> dict:
        """Builds the input of `epoch`; returns what the checkpoint saves of it (the iterator
        and where it reads) and whether a restore reads its position back.

        After the `last` pass no iterator is built (its pipeline would start reading
        while the run evaluates and exports), and the cache is released: a checkpoint
        without an input position starts its epoch at the beginning.
        """
        if last:
            self.iterator, self._next = None, None
            self.close()
            self._source.assign("")
            return {"iterator": None, VARIABLE: self._source}
        resumed = self._resumed_record(epoch)
        cached = self._reads_cache(epoch, resumed)
        # A position read from the cache before its keys were made in blocks resumes in
        # the pipeline it was read in.
        by_record = cached and resumed is not None and resumed.get("order") != ORDER
        self.iterator = self._iterator(epoch, cached, by_record)
        if cached:
            record = self.cache.position_record(by_record)
        else:
            record = {} if self.files is None else {"files": self._real_files()}
        self._source.assign(json.dumps({**record, "shuffle": self.config.data.shuffle}))
        self._make_next(epoch + 1)
        return {
            "iterator": self.iterator,
            VARIABLE: self._source,
            "restore_position": resumed is not None,
        }

    def _input(self, epoch: int, cached: bool, by_record: bool = False) -> tf.data.Dataset:
        if not cached:
            return self.make_input(epoch)
        return self.make_input(epoch, cache=self.cache, by_record=by_record)

    def _iterator(self, epoch: int, cached: bool, by_record: bool = False):
        """The iterator of `epoch`'s input (read from the cache when `cached`).

        Its making (the pipeline's trace, then tf.data's graph rewrites and its functions'
        instantiation in TensorFlow's C++ runtime, without the GIL) overlaps other work:
        the runner's first is made in a thread while the step is traced here (the bench's
        1-epoch job: 0.27 s of 0.36 s); a later one was made while the epoch before
        trained (`_make_next`).
        """
        ahead, self._next = self._next, None
        if ahead is not None and ahead[:2] == (epoch, cached) and not by_record:
            return ahead[2].result()
        dataset = self._input(epoch, cached, by_record)
        if self._step_fn is not None:
            return iter(dataset)
        with ThreadPoolExecutor(1, thread_name_prefix="recflow-iterator") as pool:
            made = pool.submit(iter, dataset)
            self._trace_step(dataset.element_spec)
            return made.result()

    def _make_next(self, epoch: int) -> None:
        """Starts making the iterator of `epoch` in a thread, when the run's epoch count
        says that this process trains it: the epoch boundary then costs nothing (on the
        bench's 3-epoch job, 0.2-0.3 s a boundary of tracing the cache's batch function
        and making the iterator). A later epoch reads as planned (no restored position).
        """
        train = self.config.train
        total = train.total_epochs
        if train.steps is not None or total is None or epoch >= total:
            return
        cached = self._reads_cache(epoch, None)
        pool = ThreadPoolExecutor(1, thread_name_prefix="recflow-next-epoch")
        self._next = (epoch, cached, pool.submit(lambda: iter(self._input(epoch, cached))))
        pool.shutdown(wait=False)  # its thread ends with the task

    def _trace_step(self, spec) -> None:
        """Traces the step for batches of `spec`; then `on_traced`, before the step's first call."""
        # The engine and tower are plain tensor code: tracing without AutoGraph is
        # several times faster (the tower itself is still converted, see RankingModel).
        # The concrete function is called: a polymorphic call binds the batch's 40-odd
        # tensors against the signature again each step (0.96 -> 0.48 ms a call).
        step = tf.function(self.model.train_step, input_signature=[spec], autograph=False)
        self._step_fn = step.get_concrete_function()
        if self._on_traced is not None:
            self._on_traced(spec)

    def _resumed_record(self, epoch: int) -> dict | None:
        """The restored checkpoint's record of its input position (`cache.VARIABLE`), read
        once: None when there is none to go on from.

        The record names how the position was read: the files (`files`, the realpaths),
        the synthetic rows (neither), or the input cache (`key`, `records`, `first`), and
        `shuffle`. A position holds the order its epoch began with: with `data.shuffle`
        changed since, the epoch starts over (the rows it had read are trained again).
        """
        resumed, self._resumed = self._resumed, None
        if not resumed:
            return None
        if resumed == FROM_FILES:  # written before the record named more
            return {}
        record = json.loads(resumed)
        shuffle = self.config.data.shuffle
        if record.get("shuffle", shuffle) != shuffle:
            logger.warning(
                "data.shuffle: changed since the checkpoint was written in epoch %d (it was %s); "
                "that epoch's input position holds the order it began with, so the epoch starts "
                "over from its first row and the rows it had read are trained again",
                epoch + 1, str(record["shuffle"]).lower(),
            )
            return None
        return record

    def _reads_cache(self, epoch: int, resumed: dict | None) -> bool:
        """Whether `epoch` reads the cache: as its restored position did, else by plan."""
        if resumed is None:  # no position to go on from
            first = None if self.cache is None else self.cache.first_epoch
            return first is not None and epoch >= first
        if "key" not in resumed:  # read from the files, or synthetic rows
            if "files" in resumed:
                self._check_files(resumed["files"], epoch)
            return False
        if self.cache is None:
            raise DataError(
                "the checkpoint's input position was read from an input cache of CSV or "
                "TFRecord files, and this config reads none; train a new model dir"
            )
        changed = (
            f"data.train: the files changed since the checkpoint was written in epoch {epoch + 1} "
            "({}), so its position cannot resume; put the files back, or train a new model dir"
        )
        if not self.cache.holds_contents_of(resumed):  # before anything is parsed
            raise DataError(changed.format("other contents"))
        self.cache.load()
        if not self.cache.fits(resumed):
            raise DataError(changed.format("other numbers of records"))
        return True

    def close(self) -> None:
        """Releases the input cache (its memory and files): after an epoch-count run's last
        pass, or at the end of a run that its step count ended."""
        if self.cache is not None:
            self.cache.close()

    def epoch_reports(self, epoch: int, target: int | None) -> Iterator[StepReport]:
        """The steps of the rest of the epoch (or to `target` steps)."""
        return self.reports(self.iterator, target)

    def reports(self, iterator, target: int | None = None) -> Iterator[StepReport]:
        """One step per batch of `iterator` until it ends or the global step reaches `target`."""
        config, model = self.config, self.model
        if self._step_fn is None:  # a stream's iterator (`follow`, Kafka), not `start_epoch`'s
            self._trace_step(iterator.element_spec)
        step = int(model.global_step)
        while target is None or step < target:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            features, labels, batch_bad = batch
            size = labels[config.labels[0]].shape[0]  # eager: known, no op to run
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

    def _real_files(self) -> list[str]:
        """The training files by their real paths: what the record names and compares."""
        return [os.path.realpath(f) for f in self.files or []]

    def _check_files(self, began: list[str], epoch: int) -> None:
        """A position restored from the files reads on over the files its epoch began
        with (`began`); files new in `data.train` since join at the next epoch.

        (A file gone from `data.train` that the epoch still reads stops the run when it
        is read, naming it; one it has read is not missed.)

        Raises:
            DataError: `data.train` has new files and this epoch is the run's last
                (they would never be trained).
        """
        now = self._real_files()
        began_set, now_set = set(began), set(now)
        new = [f for f in now if f not in began_set]
        if not new:
            return
        gone = [f for f in began if f not in now_set]
        changed = f"new: {listed(new)}" + (f"; gone: {listed(gone)}" if gone else "")
        when = f"the training files changed since the checkpoint was written in epoch {epoch + 1}"
        train = self.config.train
        total = train.total_epochs
        if train.steps is None and total is not None and epoch + 1 >= total:
            raise DataError(
                f"data.train: {when}, the run's last ({changed}); that epoch reads on over the "
                "files it began with, so the new ones would not be trained: give the run another "
                f"epoch (train.epochs: {total + 1}), or finish it with the files it began with"
            )
        logger.warning(
            "data.train: %s (%s); that epoch reads on over the files it began with, and the new "
            "ones join at the next", when, changed,
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
