"""Cluster roles from TF_CONFIG and the ParameterServerStrategy around a run.

Every task runs `recflow train CONFIG` with the same config and its own
TF_CONFIG: `ps` and `worker` tasks start a TF gRPC server and serve; the
`chief` builds the strategy and coordinates training.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from recflow.errors import RecflowError
from recflow.quiet import native_stderr_silenced

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


def serve(role: TaskRole, libraries: Sequence[str] = ()) -> None:
    """Runs this process's TF gRPC server until the process is stopped.

    A server runs the graphs the chief sends it: it needs TF's runtime (the C++
    library, where every kernel is registered) but none of TF's Python API. So a
    process that has not imported TensorFlow yet loads `server_lib` alone
    (`_server_lib`): on 2 cores 0.4 CPU s against 4.5 for `import tensorflow`,
    paid again by each PS and worker task at every (re)start of a cluster. `libraries`:
    op libraries (paths) whose kernels the graphs use, loaded first (Parquet input's).
    """
    server_lib = _server_lib()
    if libraries:
        from tensorflow.python.framework import load_library

        with native_stderr_silenced():
            for path in libraries:
                load_library.load_op_library(path)
    server = server_lib.Server(
        server_lib.ClusterSpec(role.cluster),
        job_name=role.job,
        task_index=role.index,
        protocol="grpc",
        start=True,
    )
    logger.info("%s:%d serving at %s", role.job, role.index, role.cluster[role.job][role.index])
    server.join()


def _server_lib():
    """`tensorflow.python.training.server_lib`, without running `tensorflow/__init__.py`
    (which imports TF's whole Python API, ~3,000 modules) unless it ran already.

    Python imports a package before its submodules. In a process that has not
    imported TensorFlow, `tensorflow` is first entered in `sys.modules` as the bare
    package (its path, not its code), so importing `server_lib` loads only what
    `server_lib` imports: the runtime's bindings and protos. The process then
    holds no `tensorflow` API: a server process runs nothing else.
    """
    if "tensorflow" not in sys.modules:
        spec = importlib.util.find_spec("tensorflow")
        package = importlib.util.module_from_spec(spec)  # not executed: no API, no imports
        sys.modules["tensorflow"] = package
    with native_stderr_silenced():  # the runtime's cuDNN/cuBLAS factory lines at load
        from tensorflow.python.training import server_lib
    return server_lib


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
