"""What a parameter-server worker's step sends to the PS: the dense optimizer runs on the
PS, so only the dense gradients cross, packed into one tensor; with prefetching, the
next batch's rows stay on the PS (staged there), so no packed rows cross in a loop
variable or a step's result.

The step is traced in a separate process connected to a real in-process PS server
(connecting changes the process's device names, which the other test modules share).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os
    import recflow  # selects Keras 2
    import tensorflow as tf
    import tf_keras as keras
    from recflow.config import load_config
    from recflow.data import make_dataset
    from recflow.distribute.cluster import ps_devices
    from recflow.distribute.launcher import free_ports
    from recflow.embedding.placement import ModPlacement
    from recflow.features.transform import transform
    from recflow.models import build_model
    from recflow.distribute.chunk import Prefetch, train_chunk
    from recflow.training.dense_optimizer import make_dense_optimizer
    from recflow.data.records import NONFINITE, TRUNCATED

    chief, ps_port = free_ports(2)
    cluster = tf.train.ClusterSpec({"ps": [f"localhost:{ps_port}"], "chief": [f"localhost:{chief}"]})
    server = tf.distribute.Server(cluster, job_name="ps", task_index=0)
    tf.config.experimental_connect_to_cluster(cluster, job_name="chief")
    (ps,) = ps_devices(1)
    config = load_config("configs/deepfm_demo.yaml", [
        "data.batch_size=16", "model.params={dnn: {hidden_units: [8, 4]}}",
    ])
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
    remote = lambda op: "/job:ps" in device(op)
    update = [op for op in graph.get_operations() if "dense_update" in op.name]
    crossing = sorted({
        t.op.type for op in update if remote(op) for t in op.inputs
        if not remote(t.op) and t.dtype != tf.resource
    })
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
    print(json.dumps({
        "loop_carried": sorted({(t.dtype.name, t.shape.rank) for op in loops for t in op.inputs}, key=str),
        "step_outputs": [(t.dtype.name, t.shape.rank) for t in step_outputs],
        "variables": len(model.trainable_variables),
        "remote_variables": sum("/job:ps" in v.device for v in model.trainable_variables),
        "update_ops": len(update),
        "local_ops": sorted({op.type for op in update if not remote(op)}),
        "crossing": crossing,
        "crossing_count": len({
            t.name for op in update if remote(op) for t in op.inputs
            if not remote(t.op) and t.dtype != tf.resource
        }),
    }))
    """
)


RUN_ON_A_WORKER = textwrap.dedent(
    """
    import json
    import numpy as np
    import recflow  # selects Keras 2
    import tensorflow as tf
    import tf_keras as keras
    from recflow.config import load_config
    from recflow.data import make_dataset
    from recflow.data.records import NONFINITE, TRUNCATED
    from recflow.distribute.cluster import ps_devices
    from recflow.distribute.launcher import free_ports
    from recflow.embedding.placement import ModPlacement
    from recflow.features.transform import transform
    from recflow.models import build_model
    from recflow.distribute.chunk import train_chunk
    from recflow.training.dense_optimizer import make_dense_optimizer

    chief, ps_port, worker_port = free_ports(3)
    cluster = tf.train.ClusterSpec({
        "ps": [f"localhost:{ps_port}"], "worker": [f"localhost:{worker_port}"],
        "chief": [f"localhost:{chief}"],
    })
    servers = [tf.distribute.Server(cluster, job_name=j, task_index=0) for j in ("ps", "worker")]
    tf.config.experimental_connect_to_cluster(cluster, job_name="chief")
    (ps,) = ps_devices(1)
    config = load_config("configs/deepfm_demo.yaml", [
        "data.batch_size=32", "data.shuffle=false", "model.params={dnn: {hidden_units: [8]}}",
    ])

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
        chunk = tf.function(lambda slot: tuple(train_chunk(
            model, iter(make_dataset(config, "train", epochs=1).take(4).map(transformed)),
            prefetch=prefetch, slot=slot,
        )), autograph=False)
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
    print(json.dumps({"steps": [steps, plain_steps], "keys": sum(len(r.ids) for r in rows.values()),
                      "max_diff": diff}))
    """
)


def _run(script):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report():
    return _run(SCRIPT)


def test_dense_update_runs_on_the_ps_and_receives_one_packed_gradient(report):
    # The demo DeepFM has several dense variables, all on the PS.
    assert report["variables"] > 2 and report["remote_variables"] == report["variables"]
    assert report["update_ops"] > 0
    # On the worker only the packing: the gradients flattened and concatenated.
    assert set(report["local_ops"]) <= {"Reshape", "ConcatV2", "Const"}, report
    # Into the PS: one tensor, the packed gradients (not one per variable, nor slot reads).
    assert report["crossing"] == ["ConcatV2"] and report["crossing_count"] == 1, report


def test_prefetched_rows_stay_on_the_ps(report):
    """A tensor leaving a loop, a branch or a call goes through the worker: the loop may
    carry the batches' keys (int64 [U, 2], the worker's) but no packed rows (float32
    [U, width]), and a prefetching step returns only scalars (its loss and the staging
    token), not what it wrote."""
    carried = [tuple(x) for x in report["loop_carried"]]
    assert ("int64", 2) in carried  # the next batch's keys: the loop is the prefetching one
    assert ("float32", 2) not in carried, carried
    assert [rank for _, rank in report["step_outputs"]] == [0, 0], report["step_outputs"]


def test_a_remote_worker_prefetching_into_its_slot_trains_as_without_prefetch():
    """The chunk on a remote worker, its rows staged in slot 1 of 2 on the PS (the picked
    variable handle, the bit-cast matrix): the same rows, slots and weights as without
    prefetching, to float rounding."""
    result = _run(RUN_ON_A_WORKER)
    assert result["steps"] == [4, 4] and result["keys"] > 0
    assert result["max_diff"] < 1e-5, result
