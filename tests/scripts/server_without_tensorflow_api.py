"""Runs `recflow train good.yaml` (in a folder holding good.yaml and its data) as PS task 0
of a loopback cluster given by TF_CONFIG, until its TF server has started; prints whether
TensorFlow's Python API (`tf.constant`) or tf_keras was imported by then, and the
server's target. The server's `join` is replaced so the task returns: serving real
steps is tests/test_ps_cluster.py's."""

import json
import os
import sys

from recflow.cli import main
from recflow.distribute import cluster, launcher

chief, worker, ps = (f"127.0.0.1:{port}" for port in launcher.free_ports(3))
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": {"chief": [chief], "worker": [worker], "ps": [ps]}, "task": {"type": "ps", "index": 0}}
)
load = cluster._server_lib


def server_lib():
    module = load()

    def join(server):
        api = hasattr(sys.modules["tensorflow"], "constant")
        print(api, "tf_keras" in sys.modules, server.target == f"grpc://{ps}")
        sys.exit(0)

    module.Server.join = join
    return module


cluster._server_lib = server_lib
main(["train", "good.yaml", "--set", "distribute.strategy=parameter_server"])
