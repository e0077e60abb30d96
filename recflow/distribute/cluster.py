"""Cluster roles from TF_CONFIG and the ParameterServerStrategy around a run.

Every task runs `recflow train CONFIG` with the same config and its own
TF_CONFIG: `ps` and `worker` tasks start a TF gRPC server and serve; the
`chief` builds the strategy and coordinates training.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from recflow.errors import RecflowError

logger = logging.getLogger(__name__)

PS_JOB = "ps"


@dataclass(frozen=True)
class TaskRole:
    job: str  # chief | worker | ps
    index: int
    cluster: dict  # job -> [address, ...]

    @property
    def num_ps(self) -> int:
        return len(self.cluster.get(PS_JOB, []))

    @property
    def coordinates(self) -> bool:
        return self.job == "chief"


def read_tf_config(environ=os.environ) -> TaskRole:
    """The task of this process, from the TF_CONFIG environment variable."""
    raw = environ.get("TF_CONFIG")
    if not raw:
        raise RecflowError(
            "distribute.strategy: parameter_server needs TF_CONFIG in the environment "
            "(or use `recflow launch CONFIG --ps N --workers M`)"
        )
    try:
        tf_config = json.loads(raw)
        cluster = tf_config["cluster"]
        task = tf_config["task"]
        role = TaskRole(task["type"], int(task.get("index", 0)), cluster)
    except (ValueError, KeyError, TypeError) as e:
        raise RecflowError(f"TF_CONFIG: expected {{'cluster': ..., 'task': {{'type', 'index'}}}} ({e})") from None
    if role.job not in ("chief", "worker", PS_JOB):
        raise RecflowError(f"TF_CONFIG: task.type must be chief, worker or ps, got {role.job!r}")
    if not role.num_ps or "worker" not in cluster or "chief" not in cluster:
        raise RecflowError("TF_CONFIG: cluster needs chief, worker and ps jobs")
    if role.index >= len(cluster.get(role.job, [])):
        raise RecflowError(f"TF_CONFIG: task {role.job}:{role.index} is not in the cluster")
    return role


def serve(role: TaskRole) -> None:
    """Runs this process's TF gRPC server until the process is stopped."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=role.job,
        task_index=role.index,
        protocol="grpc",
        start=True,
    )
    logger.info("%s:%d serving at %s", role.job, role.index, role.cluster[role.job][role.index])
    server.join()


def ps_devices(num_ps: int) -> list[str]:
    return [f"/job:{PS_JOB}/replica:0/task:{i}/device:CPU:0" for i in range(num_ps)]


def make_strategy(role: TaskRole):
    """ParameterServerStrategy (dense variables split by a min-size partitioner) + coordinator."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=role.num_ps
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    return strategy, coordinator
