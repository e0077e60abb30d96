"""Training on `tf.distribute.ParameterServerStrategy` from the chief task.

Tables are split into one shard per PS task (key mod #PS, see `ModPlacement`);
dense variables are partitioned by a min-size partitioner. Workers run
`train_step` on their own shard of the input (`ClusterCoordinator.schedule`);
a worker that dies has its steps rescheduled on the others. The chief owns
checkpoints (dense + tables), eviction, deltas, evaluation and export.
"""

from __future__ import annotations

import logging
import math
import time

import tensorflow as tf

from recflow import data as data_lib
from recflow.config.schema import Config
from recflow.distribute.cluster import TaskRole, make_strategy, ps_devices
from recflow.embedding.placement import ModPlacement
from recflow.training.trainer import Trainer

logger = logging.getLogger(__name__)


class PSTrainer(Trainer):
    """A Trainer whose steps run on PS-strategy workers.

    Args:
        config: the run config.
        role: this (chief) task's role, from TF_CONFIG.
        model_dir: overrides `train.model_dir`.
        verbose: 0 silent, 1 a line per chunk of steps.
    """

    def __init__(self, config: Config, role: TaskRole, model_dir: str | None = None, verbose: int = 1):
        self.role = role
        self.strategy, self.coordinator = make_strategy(role)
        placement = ModPlacement(role.num_ps, ps_devices(role.num_ps))
        with self.strategy.scope():
            super().__init__(config, model_dir, verbose, placement=placement)

    def _per_worker_iterator(self):
        config = self.config
        shuffle = config.data.shuffle

        def dataset_fn(context: tf.distribute.InputContext):
            ds = data_lib.make_dataset(config, "train", epochs=None, shuffle=shuffle)
            ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
            return self._transformed(ds)

        def per_worker():
            return self.strategy.distribute_datasets_from_function(dataset_fn)

        return iter(self.coordinator.create_per_worker_dataset(per_worker))

    def total_steps(self) -> int:
        """`train.steps`, or epochs x batches per epoch (counted once on the chief)."""
        config = self.config
        if config.train.steps is not None:
            return config.train.steps
        if config.data.format == "synthetic":
            batches = math.ceil(config.data.synthetic.rows / config.data.batch_size)
        else:
            batches = int(self.dataset("train", epochs=1).reduce(0, lambda n, _: n + 1))
        return batches * config.train.total_epochs

    def fit(self) -> dict:
        config, model = self.config, self.model
        self.prepare_model_dir()
        self._open()
        iterator = self._per_worker_iterator()
        strategy = self.strategy

        @tf.function(autograph=False)
        def worker_step(it):
            return strategy.run(model.train_step, args=(next(it),))

        target = self.total_steps()
        hooks = [
            n
            for n in (
                config.train.checkpoint_every_steps,
                config.export.every_steps,
                config.export.delta_every_steps,
            )
            if n
        ]
        began = time.perf_counter()
        step = start = int(model.global_step)
        while step < target and not self.stop_requested:
            # Schedule up to the next hook boundary, then wait for the workers.
            boundary = min([target] + [(step // n + 1) * n for n in hooks])
            for _ in range(boundary - step):
                result = self.coordinator.schedule(worker_step, args=(iterator,))
            self.coordinator.join()
            step = int(model.global_step)
            loss = float(result.fetch()["loss"])
            if self.verbose:
                print(f"step {step}/{target}  loss {loss:.4f}", flush=True)
            self.run_hooks(step)
        elapsed = time.perf_counter() - began
        examples = (step - start) * config.data.batch_size  # full batches on an endless stream
        return self.finish(examples, elapsed, start)
