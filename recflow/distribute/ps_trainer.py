"""Training on `tf.distribute.ParameterServerStrategy` from the chief task.

Tables are split into one shard per PS task (key mod #PS, see `ModPlacement`);
dense variables are partitioned by a min-size partitioner. The loop is
`Trainer.fit`'s; only the runner differs: `PSRunner` hands the epoch's input
splits to the workers as `ClusterCoordinator` closures, so each row is read
once, by one worker (see `recflow.distribute.splits`). A worker that dies has
its closure rerun on another one. The chief owns checkpoints (dense + tables +
split state), eviction, deltas, evaluation and export.
"""

from __future__ import annotations

from recflow.config.schema import Config
from recflow.distribute.cluster import TaskRole, make_strategy, ps_devices
from recflow.embedding.placement import ModPlacement
from recflow.training.runner import PSRunner
from recflow.training.trainer import Trainer


class PSTrainer(Trainer):
    """A Trainer whose steps run on PS-strategy workers.

    Args:
        config: the run config.
        role: this (chief) task's role, from TF_CONFIG.
        model_dir: overrides `train.model_dir`.
        verbose: 0 silent, 1 a progress bar.
        callbacks: more Keras callbacks (see `Trainer`).
    """

    def __init__(
        self, config: Config, role: TaskRole, model_dir: str | None = None, verbose: int = 1, callbacks=None
    ):
        self.role = role
        self.strategy, self.coordinator = make_strategy(role)
        placement = ModPlacement(role.num_ps, ps_devices(role.num_ps))
        with self.strategy.scope():
            super().__init__(config, model_dir, verbose, placement=placement, callbacks=callbacks)

    def make_runner(self) -> PSRunner:
        with self.strategy.scope():
            return PSRunner(
                self.config, self.model, self.strategy, self.coordinator,
                len(self.role.cluster["worker"]), self._transformed,
            )
