"""A DNN computing in bfloat16 (`dtype: mixed_bfloat16`): float32 weights and output,
bfloat16 matmuls, close to the float32 values; a model with one trains from its YAML,
and its export serves in plain TensorFlow what the model computes."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import DEMO, items, small
from test_end_to_end import SERVE_WITHOUT_RECFLOW, feed, raw_rows

import recflow.api
from recflow.config import load_config
from recflow.errors import RecflowError
from recflow.layers import DNN
from recflow.training.trainer import Trainer


def numpy_forward(dnn, x):
    """The DNN's forward pass in float64 numpy from its weights (ReLU hidden layers)."""
    h = x.astype(np.float64)
    for dense in dnn.dense_layers:
        kernel, bias = (v.numpy().astype(np.float64) for v in dense.weights)
        h = np.maximum(h @ kernel + bias, 0.0)
    if dnn.output_layer is not None:
        kernel, bias = (v.numpy().astype(np.float64) for v in dnn.output_layer.weights)
        h = h @ kernel + bias
    return h


@pytest.mark.parametrize("output_units", [1, None])
def test_a_bfloat16_dnn_keeps_float32_weights_and_output_and_matches_float32_values(output_units):
    x = np.random.default_rng(0).normal(size=(64, 20)).astype(np.float32)
    dnn = DNN([32, 16], output_units=output_units, dtype="mixed_bfloat16")
    out = dnn(tf.constant(x))
    assert out.dtype == tf.float32
    assert all(v.dtype == tf.float32 for v in dnn.weights)
    assert [d.compute_dtype for d in dnn.dense_layers] == ["bfloat16", "bfloat16"]
    want = numpy_forward(dnn, x)
    # bfloat16 keeps 8 bits of mantissa: each matmul's inputs are rounded to ~0.4%.
    np.testing.assert_allclose(out.numpy(), want, rtol=0.05, atol=0.05 * np.abs(want).max())
    assert not np.allclose(out.numpy(), want, rtol=1e-6, atol=1e-6)  # it did round

    # The traced step's matmuls run in bfloat16; the gradients reach the float32 weights.
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dnn(x, training=True))
        return tape.gradient(loss, dnn.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec([None, 20], tf.float32)).graph
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    assert matmuls and any(op.get_attr("T") == tf.bfloat16 for op in matmuls)
    grads = step(tf.constant(x))
    assert all(g.dtype == tf.float32 and np.all(np.isfinite(g.numpy())) for g in grads)
    assert all(np.any(g.numpy() != 0) for g in grads)


def test_a_bfloat16_dnn_with_dice_batch_norm_and_dropout_trains_and_round_trips():
    x = tf.constant(np.random.default_rng(2).normal(size=(32, 10)).astype(np.float32))
    dnn = DNN([16, 8], activation="dice", use_batch_norm=True, dropout=0.1, output_units=1, dtype="mixed_bfloat16")
    with tf.GradientTape() as tape:
        out = dnn(x, training=True)
        loss = tf.reduce_mean(tf.square(out))
    grads = tape.gradient(loss, dnn.trainable_variables)
    assert out.dtype == tf.float32 and all(v.dtype == tf.float32 for v in dnn.weights)
    assert all(g is not None and np.all(np.isfinite(g.numpy())) for g in grads)
    assert {layer.compute_dtype for layer in dnn.norm_layers + dnn.activation_layers} == {"bfloat16"}
    again = DNN.from_config(dnn.get_config())
    assert again.dtype_policy.name == "mixed_bfloat16"
    assert [d.compute_dtype for d in again.dense_layers] == ["bfloat16", "bfloat16"]


def test_a_float32_dnn_is_unchanged_and_other_dtypes_are_refused():
    x = np.random.default_rng(1).normal(size=(16, 12)).astype(np.float32)
    dnn = DNN([8], output_units=1)
    assert [d.compute_dtype for d in dnn.dense_layers] == ["float32"]
    np.testing.assert_allclose(dnn(tf.constant(x)).numpy(), numpy_forward(dnn, x), rtol=1e-5, atol=1e-6)
    for dtype in ("mixed_float16", "float16", "bfloat16"):
        with pytest.raises(ValueError, match="`dtype` must be one of float32, mixed_bfloat16"):
            DNN([8], dtype=dtype)


def test_deepfm_trains_with_a_bfloat16_dnn_and_its_export_serves_without_recflow(tmp_path):
    model_dir = tmp_path / "bf16"
    overrides = small(
        {"model.params": {"dnn": {"hidden_units": [16, 8], "dtype": "mixed_bfloat16"}}},
        export=True, evaluate=True,
    )  # fmt: skip
    metrics = recflow.api.train(DEMO, model_dir=str(model_dir), overrides=overrides)
    assert metrics["steps"] == 8 and np.isfinite(metrics["logloss"])
    trainer = Trainer(load_config(DEMO, items(overrides)), model_dir=str(model_dir), verbose=0)
    assert trainer.model_dir.restore() == 8
    assert trainer.model.dnn.dense_layers[0].compute_dtype == "bfloat16"

    _, raw = raw_rows()
    np.savez(tmp_path / "inputs.npz", **raw)
    subprocess.run(
        [sys.executable, str(SERVE_WITHOUT_RECFLOW), metrics["export"], str(tmp_path / "inputs.npz"), str(tmp_path / "out.npy")],
        check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), cwd=tmp_path,
    )  # fmt: skip
    served = np.load(tmp_path / "out.npy").reshape(-1)
    in_process = trainer.model.predict_raw(feed(raw))["probability"].numpy().reshape(-1)
    # bfloat16 rounds each activation to ~0.4%, and the export's graph (a fused matmul,
    # bias and ReLU) rounds at other points than the eager pass: ~0.2% apart here.
    np.testing.assert_allclose(served, in_process, rtol=1e-2, atol=1e-3)
    assert np.std(served) > 0.01  # scores of the rows, not a constant


def test_a_model_dir_resumes_in_the_other_dtype_and_other_params_still_count(tmp_path):
    """Its weights are float32 either way: the dtype is no part of the model's identity."""
    model_dir = str(tmp_path / "run")
    dnn = {"hidden_units": [16, 8]}
    first = recflow.api.train(DEMO, model_dir=model_dir, overrides=small({"model.params": {"dnn": dnn}}))
    assert first["steps"] == 8
    bf16 = {"model.params": {"dnn": {**dnn, "dtype": "mixed_bfloat16"}}, "train.epochs": 2}
    assert recflow.api.train(DEMO, model_dir=model_dir, overrides=small(bf16))["steps"] == 16
    back = {"model.params": {"dnn": {**dnn, "dtype": "float32"}}, "train.epochs": 3}
    assert recflow.api.train(DEMO, model_dir=model_dir, overrides=small(back))["steps"] == 24
    wider = {"model.params": {"dnn": {"hidden_units": [32, 8], "dtype": "mixed_bfloat16"}}, "train.epochs": 4}
    with pytest.raises(RecflowError, match="model.params.dnn.hidden_units"):
        recflow.api.train(DEMO, model_dir=model_dir, overrides=small(wider))
