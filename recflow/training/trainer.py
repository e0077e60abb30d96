"""The training loop: input, steps, checkpoints, lifecycle hooks, evaluation, export."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from typing import Callable

import numpy as np
import tensorflow as tf
import tf_keras as keras

from recflow import data as data_lib
from recflow.atomic import write_json
from recflow.config.loader import dump_config
from recflow.config.schema import Config, DenseOptimizerConfig
from recflow.data.pipeline import NONFINITE, TRUNCATED
from recflow.embedding import lifecycle
from recflow.embedding.engine import check_checkpoint
from recflow.embedding.placement import Placement
from recflow.errors import DataError
from recflow.export.saved_model import Exporter
from recflow.features import fit
from recflow.features.transform import transform
from recflow.models.base import RankingModel, build_model
from recflow.training import model_dir as model_dir_lib
from recflow.training.evaluator import Evaluator
from recflow.training.timing import Timing

logger = logging.getLogger(__name__)

_DENSE_OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adagrad": keras.optimizers.Adagrad,
    "sgd": keras.optimizers.SGD,
    "ftrl": keras.optimizers.Ftrl,
}


def make_dense_optimizer(config: DenseOptimizerConfig) -> keras.optimizers.Optimizer:
    return _DENSE_OPTIMIZERS[config.type](learning_rate=config.learning_rate)


def saved_value(checkpoint_dir: str, name: str):
    """A top-level variable of the newest readable checkpoint, read without building a model."""
    latest = model_dir_lib.readable_checkpoint(checkpoint_dir)
    if latest is None:
        return None
    reader = tf.train.load_checkpoint(latest)
    key = f"{name}/.ATTRIBUTES/VARIABLE_VALUE"
    return reader.get_tensor(key) if key in reader.get_variable_to_shape_map() else None


class Trainer:
    """Trains, evaluates and exports one model dir.

    Args:
        config: the run config.
        model_dir: overrides `config.train.model_dir`.
        verbose: 0 silent, 1 progress bar.
    """

    def __init__(
        self,
        config: Config,
        model_dir: str | None = None,
        verbose: int = 1,
        placement: Placement | None = None,
    ):
        self.model_dir = model_dir or config.train.model_dir
        config, warnings = fit.resolve(config, self.model_dir)  # `auto` normalizers
        for warning in warnings:
            logger.warning(warning)
        self.config = config
        self.verbose = verbose
        self.timing = Timing()
        keras.utils.set_random_seed(config.train.seed)  # dense initial weights, dropout
        self.model: RankingModel = build_model(config, placement)
        self.model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
        self.model.build_weights()  # before any step is traced: the step traces once
        self.model.train_step = self.timing.traced(self.model.train_step)
        self._evaluator: Evaluator | None = None  # one per trainer: its predict traces once
        self._exporter = Exporter(self.model)  # one serving module, refreshed per export
        self._checkpoint = None
        self._manager = None
        # The step of the last delta written, saved in each checkpoint: a resume
        # continues the delta chain from its checkpoint, not from what is on disk.
        self._delta_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="delta_step")
        self._saved_step = -1
        self._step_fn = None
        self._writer = None
        self.stop_requested = False
        self.rows_read = 0  # rows read by training passes of this process (kept + bad)
        self.bad_rows = 0
        self.nonfinite_values = 0  # numeric values read as missing: inf, overflow, "nan"
        self.truncated_rows = 0  # multi_hot rows cut to max_values

    # ------------------------------------------------------------------ input

    def dataset(self, split: str, epochs: int | None, shuffle: bool | None = None, files=None):
        """Batches of (transformed features, labels, bad-record count).

        `files` reads those files instead of the configured split.
        """
        config = self.config
        if files is not None:
            ds = data_lib.make_file_dataset(config, files, epochs=epochs, shuffle=shuffle)
        else:
            ds = data_lib.make_dataset(config, split, epochs=epochs, shuffle=shuffle)
        return self._transformed(ds)

    def _transformed(self, ds):
        config = self.config

        @tf.autograph.experimental.do_not_convert  # plain tensor code: traced as written
        def fn(raw, labels, bad):
            counts: dict = {}
            features = transform(config, raw, counts)
            features[NONFINITE] = raw[NONFINITE]
            features[TRUNCATED] = tf.cast(counts.get("truncated", 0), tf.int64)
            return features, labels, bad

        ds = ds.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.prefetch(tf.data.AUTOTUNE)

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.model_dir, "checkpoints")

    def _open(self, iterator=None, restore: bool = True, **extra) -> None:
        """Creates the checkpoint (dense + tables + input position + `extra`);
        restores the latest one when `restore`."""
        model = self.model
        objects = {"model": model, "optimizer": model.optimizer, "delta_step": self._delta_step, **extra}
        if iterator is not None:
            objects["iterator"] = iterator
        self._checkpoint = tf.train.Checkpoint(**objects)
        latest = None
        if restore:
            # The newest checkpoint that reads back whole; the index file is rebuilt
            # to match before the manager reads it.
            latest = model_dir_lib.readable_checkpoint(self.checkpoint_dir)
            model_dir_lib.repair_checkpoints(self.checkpoint_dir, latest)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, self.checkpoint_dir, max_to_keep=self.config.train.keep_checkpoints
        )
        if not restore:
            return  # a new input pass of a run already restored
        if latest:
            check_checkpoint(latest)
            self._checkpoint.restore(latest).expect_partial()
            self._saved_step = int(model.global_step)
            logger.info("restored %s at step %d", latest, self._saved_step)
        model_dir_lib.set_aside_stale_deltas(
            os.path.join(self.model_dir, "deltas"), int(model.global_step)
        )

    def restore(self) -> int:
        """Restores the latest checkpoint (without input position); returns its step."""
        if self._checkpoint is None:
            self._open()
        return int(self.model.global_step)

    def evict(self) -> None:
        """Removes stale rows (eviction runs at every checkpoint)."""
        step = int(self.model.global_step)
        evicted = lifecycle.evict(self.model.embedding, step)
        if any(evicted.values()):
            logger.info("step %d: evicted %s", step, evicted)

    def save_checkpoint(self, evict: bool = True) -> str:
        """Evicts stale rows (unless `evict` is False: done already), then writes a
        checkpoint of everything."""
        step = int(self.model.global_step)
        if evict:
            self.evict()
        try:
            path = self._manager.save(checkpoint_number=step)
        except BaseException:
            model_dir_lib.discard_failed_save(self.checkpoint_dir, step)
            raise
        self._saved_step = step
        return path

    def write_delta(self) -> str:
        """Writes `deltas/<step>/`: rows updated since the previous delta (kept if up to date).

        The previous delta's step comes from the checkpoint (`delta_step`), so a
        resumed run writes the same deltas as one that was never stopped.
        """
        step, since = int(self.model.global_step), int(self._delta_step)
        deltas = os.path.join(self.model_dir, "deltas")
        final = os.path.join(deltas, str(step))
        if os.path.isdir(final) and since == step:
            return final
        old = None
        if os.path.isdir(final):  # a delta of this step not recorded in the checkpoint
            old = os.path.join(deltas, f".tmp-replaced-{step}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        try:
            path = lifecycle.write_delta(self.model.embedding, deltas, since, step)
        except BaseException:
            if old is not None:
                os.replace(old, final)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._delta_step.assign(step)
        return path

    def export(self) -> str:
        """Writes `export/<global step>/` (replacing an export of the same step)."""
        step = int(self.model.global_step)
        with self.timing.phase("export"):
            return self._exporter.export(self.model_dir, keep=self.config.export.keep, step=step)

    # ------------------------------------------------------------------ train

    def fit(self) -> dict:
        """Trains to `train.steps` / `train.epochs` (totals), resuming from the latest checkpoint.

        Each epoch is its own input pass (shuffled with `data.seed + epoch`); the
        checkpoint holds the epoch and the position inside it.
        """
        config = self.config
        self.prepare_model_dir()
        epochs = config.train.total_epochs  # None: as many as `train.steps` needs
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        saved = saved_value(self.checkpoint_dir, "epoch")
        epoch.assign(0 if saved is None else int(saved))
        steps = config.train.steps
        if saved is not None and steps is None and int(epoch) >= epochs:
            return self.already_done(int(epoch))
        iterator = iter(self.epoch_dataset(int(epoch)))
        self._open(iterator, epoch=epoch)
        began, start = time.perf_counter(), int(self.model.global_step)
        if steps is not None and start >= steps:
            return self.already_done(int(epoch))
        files = self.train_files()
        per_epoch = self.steps_per_epoch(files)
        examples, resumed = 0, start > 0
        while not self.stop_requested:
            if self.verbose and epochs:
                print(f"Epoch {int(epoch) + 1}/{epochs}")
            read_before, pass_start = self.rows_read, int(self.model.global_step)
            examples += self.run_steps(iterator, target=steps, files=files, per_epoch=per_epoch)
            if self.rows_read == read_before and not resumed:
                raise DataError(f"data.train: a pass over {_name(files)} read no rows")
            if per_epoch is None and not resumed:  # now known, for the next passes' progress bar
                per_epoch = int(self.model.global_step) - pass_start
            resumed = False
            if (steps is not None and self.model.global_step >= steps) or self.stop_requested:
                break
            epoch.assign_add(1)  # the pass ended
            # The next pass's fresh iterator goes into every later checkpoint, the final one
            # included, so a run given more epochs later starts that pass at its beginning.
            iterator = iter(self.epoch_dataset(int(epoch)))
            self._open(iterator, restore=False, epoch=epoch)
            self._saved_step = -1  # the final checkpoint must record the new epoch
            if epochs is not None and int(epoch) >= epochs:
                break
        if int(self.model.global_step) == 0 and not self.stop_requested:
            raise DataError(
                f"data.train: no examples trained ({self.rows_read} rows read, "
                f"{self.bad_rows} bad); nothing is exported"
            )
        return self.finish(examples, time.perf_counter() - began, start)

    def already_done(self, epoch: int) -> dict:
        """The summary of a model dir whose run is complete: nothing trained, nothing exported."""
        step = self.restore()
        return {"steps": step, "epoch": epoch, "examples": 0, "already_done": True}

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
        if data.format != "csv" or sum(os.path.getsize(f) for f in files) > 256 << 20:
            return None
        rows = 0
        for file in files:
            with open(file, "rb") as f:
                rows += sum(1 for line in f if line.strip()) - (1 if data.csv.header else 0)
        return -(-max(rows, 0) // data.batch_size)

    def epoch_dataset(self, epoch: int):
        """One pass over the training data, shuffled differently each epoch."""
        self.timing.pass_begins(epoch)
        data = dataclasses.replace(self.config.data, seed=self.config.data.seed + epoch)
        config = dataclasses.replace(self.config, data=data)
        ds = data_lib.make_dataset(config, "train", epochs=1)
        return self._transformed(ds)

    def prepare_model_dir(self) -> None:
        model_dir_lib.ensure_dir(self.model_dir)
        dump_config(self.config, os.path.join(self.model_dir, "config.yaml"))

    def request_stop(self) -> None:
        """Asks the loop to stop after the current step (signal handlers call this)."""
        self.stop_requested = True

    def run_steps(
        self,
        iterator,
        target: int | None = None,
        files: list[str] | None = None,
        per_epoch: int | None = None,
    ) -> int:
        """Trains on `iterator` until it ends, `target` steps, or a stop request.

        Runs the checkpoint, delta and export hooks on schedule; returns the
        number of examples trained. `files` are the files the iterator reads
        (named when too many rows are bad); `per_epoch` the steps of a whole
        pass, for the progress bar.

        Raises:
            DataError: the bad rows of this pass exceed `data.max_bad_fraction`,
                or the loss is not finite (nothing more is saved).
        """
        config, model = self.config, self.model
        if self._step_fn is None:
            # The engine and tower are plain tensor code: tracing without AutoGraph is
            # several times faster (the tower itself is still converted, see RankingModel).
            self._step_fn = tf.function(
                model.train_step, input_signature=[iterator.element_spec], autograph=False
            )
            self._writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "logs"))
        step = start = int(model.global_step)
        progbar = keras.utils.Progbar(
            target or per_epoch, verbose=self.verbose, stateful_metrics=["loss"]
        )
        examples = bad = 0
        sample = 10 * config.data.batch_size  # rows read before the bad fraction is judged
        while (target is None or step < target) and not self.stop_requested:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            features, labels, batch_bad = batch
            size = int(tf.shape(labels[config.labels[0]])[0])
            bad += int(batch_bad)
            self.nonfinite_values += int(features[NONFINITE])
            self.truncated_rows += int(features[TRUNCATED])
            if examples + bad >= sample:
                self._check_bad(examples, bad, files)
            if size == 0:  # every row of the batch was bad: no step
                model.bad_records.assign_add(int(batch_bad))
                continue
            loss = float(self._step_fn(batch)["loss"])
            step += 1
            examples += size
            if not np.isfinite(loss):
                raise DataError(f"step {step}: the loss is {loss}; {_out_of_range(config, batch)}")
            progbar.update(step if target else step - start, [("loss", loss)])
            if step % config.train.log_every_steps == 0:
                with self._writer.as_default(step=step):
                    tf.summary.scalar("loss", loss)
            self.run_hooks(step)
        self.rows_read += examples + bad
        self.bad_rows += bad
        self._check_bad(examples, bad, files)
        return examples

    def _check_bad(self, examples: int, bad: int, files: list[str] | None) -> None:
        """Raises DataError when the bad rows exceed `data.max_bad_fraction` of the rows read."""
        limit = self.config.data.max_bad_fraction
        read = examples + bad
        if not bad or bad <= limit * read:
            return
        first = data_lib.pipeline.first_bad_record(self.config, files) if files else None
        raise DataError(
            f"{bad} of {read} rows read are bad ({bad / read:.1%}, above data.max_bad_fraction "
            f"{limit:g})" + (f"; first: {first}" if first else "")
        )

    def run_hooks(self, step: int) -> None:
        """The scheduled writes after `step`: eviction (with a checkpoint), the delta
        (of the rows that survived) and the export, then the checkpoint.

        The checkpoint comes last, so a kill anywhere before it is replayed from the
        previous checkpoint and rewrites this step's delta and export; it records
        the delta's step, so a resume from it continues the delta chain exactly.
        """
        config = self.config
        delta_every = config.export.delta_every_steps
        every = config.train.checkpoint_every_steps
        export_every = config.export.every_steps
        checkpoint = bool(every) and step % every == 0
        if checkpoint:
            self.evict()
        if delta_every and step % delta_every == 0:
            self.write_delta()
        if export_every and step % export_every == 0:
            self.export()
        if checkpoint:
            self.save_checkpoint(evict=False)

    def finish(self, examples: int, elapsed: float, start_step: int) -> dict:
        """Final checkpoint (with eviction) unless one was just written; a summary."""
        step = int(self.model.global_step)
        if self._saved_step != step:
            self.save_checkpoint()
        if self.verbose and step > start_step:
            print()
        return {
            "steps": step,
            "examples": examples,
            "train_seconds": round(elapsed, 3),
            "examples_per_sec": round(examples / elapsed, 1) if elapsed > 0 and examples else 0.0,
        }

    # ------------------------------------------------------------------ evaluate

    def evaluate(self) -> dict:
        """Exact metrics over the eval split (the train split when there is none);
        see `recflow.training.evaluator.Evaluator`."""
        if self._evaluator is None:
            self._evaluator = Evaluator(self.config, self.model, self._transformed)
        with self.timing.phase("eval"):
            return self._evaluator.evaluate()

    def run(self, train: Callable[[], dict] | None = None) -> dict:
        """train -> evaluate -> export -> metrics.json; returns the metrics.

        `train` replaces `fit` (e.g. streaming training); evaluation then runs
        only when `data.eval` is set.
        """
        with self.timing.phase("train"):
            summary = (train or self.fit)()
        if summary.get("already_done"):
            return summary
        evaluate = train is None or self.config.data.eval
        result = self.evaluate() if evaluate else {"eval_bad_records": 0}
        result.update(summary)
        eval_bad = result.pop("eval_bad_records")  # rows of the training files count once
        result["bad_records"] = int(self.model.bad_records) + (
            eval_bad if result.get("eval_split") == "eval" else 0
        )
        result["examples_read"] = self.rows_read
        result["nonfinite_values"] = self.nonfinite_values
        result["truncated_rows"] = self.truncated_rows
        if self.config.data.format == "synthetic" and self.config.task.type != "retrieval":
            oracle = data_lib.oracle_auc(self.config.data.synthetic, "eval")
            result["oracle_auc"] = round(float(oracle), 6)
        result["export"] = self.export()
        passes = (self.config.train.total_epochs or 0) if train is None else 0
        result["timing"] = self.timing.as_dict(summary.get("examples", 0), passes)
        writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "logs"))
        with writer.as_default(step=result["steps"]):
            for key, value in result.items():
                if isinstance(value, float) and np.isfinite(value):
                    tf.summary.scalar("eval/" + key, value)
        write_json(os.path.join(self.model_dir, "metrics.json"), result)
        return result


def _name(files: list[str] | None) -> str:
    if not files:
        return "the synthetic data"
    return files[0] if len(files) == 1 else f"{len(files)} files"


def _out_of_range(config: Config, batch) -> str:
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
