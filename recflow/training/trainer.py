"""The training loop: input, steps, callbacks, evaluation; the model dir's state is a `ModelDir`'s."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import tensorflow as tf
import tf_keras as keras

from recflow import data as data_lib
from recflow.config.schema import Config
from recflow.data import cache as input_cache
from recflow.data import fit, split_positions
from recflow.data.records import NONFINITE, TRUNCATED, reused
from recflow.embedding.placement import Placement
from recflow.errors import DataError, listed
from recflow.features.transform import transform
from recflow.models import build_model
from recflow.models.base import RankingModel
from recflow.training import warm_start as warm_start_lib
from recflow.training.callbacks import CallbackList, default_callbacks, write_evaluation
from recflow.training.dense_optimizer import make_dense_optimizer
from recflow.training.evaluator import Evaluator
from recflow.training.model_dir import ModelDir
from recflow.training.progress import Progress, pass_position
from recflow.training.runner import LocalRunner, StepReport
from recflow.training.timing import Timing

logger = logging.getLogger(__name__)


class Trainer:
    """Trains, evaluates and exports one model dir.

    `fit` is one loop over a step runner (`make_runner`: in this process, or on
    parameter-server workers) and Keras callbacks: the built-in schedule
    (eviction, delta, export, checkpoint, TensorBoard; see
    `recflow.training.callbacks`) and then `callbacks`. What the run keeps on
    disk (checkpoints, deltas, exports, metrics) is `self.model_dir`'s, a
    `recflow.training.model_dir.ModelDir`.

    Args:
        config: the run config.
        model_dir: overrides `config.train.model_dir`.
        verbose: 0 silent, 1 progress bar.
        placement: embedding shard placement (parameter servers); local by default.
        callbacks: more `tf_keras.callbacks.Callback`s, run after the built-in ones;
            one may end training with `self.model.stop_training = True`.
        warm_start: a model dir whose rows and weights a new model dir starts from,
            wherever they still fit (see `recflow.training.warm_start`); ignored once
            the model dir has a checkpoint (a restart resumes it).
        strategy: a `tf.distribute` strategy the model and its runner are built in
            (`recflow.distribute.ps_runner.ps_trainer` gives the parameter-server one).
        make_runner: `(config, model, transformed) -> runner` of `fit`'s steps; default
            a `LocalRunner` in this process.
    """

    def __init__(
        self,
        config: Config,
        model_dir: str | None = None,
        verbose: int = 1,
        placement: Placement | None = None,
        callbacks=None,
        warm_start: str | None = None,
        strategy=None,
        make_runner: Callable | None = None,
    ):
        path = model_dir or config.train.model_dir
        self.verbose = verbose
        self.warm_start = warm_start
        self.warm_start_report: dict | None = None
        rows = config.data.sample_rows
        config, warnings = fit.resolve(  # `auto` normalizers
            config, path,
            on_fit=lambda names: self.status(
                f"Fitting {_count(names, 'auto normalizer')} on the first {rows:,} rows of data.train"
            ),
        )
        for warning in warnings:
            logger.warning(warning)
        self.config = config
        self.timing = Timing()
        keras.utils.set_random_seed(config.train.seed)  # dense initial weights, dropout
        self.strategy = strategy
        self._make_runner = make_runner
        with self._scope():
            self.model: RankingModel = build_model(config, placement)
            self.model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
            self.model.build_weights()  # before any step is traced: the step traces once
        self.model.train_step = self.timing.traced(self.model.train_step)
        self._evaluator: Evaluator | None = None  # one per trainer: its predict traces once
        self.model_dir = ModelDir(path, self.model, config, status=self.status, timing=self.timing)
        self.interrupted: int | None = None  # the signal that stopped training, if one did
        self.model.stop_training = False
        built_in = default_callbacks(self.model_dir, config, self.model.embedding)
        self.callbacks = CallbackList(built_in + list(callbacks or []), self.model)
        self.runner = None
        self.examples_trained = 0  # rows trained by this process's run, each once
        self.examples_applied = 0  # rows whose updates were applied (PS: retried chunks again)
        self.rows_read = 0  # rows read by training passes of this process (kept + bad)
        self.bad_rows = 0
        self.nonfinite_values = 0  # numeric values read as missing: inf, overflow, "nan"
        self.truncated_rows = 0  # multi_hot rows cut to max_values

    def status(self, message: str) -> None:
        """Says what a long set-up step is doing (printed with the progress bar, verbose=1)."""
        if self.verbose:
            print(message, flush=True)

    # ------------------------------------------------------------------ input

    def dataset(
        self, split: str, epochs: int | None, shuffle: bool | None = None, files=None, rows=None
    ):
        """Batches of (transformed features, labels, bad-record count).

        `files` reads those files instead of the configured split; `rows` only a range
        of the records of one (see `recflow.data.make_file_dataset`).
        """
        config = self.config
        if files is not None:
            ds = data_lib.make_file_dataset(config, files, epochs=epochs, shuffle=shuffle, rows=rows)
        else:
            ds = data_lib.make_dataset(config, split, epochs=epochs, shuffle=shuffle)
        return self.transformed(ds)

    def transformed(self, ds):
        """`ds` (raw batches of any source: files, a stream) with the feature transforms
        applied; traced once for all of this trainer's pipelines (every epoch,
        evaluation), see `records.reused`. The input seam of the drivers (`fit`,
        `follow`, the Kafka stream) and of PS runners, passed to them as a function."""
        config = self.config

        def fn(raw, labels, bad):
            counts: dict = {}
            features = transform(config, raw, counts)
            features[NONFINITE] = raw[NONFINITE]
            features[TRUNCATED] = tf.cast(counts.get("truncated", 0), tf.int64)
            return features, labels, bad

        key = ("transform", repr(config), repr(ds.element_spec))
        ds = ds.map(reused(fn, key), num_parallel_calls=tf.data.AUTOTUNE)
        return ds.prefetch(tf.data.AUTOTUNE)

    def train_files(self) -> list[str] | None:
        """The training files (None for synthetic data)."""
        if self.config.data.format == "synthetic":
            return None
        return data_lib.sources.expand(self.config.data.train, "data.train")

    def steps_per_epoch(self, files: list[str] | None) -> int | None:
        """Steps of one pass when cheap to know (synthetic rows, CSV up to 256 MB), else None."""
        data = self.config.data
        if files is None:
            return -(-data.synthetic.rows // data.batch_size)
        size = sum(os.path.getsize(f) for f in files)
        if data.format != "csv" or size > 256 << 20:
            return None
        if size > 16 << 20:
            self.status(f"Counting the rows of {_name(files)} ({size / 2**20:.0f} MiB) for the progress bar")
        rows = 0
        for file in files:
            with open(file, "rb") as f:
                rows += sum(1 for line in f if line.strip()) - (1 if data.csv.header else 0)
        return -(-max(rows, 0) // data.batch_size)

    def epoch_dataset(
        self, epoch: int, cache: input_cache.InputCache | None = None, by_record: bool = False
    ):
        """One pass over the training data, shuffled differently each epoch; read from
        `cache` (the same batches) when given (`by_record`: see `InputCache.dataset`)."""
        data = dataclasses.replace(self.config.data, seed=self.config.data.seed + epoch)
        config = dataclasses.replace(self.config, data=data)
        if cache is not None:
            return cache.dataset(config, by_record)
        ds = data_lib.make_dataset(config, "train", epochs=1)
        return self.transformed(ds)

    # ------------------------------------------------------------------ train

    def _scope(self):
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def make_runner(self):
        """The step runner of `fit`: `make_runner`'s, else a `LocalRunner`."""
        other = _position_of_the_other_kind(self.model_dir, local=self._make_runner is None)
        if other:
            logger.warning("%s", other)
        if self._make_runner is None:
            files = self.train_files()
            cache = input_cache.for_run(self.config, files, self.model_dir.cache_dir)
            resumed = self.model_dir.saved_value(input_cache.VARIABLE)
            if resumed is None and self.model_dir.saved_value("epoch") is not None:
                resumed = input_cache.FROM_FILES.encode()  # written before the cache existed
            resumed = None if resumed is None else resumed.decode()
            # The evaluation at the end (`run`) traces its predict function while the first
            # step's kernels are built.
            prepare = self.evaluator().prepare if self.config.train.evaluate else None
            return LocalRunner(
                self.config, self.model, self.epoch_dataset, files, cache, resumed, prepare
            )
        with self._scope():
            return self._make_runner(self.config, self.model, self.transformed)

    def fit(self) -> dict:
        """Trains to `train.steps` / `train.epochs` (totals), resuming from the latest checkpoint.

        Each epoch is its own input pass (shuffled with `data.seed + epoch`); the
        checkpoint holds the epoch and the position inside it. The callbacks run
        after every step (see `recflow.training.callbacks`).

        Returns:
            A summary: steps, examples, train_seconds, examples_per_sec (or
            `already_done: True` when the model dir's run is complete).

        Raises:
            DataError: a pass read no rows, nothing was trained, too many bad rows,
                or a non-finite loss.
        """
        config, model_dir = self.config, self.model_dir
        model_dir.prepare()
        epochs = config.train.total_epochs  # None: as many as `train.steps` needs
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        saved = model_dir.saved_value("epoch")
        epoch.assign(0 if saved is None else int(saved))
        steps = config.train.steps
        if saved is not None and steps is None and int(epoch) >= epochs:
            return self.already_done(int(epoch))
        runner = self.runner = self.make_runner()
        model_dir.open_checkpoint(epoch=epoch, **runner.start_epoch(int(epoch)))
        # Steps of a pass, for the progress bar only (none under PS, or without a bar).
        local = isinstance(runner, LocalRunner)
        per_epoch = self.steps_per_epoch(runner.files) if (self.verbose and local) else None
        if self.warm_start and model_dir.saved_step < 0:  # a new model dir: nothing restored
            self.warm_start_report = warm_start_lib.warm_start(self.model, self.warm_start)
            if self.verbose:
                print(warm_start_lib.describe(self.warm_start_report))
        began, start = time.perf_counter(), int(self.model.global_step)
        if steps is not None and start >= steps:
            return self.already_done(int(epoch))
        self.callbacks.on_train_begin({"examples": self.examples_trained})
        examples, resumed = 0, start > 0
        while not self.stop_requested:
            if self.verbose and epochs:
                print(f"Epoch {int(epoch) + 1}/{epochs}")
            self.callbacks.on_epoch_begin(int(epoch))
            read_before, pass_start = self.rows_read, int(self.model.global_step)
            self.timing.pass_begins(int(epoch))
            done = pass_position(pass_start, int(epoch), per_epoch)
            examples += self.train_on(
                runner.epoch_reports(int(epoch), steps),
                target=steps, files=runner.files, per_epoch=per_epoch, done=done,
            )
            if self.rows_read == read_before and not resumed:
                raise DataError(f"data.train: a pass over {_name(self.train_files())} read no rows")
            if not resumed and local and per_epoch is None:  # now known, for the next passes' bar
                per_epoch = int(self.model.global_step) - pass_start
            resumed = False
            if steps is not None and self.model.global_step >= steps:
                self.interrupted = None  # a signal during the last step: the run is complete
                if local:
                    runner.close()
                break
            if self.stop_requested:
                break
            epoch.assign_add(1)  # the pass ended
            self.timing.pass_begins(int(epoch))
            last = epochs is not None and int(epoch) >= epochs
            # Every later checkpoint records the new epoch at its start (the final one
            # included: a run given more epochs later starts that pass at its beginning).
            items = runner.start_epoch(int(epoch), last)
            if items is not None:
                model_dir.open_checkpoint(restore=False, epoch=epoch, **items)
            model_dir.state_changed()  # the final checkpoint must record the new epoch
            self.callbacks.on_epoch_end(int(epoch) - 1, {"examples": self.examples_trained})
            if last:
                self.interrupted = None  # a signal during the last step: the run is complete
                break
        if int(self.model.global_step) == 0 and not self.stop_requested:
            raise DataError(
                f"data.train: no examples trained ({self.rows_read} rows read, "
                f"{self.bad_rows} bad); nothing is exported"
            )
        return self.finish(examples, time.perf_counter() - began, start)

    def already_done(self, epoch: int) -> dict:
        """The summary of a model dir whose run is complete: nothing trained, nothing exported."""
        step = self.model_dir.restore()
        return {"steps": step, "epoch": epoch, "examples": 0, "already_done": True}

    @property
    def stop_requested(self) -> bool:
        """Whether training ends after the current step (`model.stop_training`, as in Keras)."""
        return bool(self.model.stop_training)

    def request_stop(self, signum: int | None = None) -> None:
        """Asks the loop to stop after the current step; `signum`: the signal that asked."""
        if signum is not None and self.interrupted is None:
            logger.warning("%s: stopping after the current step", signal.Signals(signum).name)
            self.interrupted = signum
        self.model.stop_training = True

    @contextlib.contextmanager
    def signals_stop(self):
        """SIGTERM and SIGINT (Ctrl-C) stop training after the current step with a final
        checkpoint, inside the block; the previous handlers are back after it. Only in
        the main thread (Python delivers signals there only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            s: signal.signal(s, lambda signum, _: self.request_stop(signum))
            for s in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def train_on(
        self,
        reports: Iterator[StepReport],
        target: int | None = None,
        files: list[str] | None = None,
        per_epoch: int | None = None,
        done: int = 0,
    ) -> int:
        """The training loop: consumes a runner's step reports until they end or a stop
        request (checked before each report is asked for, so no step runs after it).

        Counts the rows, checks the bad-row fraction (once `10 * batch_size` rows were
        read, and at the end), stops at a non-finite loss, draws the progress bar and
        runs the callbacks after each report that advanced the global step. Returns
        the rows trained. `target`: the run's total steps (the bar's total); `files`:
        the files read (named when too many rows are bad); `per_epoch`, `done`: the
        steps of a whole pass and those of it done before, for the bar of an epoch.

        Raises:
            DataError: the bad rows of this pass exceed `data.max_bad_fraction`, or the
                loss is not finite (nothing more is saved).
        """
        start = int(self.model.global_step)
        progbar = Progress(target or per_epoch, start if target else done, self.verbose)
        sample = 10 * self.config.data.batch_size  # rows read before the bad fraction is judged
        examples = bad = 0
        reports = iter(reports)
        while not self.stop_requested:
            report = next(reports, None)
            if report is None:
                break
            if report.loss is not None and not math.isfinite(report.loss):
                raise DataError(f"{report.where}: the loss is {report.loss}; {report.hint}")
            examples, bad = examples + report.rows, bad + report.bad
            self.rows_read += report.rows + report.bad
            self.bad_rows += report.bad
            self.nonfinite_values += report.nonfinite
            self.truncated_rows += report.truncated
            self.examples_trained += report.rows
            self.examples_applied += report.applied
            if examples + bad >= sample:
                data_lib.pipeline.check_bad_fraction(self.config, examples, bad, files)
            if report.step > report.previous_step:
                loss = report.loss if report.loss is not None else float("nan")
                progbar.update(report.step if target else done + report.step - start, [("loss", loss)])
                logs = {"loss": report.loss, "previous_step": report.previous_step,
                        "examples": self.examples_trained}  # fmt: skip
                self.callbacks.on_train_batch_end(report.step, logs)
        data_lib.pipeline.check_bad_fraction(self.config, examples, bad, files)
        return examples

    def finish(self, examples: int, elapsed: float, start_step: int) -> dict:
        """Ends training: the callbacks' `on_train_end` (the final checkpoint, with
        eviction unless a signal interrupted training, unless one was just written);
        returns a summary."""
        step = int(self.model.global_step)
        interrupted = self.interrupted is not None
        self.callbacks.on_train_end({"steps": step, "examples": examples, "interrupted": interrupted})
        if self.verbose and step > start_step:
            print()
        return {
            "steps": step,
            "examples": examples,
            "examples_applied": self.examples_applied,
            "train_seconds": round(elapsed, 3),
            "examples_per_sec": round(examples / elapsed, 1) if elapsed > 0 and examples else 0.0,
        }

    # ------------------------------------------------------------------ evaluate

    def evaluator(self) -> Evaluator:
        """This trainer's `Evaluator` (one per trainer: its predict function traces once)."""
        if self._evaluator is None:
            self._evaluator = Evaluator(self.config, self.model, self.transformed)
        return self._evaluator

    def evaluate(self) -> dict:
        """Exact metrics over the eval split (the train split when there is none), also
        written to TensorBoard; see `recflow.training.evaluator.Evaluator`."""
        with self.timing.phase("eval"):
            result = self.evaluator().evaluate()
        write_evaluation(self.model_dir.logs_dir, int(self.model.global_step), result)
        return result

    def _evaluation_failed(self, error: DataError, exported) -> DataError:
        """The evaluation's error, saying what the run kept: its training finished, and
        its final checkpoint (and the export, `exported`, written beside the evaluation) stay."""
        kept = f"checkpoint of step {int(self.model.global_step)} saved"
        if exported is not None and exported.exception() is None:
            kept += f", export {exported.result()} written"
        return DataError(
            f"{error}. Training itself finished ({kept}); metrics.json is not written: "
            "rerun once the evaluation's data is fixed"
        )

    def run(self, train: Callable[[], dict] | None = None) -> dict:
        """train -> evaluate and export (side by side) -> metrics.json; returns the metrics.

        `train` replaces `fit` (e.g. streaming training); evaluation then runs
        only when `data.eval` is set. `train.evaluate: false` leaves it out, and
        `export.at_end: false` the export.

        Raises:
            DataError: (besides `fit`'s) the evaluation's bad rows exceed
                `data.max_bad_fraction`; the final checkpoint (and export) stay.
        """
        with self.timing.phase("train"), self.signals_stop():
            summary = (train or self.fit)()
        if self.interrupted is not None and train is None:
            # A file run cut short: its checkpoint is written; evaluation, export and
            # metrics belong to the run that finishes it.
            summary["interrupted"] = signal.Signals(self.interrupted).name
            return summary
        if summary.get("already_done"):
            missing = self.model_dir.missing_at_end(summary["steps"])
            if not missing:
                return summary
            # Killed after its final checkpoint, or its export damaged since: the run's
            # evaluation, export and metrics are written again.
            logger.warning("the run that ended at step %d has no %s (missing or damaged); writing its "
                           "export and metrics", summary["steps"], " or ".join(missing))
            summary = {"steps": summary["steps"], "examples": 0, "train_seconds": 0.0}
        evaluate = self.config.train.evaluate and (train is None or self.config.data.eval)
        # The export and the evaluation read the final weights and write nothing the
        # other reads: the export runs beside the evaluation (measured on the bench job,
        # 2 cores: 2.1 -> 1.6 s for both), and an error of either is raised here.
        with ThreadPoolExecutor(1, thread_name_prefix="recflow-export") as pool:
            exported = pool.submit(self.model_dir.export) if self.config.export.at_end else None
            try:
                result = self.evaluate() if evaluate else {}
            except DataError as e:  # too many bad rows in the evaluation's data
                raise self._evaluation_failed(e, exported) from None
            if exported is not None:
                result["export"] = exported.result()
        result.update(summary)
        result["bad_records"] = int(self.model.bad_records)  # the training's; the evaluation's: eval_bad_records
        if self.warm_start_report is not None:
            result["warm_start"] = self.warm_start_report
        result["examples_read"] = self.rows_read
        result["nonfinite_values"] = self.nonfinite_values
        result["truncated_rows"] = self.truncated_rows
        if evaluate and self.config.data.format == "synthetic" and self.config.task.type != "retrieval":
            oracle = data_lib.oracle_auc(self.config.data.synthetic, "eval")
            result["oracle_auc"] = round(float(oracle), 6)
        passes = (self.config.train.total_epochs or 0) if train is None else 0
        result["timing"] = self.timing.as_dict(summary.get("examples", 0), passes)
        self.model_dir.write_metrics(result)
        return result


