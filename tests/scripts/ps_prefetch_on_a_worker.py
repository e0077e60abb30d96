"""Trains 4 steps in a chunk on a remote worker with and without prefetching (rows
staged in slot 1 of 2 on the PS); prints, as JSON, the steps, the keys and the largest
difference of rows, slots and weights (tests/test_ps_step_graph.py reads it).

Run from the repository root, in its own process: connecting to a cluster changes the
process's device names.
"""

import json

import numpy as np

# isort: off
import recflow  # noqa: F401  (selects Keras 2 before TensorFlow loads)
import tensorflow as tf
import tf_keras as keras
# isort: on

from recflow.config import load_config
from recflow.data import make_dataset
from recflow.data.records import NONFINITE, TRUNCATED
from recflow.distribute.chunk import train_chunk
from recflow.distribute.cluster import ps_devices
from recflow.distribute.launcher import free_ports
from recflow.embedding.placement import ModPlacement
from recflow.features.transform import transform
from recflow.models import build_model
from recflow.training.dense_optimizer import make_dense_optimizer

chief, ps_port, worker_port = free_ports(3)
cluster = tf.train.ClusterSpec(
    {
        "ps": [f"localhost:{ps_port}"],
        "worker": [f"localhost:{worker_port}"],
        "chief": [f"localhost:{chief}"],
    }
)
servers = [tf.distribute.Server(cluster, job_name=j, task_index=0) for j in ("ps", "worker")]
tf.config.experimental_connect_to_cluster(cluster, job_name="chief")
(ps,) = ps_devices(1)
config = load_config(
    "configs/deepfm_demo.yaml",
    [
        "data.batch_size=32",
        "data.shuffle=false",
        "model.params={dnn: {hidden_units: [8]}}",
    ],
)


def transformed(features, labels, bad):
    features = transform(config, features)
    features[NONFINITE] = features[TRUNCATED] = tf.constant(0, tf.int64)
    return features, labels, bad


def train(prefetch):
    keras.utils.set_random_seed(1)
    with tf.device(ps):
        model = build_model(config, ModPlacement(1, [ps]))
        model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
        model.build_weights()
    model.embedding.make_staging(2)
    chunk = tf.function(
        lambda slot: tuple(
            train_chunk(
                model,
                iter(make_dataset(config, "train", epochs=1).take(4).map(transformed)),
                prefetch=prefetch,
                slot=slot,
            )
        ),
        autograph=False,
    )
    with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
        result = chunk(tf.constant(1, tf.int64))  # the second of two slots
    rows = model.embedding.logical_rows()
    return int(result[1]), rows, [w.numpy() for w in model.trainable_weights]


steps, rows, weights = train(prefetch=True)
plain_steps, plain_rows, plain_weights = train(prefetch=False)
diff = 0.0
for name, got in rows.items():
    want = plain_rows[name]
    order, plain_order = np.argsort(got.ids), np.argsort(want.ids)
    assert np.array_equal(got.ids[order], want.ids[plain_order]), name
    diff = max(diff, float(np.abs(got.emb[order] - want.emb[plain_order]).max(initial=0)))
    diff = max(diff, float(np.abs(got.slots[order] - want.slots[plain_order]).max(initial=0)))
for a, b in zip(weights, plain_weights):
    diff = max(diff, float(np.abs(a - b).max()))
print(
    json.dumps(
        {
            "steps": [steps, plain_steps],
            "keys": sum(len(r.ids) for r in rows.values()),
            "max_diff": diff,
        }
    )
)
