"""Traces a parameter-server worker's step against a real in-process PS server and
prints, as JSON, what the step sends to the PS (tests/test_ps_step_graph.py reads it).

Run from the repository root, in its own process: connecting to a cluster changes the
process's device names.
"""

import json

# isort: off
import recflow  # noqa: F401  (selects Keras 2 before TensorFlow loads)
import tensorflow as tf
# isort: on

from recflow.config import load_config
from recflow.data import make_dataset
from recflow.data.records import NONFINITE, TRUNCATED
from recflow.distribute.chunk import Prefetch, train_chunk
from recflow.distribute.cluster import ps_devices
from recflow.distribute.launcher import free_ports
from recflow.embedding.placement import ModPlacement
from recflow.features.transform import transform
from recflow.models import build_model
from recflow.training.dense_optimizer import make_dense_optimizer

chief, ps_port = free_ports(2)
cluster = tf.train.ClusterSpec({"ps": [f"localhost:{ps_port}"], "chief": [f"localhost:{chief}"]})
server = tf.distribute.Server(cluster, job_name="ps", task_index=0)
tf.config.experimental_connect_to_cluster(cluster, job_name="chief")
(ps,) = ps_devices(1)
config = load_config(
    "configs/deepfm_demo.yaml",
    [
        "data.batch_size=16",
        "model.params={dnn: {hidden_units: [8, 4]}}",
    ],
)
features, labels, bad = next(iter(make_dataset(config, "train", epochs=1).take(1)))
batch = (transform(config, features), labels, bad)
with tf.device(ps):  # every variable (weights, optimizer slots) on the PS
    model = build_model(config, ModPlacement(1, [ps]))
    model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
    model.train_step(batch)
step = tf.function(lambda b: model.train_on_rows(b, in_loop=True)[0], autograph=False)
graph = step.get_concrete_function(batch).graph
# Where TF places an op: its requested device, else (a resource op) its resource's device.
handles = {internal.op.name: external.device for external, internal in graph.captures}


def device(op):
    if op.device:
        return op.device
    if op.type == "Placeholder":
        return handles.get(op.name, "")
    resources = [t.op for t in op.inputs if t.dtype == tf.resource]
    return device(resources[0]) if resources else ""


def remote(op):
    return "/job:ps" in device(op)


update = [op for op in graph.get_operations() if "dense_update" in op.name]
crossing = sorted(
    {
        t.op.type
        for op in update
        if remote(op)
        for t in op.inputs
        if not remote(t.op) and t.dtype != tf.resource
    }
)
# Prefetching: what the chunk's loop carries and what a step returns.
engine = model.embedding
engine.make_staging(2)
features = dict(batch[0])
features[NONFINITE] = features[TRUNCATED] = tf.constant(0, tf.int64)
ds = tf.data.Dataset.from_tensors((features, batch[1], batch[2])).repeat(3)
chunk = tf.function(
    lambda it, slot: tuple(train_chunk(model, it, prefetch=True, slot=slot)), autograph=False
)
chunk_graph = chunk.get_concrete_function(iter(ds), tf.constant(1, tf.int64)).graph
loops = [op for op in chunk_graph.get_operations() if op.type in ("While", "StatelessWhile")]
keys = engine.batch_keys(model.split_features(batch[0])[0])
slot = tf.constant(1, tf.int64)
ahead = Prefetch(slot, keys, keys, engine.stage(slot, engine.lookup(keys)))
prefetch_step = tf.function(lambda b, a: model.train_on_rows(b, a, in_loop=True), autograph=False)
step_outputs = prefetch_step.get_concrete_function(batch, ahead).outputs
print(
    json.dumps(
        {
            "loop_carried": sorted(
                {(t.dtype.name, t.shape.rank) for op in loops for t in op.inputs}, key=str
            ),
            "step_outputs": [(t.dtype.name, t.shape.rank) for t in step_outputs],
            "variables": len(model.trainable_variables),
            "remote_variables": sum("/job:ps" in v.device for v in model.trainable_variables),
            "update_ops": len(update),
            "local_ops": sorted({op.type for op in update if not remote(op)}),
            "crossing": crossing,
            "crossing_count": len(
                {
                    t.name
                    for op in update
                    if remote(op)
                    for t in op.inputs
                    if not remote(t.op) and t.dtype != tf.resource
                }
            ),
        }
    )
)
