"""Runs `recflow launch good.yaml --ps 2 --workers 2` (in a folder holding good.yaml and
its data) up to where the tasks would start; prints whether TensorFlow was imported by
then, and the order the cluster starts its tasks in. The cluster's `run` and `start`
are replaced: starting real tasks is tests/test_ps_cluster.py's."""

import sys

from recflow.cli import main
from recflow.distribute import launcher


def run(cluster) -> int:
    started = []
    cluster.start = started.append
    cluster._start_all()
    print("tensorflow" in sys.modules, [task.name for task in started])
    sys.exit(0)


launcher.Cluster.run = run
main(["launch", "good.yaml", "--ps", "2", "--workers", "2"])
