"""The training loop: input, steps, checkpoints, lifecycle hooks, evaluation, export."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import tensorflow as tf
import tf_keras as keras

from recflow import data as data_lib
from recflow.atomic import write_json
from recflow.config.loader import dump_config
from recflow.config.schema import Config, DenseOptimizerConfig
from recflow.embedding import lifecycle
from recflow.export.saved_model import export_saved_model
from recflow.features.transform import transform
from recflow.models.base import RankingModel, build_model
from recflow.training import metrics as metrics_lib

logger = logging.getLogger(__name__)

_DENSE_OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adagrad": keras.optimizers.Adagrad,
    "sgd": keras.optimizers.SGD,
    "ftrl": keras.optimizers.Ftrl,
}


def make_dense_optimizer(config: DenseOptimizerConfig) -> keras.optimizers.Optimizer:
    return _DENSE_OPTIMIZERS[config.type](learning_rate=config.learning_rate)


class Trainer:
    """Trains, evaluates and exports one model dir.

    Args:
        config: the run config.
        model_dir: overrides `config.train.model_dir`.
        verbose: 0 silent, 1 progress bar.
    """

    def __init__(self, config: Config, model_dir: str | None = None, verbose: int = 1):
        self.config = config
        self.model_dir = model_dir or config.train.model_dir
        self.verbose = verbose
        self.model: RankingModel = build_model(config)
        self.model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
        self._iterator = None
        self._checkpoint = None
        self._manager = None
        self._last_delta_step = 0

    # ------------------------------------------------------------------ input

    def dataset(self, split: str, epochs: int | None, shuffle: bool | None = None):
        """Batches of (transformed features, labels, bad-record count)."""
        config = self.config
        ds = data_lib.make_dataset(config, split, epochs=epochs, shuffle=shuffle)
        ds = ds.map(
            lambda f, labels, bad: (transform(config, f), labels, bad),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        return ds.prefetch(tf.data.AUTOTUNE)

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.model_dir, "checkpoints")

    def _open(self, iterator=None) -> None:
        """Creates the checkpoint (dense + tables + input position) and restores the latest."""
        model = self.model
        objects = {"model": model, "optimizer": model.optimizer}
        if iterator is not None:
            objects["iterator"] = iterator
        self._checkpoint = tf.train.Checkpoint(**objects)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, self.checkpoint_dir, max_to_keep=self.config.train.keep_checkpoints
        )
        latest = self._manager.latest_checkpoint
        if latest:
            self._checkpoint.restore(latest).expect_partial()
            logger.info("restored %s at step %d", latest, int(model.global_step))
        state = os.path.join(self.model_dir, "deltas")
        if os.path.isdir(state):
            steps = [int(d) for d in os.listdir(state) if d.isdigit()]
            self._last_delta_step = max(steps, default=0)

    def restore(self) -> int:
        """Restores the latest checkpoint (without input position); returns its step."""
        if self._checkpoint is None:
            self._open()
        return int(self.model.global_step)

    def save_checkpoint(self) -> str:
        """Evicts stale rows, then writes a checkpoint of everything."""
        step = int(self.model.global_step)
        evicted = lifecycle.evict(self.model.embedding, step)
        if any(evicted.values()):
            logger.info("step %d: evicted %s", step, evicted)
        return self._manager.save(checkpoint_number=step)

    def write_delta(self) -> str:
        step = int(self.model.global_step)
        path = lifecycle.write_delta(
            self.model.embedding, os.path.join(self.model_dir, "deltas"), self._last_delta_step, step
        )
        self._last_delta_step = step
        return path

    def export(self) -> str:
        return export_saved_model(self.model, self.model_dir, keep=self.config.export.keep)

    # ------------------------------------------------------------------ train

    def fit(self) -> dict:
        """Trains to `train.steps` / `train.epochs` (totals), resuming from the latest checkpoint."""
        config = self.config
        os.makedirs(self.model_dir, exist_ok=True)
        dump_config(config, os.path.join(self.model_dir, "config.yaml"))
        iterator = iter(self.dataset("train", epochs=config.train.total_epochs))
        self._open(iterator)
        model = self.model
        step_fn = tf.function(model.train_step, input_signature=[iterator.element_spec])
        writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "logs"))
        target = config.train.steps
        step = start = int(model.global_step)
        saved_step = step if self._manager.latest_checkpoint else -1
        progbar = keras.utils.Progbar(target, verbose=self.verbose, stateful_metrics=["loss"])
        every = config.train.checkpoint_every_steps
        export_every = config.export.every_steps
        delta_every = config.export.delta_every_steps
        examples, began = 0, time.perf_counter()
        while target is None or step < target:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            loss = float(step_fn(batch)["loss"])
            step += 1
            examples += int(tf.shape(batch[1][config.labels[0]])[0])
            progbar.update(step if target else step - start, [("loss", loss)])
            if step % config.train.log_every_steps == 0:
                with writer.as_default(step=step):
                    tf.summary.scalar("loss", loss)
            if every and step % every == 0:
                self.save_checkpoint()
                saved_step = step
            if delta_every and step % delta_every == 0:
                self.write_delta()
            if export_every and step % export_every == 0:
                self.export()
        elapsed = time.perf_counter() - began
        if saved_step != step:
            self.save_checkpoint()
        if self.verbose:
            print()
        return {
            "steps": step,
            "examples": examples,
            "train_seconds": round(elapsed, 3),
            "examples_per_sec": round(examples / elapsed, 1) if elapsed > 0 and examples else 0.0,
        }

    # ------------------------------------------------------------------ evaluate

    def evaluate(self) -> dict:
        """Exact metrics over the eval split (the train split when there is none)."""
        config = self.config
        split = "eval" if (config.data.eval or config.data.format == "synthetic") else "train"
        model = self.model
        predict = tf.function(lambda f: model(f, training=False))
        group_by = config.task.group_by
        labels = {h.label: [] for h in model.heads}
        preds = {h.output: [] for h in model.heads}
        groups, bad = [], 0
        for features, batch_labels, batch_bad in self.dataset(split, epochs=1, shuffle=False):
            out = predict(features)
            for head in model.heads:
                labels[head.label].append(batch_labels[head.label].numpy())
                preds[head.output].append(out[head.output].numpy().reshape(-1))
            if group_by:
                groups.append(np.asarray(features[group_by]).reshape(-1))
            bad += int(batch_bad)
        result = {"eval_split": split, "eval_examples": 0}
        for head in model.heads:
            y = np.concatenate(labels[head.label]) if labels[head.label] else np.zeros(0)
            p = np.concatenate(preds[head.output]) if preds[head.output] else np.zeros(0)
            result["eval_examples"] = int(y.size)
            g = np.concatenate(groups) if groups else None
            prefix = "" if len(model.heads) == 1 else f"{head.name}/"
            for name in config.task.metric_names(head.type):
                value = metrics_lib.compute(name, y, p, g) if y.size else float("nan")
                result[prefix + name] = round(value, 6)
        result["eval_bad_records"] = bad
        return result

    def run(self) -> dict:
        """train -> evaluate -> export -> metrics.json; returns the metrics."""
        summary = self.fit()
        result = self.evaluate()
        result.update(summary)
        result["bad_records"] = int(self.model.bad_records) + result.pop("eval_bad_records")
        oracle = data_lib.oracle_auc_for(self.config)
        if oracle is not None:
            result["oracle_auc"] = round(oracle, 6)
        result["export"] = self.export()
        writer = tf.summary.create_file_writer(os.path.join(self.model_dir, "logs"))
        with writer.as_default(step=result["steps"]):
            for key, value in result.items():
                if isinstance(value, float):
                    tf.summary.scalar("eval/" + key, value)
        write_json(os.path.join(self.model_dir, "metrics.json"), result)
        return result