def _position_of_the_other_kind(model_dir: ModelDir, local: bool) -> str | None:
    """What a resumed run must be told when its checkpoint was written part way through an
    epoch by the other kind of run: local runs and parameter servers keep their input
    positions in their own forms (a `tf.data` iterator; split positions), and neither can
    read on from the other's, so the epoch starts over. None when there is nothing to tell.

    (A local checkpoint holds a position from its epoch's first batch until its last pass
    ends; one stopped by `train.steps` at an epoch's end still holds that epoch, whose
    rows parameter servers would read again.)
    """
    epoch = model_dir.saved_value("epoch")
    if epoch is None:
        return None
    when = f"part way through epoch {int(epoch) + 1}"
    if local:  # parameter servers' split state: a split read at all is part of the epoch
        saved = model_dir.saved_value(split_positions.VARIABLE)
        if saved is None or not split_positions.started(saved):
            return None
        return (
            f"the checkpoint was written under parameter servers {when}; a local run cannot "
            "read on from its input splits' positions, so the epoch starts over from its first "
            "row and the rows they had read are trained again"
        )
    if not model_dir.saved_value(input_cache.VARIABLE):  # no position: between epochs
        return None
    return (
        f"the checkpoint was written by a local run {when}; parameter servers cannot read on "
        "from its input position, so the epoch starts over from its first row and the rows "
        "it had read are trained again"
    )


def _name(files: list[str] | None) -> str:
    if not files:
        return "the synthetic data"
    return files[0] if len(files) == 1 else f"{len(files)} files"


def _count(names: list[str], what: str) -> str:
    """`2 auto normalizers (a, b)`; `13 auto normalizers (I1, I10, I11 and 10 more)`."""
    return f"{len(names)} {what}{'s' if len(names) != 1 else ''} ({listed(names)})"
