"""Runs `recflow launch good.yaml --ps 1 --workers 1` (in a folder holding good.yaml and
its data) up to where the tasks would start; prints whether TensorFlow was imported by
then. The cluster's `run` is replaced: starting real tasks is tests/test_ps_cluster.py's."""

import sys

from recflow.cli import main
from recflow.distribute import launcher


def run(cluster) -> int:
    print("tensorflow" in sys.modules, [task.job for task in cluster.tasks])
    sys.exit(0)


launcher.Cluster.run = run
main(["launch", "good.yaml", "--ps", "1", "--workers", "1"])
