"""Trains chunks of steps on a remote worker into a table sharded over 2 PS tasks, laying
the shards out again between chunks (`EmbeddingEngine.grow`, on the PS tasks) and not;
prints, as JSON, whether both hold the same rows bit for bit (each key once), and each
shard's (buckets, keys) after every chunk with growth (tests/test_growth.py reads it).

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

from recflow.config import config_from_dict
from recflow.data.records import NONFINITE, TRUNCATED
from recflow.distribute.chunk import train_chunk
from recflow.distribute.cluster import ps_devices
from recflow.distribute.launcher import free_ports
from recflow.embedding.placement import ModPlacement
from recflow.features.keys import decode
from recflow.features.transform import transform
from recflow.models import RankingModel, build_model, register_model
from recflow.training.dense_optimizer import make_dense_optimizer

BATCH, K, STEPS, CHUNKS, FRESH = 64, 16, 3, 8, 800  # FRESH new ids a step


@register_model("ps_growth_sum_tower")
class SumTower(RankingModel):
    def tower(self, inputs, training=False):
        return tf.add_n([tf.reduce_sum(v, axis=1, keepdims=True) for v in self.pooled(inputs)])


chief, ps0, ps1, worker_port = free_ports(4)
cluster = tf.train.ClusterSpec(
    {
        "ps": [f"localhost:{ps0}", f"localhost:{ps1}"],
        "worker": [f"localhost:{worker_port}"],
        "chief": [f"localhost:{chief}"],
    }
)
servers = [
    tf.distribute.Server(cluster, job_name=j, task_index=t)
    for j, t in (("ps", 0), ("ps", 1), ("worker", 0))
]
tf.config.experimental_connect_to_cluster(cluster, job_name="chief")
devices = ps_devices(2)
config = config_from_dict(
    {
        "data": {"format": "synthetic", "label": "click", "batch_size": BATCH},
        "features": [
            {"name": "ids", "kind": "multi_hot", "dtype": "int64", "max_values": K, "table": "t"}
        ],
        "tables": {"t": {"dim": 4, "optimizer": {"type": "adagrad"}}},
        "model": {"type": "ps_growth_sum_tower"},
    }
)
rng = np.random.default_rng(0)
pool = rng.integers(-(2**63), 2**63 - 1, CHUNKS * STEPS * FRESH, np.int64, True)
chunks = []
for c in range(CHUNKS):
    steps = []
    for s in range(STEPS):
        seen = (c * STEPS + s + 1) * FRESH
        again = rng.choice(pool[:seen], BATCH * K - FRESH)
        steps.append(rng.permutation(np.concatenate([pool[seen - FRESH : seen], again])))
    ids = np.concatenate(steps).reshape(STEPS * BATCH, K)
    labels = rng.integers(0, 2, STEPS * BATCH).astype(np.float32)
    chunks.append((np.array(["|".join(map(str, r)) for r in ids.tolist()]), labels))


def transformed(features, labels):
    features = transform(config, features)
    features[NONFINITE] = features[TRUNCATED] = tf.constant(0, tf.int64)
    return features, labels, tf.constant(0, tf.int64)


def chunk_of(model, strings, labels):
    def chunk():  # the dataset is made inside: it runs on the worker
        data = tf.data.Dataset.from_tensor_slices(({"ids": strings}, {"click": labels}))
        return tuple(train_chunk(model, iter(data.batch(BATCH).map(transformed))))

    return chunk


def train(grow: bool):
    keras.utils.set_random_seed(1)
    with tf.device(devices[0]):
        model = build_model(config, ModPlacement(2, devices))
        model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
        model.build_weights()
    sizes = []  # per chunk and shard: (buckets, keys)
    for strings, labels in chunks:
        with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
            done = tf.function(chunk_of(model, strings, labels), autograph=False)()
        [t.numpy() for t in done]  # the chunk ended (the PS runner joins its wave)
        if grow:
            model.embedding.grow()
            rows = model.embedding.physical_tables[0].rows
            for i in range(2):
                keys = int(sum(t.size() for t in rows.shards[i]))
                sizes.append((rows.num_buckets(i), keys))
    keys, values = (t.numpy() for t in model.embedding.physical_tables[0].rows.export())
    slots, ids = decode(keys)
    pairs = list(zip(slots.tolist(), ids.tolist()))
    return {p: v.tobytes() for p, v in zip(pairs, values)}, len(pairs), sizes


grown, grown_held, sizes = train(grow=True)
plain, plain_held, _ = train(grow=False)
print(
    json.dumps(
        {
            "keys": len(grown),
            "held_once": grown_held == len(grown) and plain_held == len(plain),
            "same_rows": grown == plain,
            "step_keys": BATCH * K,
            "sizes": sizes,
        }
    )
)
