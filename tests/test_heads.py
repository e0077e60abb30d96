"""Task heads as classes: losses and activations against numpy, metrics, outputs."""

import numpy as np
import pytest

import recflow  # noqa: F401  (Keras 2)
from recflow.config import load_config
from recflow.errors import ConfigError
from recflow.models import linear_key, mask_key
from recflow.models.heads import BinaryHead, RegressionHead, RetrievalHead, heads_for

LABELS = np.array([1.0, 0.0, 1.0, 0.0, 0.0], np.float32)
LOGITS = np.array([[2.0], [-1.0], [-0.5], [0.0], [3.0]], np.float32)


def test_binary_head_is_sigmoid_cross_entropy():
    import tensorflow as tf

    head = BinaryHead("probability", "click")
    p = 1.0 / (1.0 + np.exp(-LOGITS[:, 0].astype(np.float64)))
    expected = -np.mean(LABELS * np.log(p) + (1 - LABELS) * np.log(1 - p))
    assert float(head.loss(tf.constant(LABELS), tf.constant(LOGITS))) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(head.activate(tf.constant(LOGITS)).numpy(), p[:, None], rtol=1e-6)
    assert head.export_output(tf.constant(LOGITS[:, 0])).shape == (5, 1)


def test_regression_head_is_mean_squared_error_on_the_logit():
    import tensorflow as tf

    head = RegressionHead("prediction", "rating")
    expected = np.mean((LOGITS[:, 0] - LABELS) ** 2)
    assert float(head.loss(tf.constant(LABELS), tf.constant(LOGITS))) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_array_equal(head.activate(tf.constant(LOGITS)).numpy(), LOGITS)


def test_retrieval_head_takes_both_towers_and_exports_no_single_output():
    import tensorflow as tf

    head = RetrievalHead("embeddings", "click", temperature=0.5)
    q = np.eye(3, dtype=np.float32)
    outputs = {"query": tf.constant(q), "candidate": tf.constant(q)}
    assert head.logits_of(outputs) is outputs
    # Identity embeddings, 3 positive rows, temperature 0.5: each row's softmax over
    # scores [2, 0, 0] (logQ: every candidate is 1/3 of the batch, the same shift for all).
    expected = -np.log(np.exp(2.0) / (np.exp(2.0) + 2.0))
    loss = head.loss(tf.constant([1.0, 1.0, 1.0]), outputs)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(NotImplementedError):
        head.export_output(outputs)


def test_heads_for_config_and_metrics():
    base = "configs/deepfm_demo.yaml"
    binary = heads_for(load_config(base))
    assert [type(h) for h in binary] == [BinaryHead] and binary[0].output == "probability"
    config = load_config(base, ["task.type=regression", "task.metrics=[rmse, mae]"])
    (head,) = heads_for(config)
    assert isinstance(head, RegressionHead) and head.output == "prediction"
    assert head.metric_names(config.task) == ("rmse", "mae")
    config = load_config(base, ["task.metrics=[auc]"])
    assert heads_for(config)[0].metric_names(config.task) == ("auc",)
    assert heads_for(load_config(base))[0].metric_names(load_config(base).task) == ("auc", "logloss")


def test_heads_check_task_type_and_metrics():
    base = "configs/deepfm_demo.yaml"
    with pytest.raises(ConfigError, match=r"^task\.metrics\[1\]: expected one of \['accuracy', 'auc', 'gauc', 'logloss'\], got 'mse'$"):
        heads_for(load_config(base, ["task.metrics=[auc, mse]"]))
    with pytest.raises(ConfigError, match=r"^task\.type: no head 'ranking' \(registered: binary, regression, retrieval"):
        heads_for(load_config(base, ["task.type=ranking"]))
    with pytest.raises(ConfigError, match=r"^task\.type: module 'recflow' has no class 'Nope'$"):
        heads_for(load_config(base, ["task.type=recflow:Nope"]))


def test_tower_input_keys():
    assert mask_key("hist") == "hist/mask" and linear_key("user") == "user/linear"
