"""Where things live in a model dir (DESIGN.md section 5): one place that names them.

`Layout` is the paths only, without TensorFlow: readers (`recflow serve`, `recflow
tables`, the launcher, a warm start, the normalizer fit) take their paths from it,
and `recflow.training.model_dir.ModelDir`, the one writer of that state, extends it.
"""

from __future__ import annotations

import os


class Layout:
    """The paths of the model dir `path`.

    Example:
        >>> Layout("runs/ctr").checkpoint_dir
        'runs/ctr/checkpoints'
    """

    def __init__(self, path: str):
        self.path = path

    @property
    def config_path(self) -> str:
        """The resolved config of the run that wrote the model dir."""
        return os.path.join(self.path, "config.yaml")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.path, "checkpoints")

    def checkpoint(self, step: int) -> str:
        """The prefix of the checkpoint of `step` (`ckpt-<step>`)."""
        return os.path.join(self.checkpoint_dir, f"ckpt-{step}")

    @property
    def deltas_dir(self) -> str:
        return os.path.join(self.path, "deltas")

    @property
    def export_dir(self) -> str:
        return os.path.join(self.path, "export")

    def export(self, version: int) -> str:
        """The SavedModel of `version` (a global step)."""
        return os.path.join(self.export_dir, str(version))

    @property
    def logs_dir(self) -> str:
        """TensorBoard's event files, and the task logs of `recflow launch`."""
        return os.path.join(self.path, "logs")

    @property
    def cache_dir(self) -> str:
        """The input cache's default home (`recflow.data.cache`; `data.cache_dir` overrides it)."""
        return os.path.join(self.path, "cache")

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.path, "metrics.json")

    @property
    def cluster_path(self) -> str:
        """The tasks of a `recflow launch` cluster."""
        return os.path.join(self.path, "cluster.json")

    @property
    def lock_path(self) -> str:
        """The writer lock (`recflow.training.lock`)."""
        return os.path.join(self.path, ".lock")
