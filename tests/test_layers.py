"""Tests for recflow.layers; expected values come from numpy."""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import itertools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from recflow.layers import (  # noqa: E402
    DNN,
    FM,
    AttentionUnit,
    Cross,
    Dice,
    DinAttention,
    MaskedMeanPooling,
    MMoE,
)

EPS = 1e-9


def rng(seed=0):
    return np.random.default_rng(seed)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def randn(*shape, seed=0):
    return rng(seed).normal(size=shape).astype("float32")


# ---------------------------------------------------------------- FM


@pytest.mark.parametrize("fields,dim", [(2, 1), (3, 4), (7, 5)])
def test_fm_matches_formula_and_pairwise_sum(fields, dim):
    v = randn(4, fields, dim)
    out = FM()(v).numpy()
    formula = 0.5 * ((v.sum(1) ** 2) - (v**2).sum(1)).sum(-1, keepdims=True)
    pairwise = sum(
        (v[:, i] * v[:, j]).sum(-1, keepdims=True)
        for i, j in itertools.combinations(range(fields), 2)
    )
    assert out.shape == (4, 1)
    np.testing.assert_allclose(out, formula, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, pairwise, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fields,dim", [(1, 3), (3, 4), (7, 5)])
def test_fm_gradient_is_the_pairwise_sums_derivative(fields, dim, training):
    # d/dv_f of sum_{i<j} <v_i, v_j> is the sum of the other fields, times the upstream.
    v, upstream = randn(4, fields, dim), randn(4, 1, seed=1)
    x = tf.constant(v)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = FM()(x, training=training)
    grad = tape.gradient(out, x, output_gradients=tf.constant(upstream)).numpy()
    others = np.stack([v.sum(1) - v[:, f] for f in range(fields)], axis=1)
    np.testing.assert_allclose(grad, upstream[:, :, None] * others, rtol=1e-5, atol=1e-5)


def test_fm_custom_gradient_stays_out_of_inference_graphs():
    # A SavedModel holding a custom gradient warns on load that it was not saved.
    def custom_gradient_ops(training):
        fn = tf.function(lambda v: FM()(v, training=training))
        graph = fn.get_concrete_function(tf.TensorSpec([None, 3, 4])).graph
        return [op for op in graph.get_operations() if "_gradient_op_type" in op.node_def.attr]

    assert custom_gradient_ops(True) and not custom_gradient_ops(False)


def test_fm_rejects_2d_input():
    with pytest.raises(ValueError, match="3D"):
        FM()(tf.ones([2, 3]))


# ---------------------------------------------------------------- DNN


@pytest.mark.parametrize(
    "kwargs,in_shape,out_shape",
    [
        (dict(hidden_units=[8, 4]), (5, 3), (5, 4)),
        (dict(hidden_units=[8], output_units=1), (5, 3), (5, 1)),
        (dict(hidden_units=[8, 6], activation="dice", use_batch_norm=True), (5, 2, 3), (5, 2, 6)),
        (dict(hidden_units=[], output_units=2), (5, 3), (5, 2)),
        (dict(hidden_units=[], dropout=0.5), (5, 3), (5, 3)),
    ],
)
def test_dnn_output_shape(kwargs, in_shape, out_shape):
    assert DNN(**kwargs)(tf.ones(in_shape), training=True).shape == out_shape


def test_dnn_matches_numpy_relu_mlp():
    x = randn(4, 3)
    layer = DNN([5, 2], output_units=1)
    out = layer(x).numpy()
    w0, b0, w1, b1, w2, b2 = layer.get_weights()
    h = np.maximum(x @ w0 + b0, 0)
    h = np.maximum(h @ w1 + b1, 0)
    np.testing.assert_allclose(out, h @ w2 + b2, rtol=1e-5, atol=1e-6)


def test_dnn_dropout_only_in_training():
    x = np.abs(randn(16, 8)) + 0.1
    layer = DNN([64], dropout=0.5)
    inference = layer(x, training=False).numpy()
    np.testing.assert_array_equal(layer(x).numpy(), inference)
    train = layer(x, training=True).numpy()
    # Inverted dropout at rate 0.5: each unit is dropped (0) or scaled by 2.
    kept = train != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(train[kept], 2 * inference[kept], rtol=1e-5)


def test_dnn_l2_adds_kernel_losses():
    layer = DNN([4], l2=0.1, output_units=1)
    layer(tf.ones([2, 3]))
    kernels = [w.numpy() for w in layer.weights if "kernel" in w.name]
    expected = sum(0.1 * (k**2).sum() for k in kernels)
    np.testing.assert_allclose(float(tf.add_n(layer.losses)), expected, rtol=1e-5)


@pytest.mark.parametrize(
    "bad,name",
    [
        (dict(hidden_units=[8, -3]), "hidden_units"),
        (dict(hidden_units=8), "hidden_units"),
        (dict(hidden_units=[8, 2.5]), "hidden_units"),
        (dict(activation="nope"), "activation"),
        (dict(activation=3), "activation"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(use_batch_norm="yes"), "use_batch_norm"),
        (dict(l2=-1.0), "l2"),
        (dict(output_units=0), "output_units"),
        (dict(output_units=True), "output_units"),
    ],
)
def test_dnn_rejects_bad_arguments(bad, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        DNN(**{"hidden_units": [8], **bad})
    config = {**DNN([8]).get_config(), **bad}
    # Keras' `from_config` re-raises constructor errors as TypeError, message kept.
    with pytest.raises(TypeError, match=f"Received: {name}="):
        DNN.from_config(config)


# ---------------------------------------------------------------- Dice


def dice_reference(x, alpha, mean, var):
    p = sigmoid((x - mean) / np.sqrt(var + EPS))
    return p * x + (1 - p) * alpha * x


@pytest.mark.parametrize("shape", [(6, 4), (3, 5, 4)])
def test_dice_inference_uses_moving_stats(shape):
    x = randn(*shape)
    layer = Dice()
    np.testing.assert_allclose(
        layer(x, training=False).numpy(), sigmoid(x / np.sqrt(1 + EPS)) * x, rtol=1e-5, atol=1e-6
    )
    alpha = np.array([0.0, 0.25, -0.5, 1.0], "float32")
    layer.alpha.assign(alpha)
    np.testing.assert_allclose(
        layer(x, training=False).numpy(), dice_reference(x, alpha, 0.0, 1.0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("shape", [(6, 4), (3, 5, 4)])
def test_dice_training_uses_batch_stats(shape):
    x = randn(*shape, seed=1) * 3 + 1
    layer = Dice()
    layer.build(shape)
    np.testing.assert_array_equal(layer.alpha.numpy(), np.zeros(4))
    axes = tuple(range(len(shape) - 1))
    expected = dice_reference(x, 0.0, x.mean(axes), x.var(axes))
    np.testing.assert_allclose(layer(x, training=True).numpy(), expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- attention


def attention_inputs(seed=0, batch=3, steps=5, dim=4):
    q, k = randn(batch, dim, seed=seed), randn(batch, steps, dim, seed=seed + 1)
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)[:batch, :steps]
    return q, k, mask


def test_attention_matches_numpy_din_unit():
    q, k, mask = attention_inputs()
    layer = DinAttention(hidden_units=[6, 3])
    out, weights = layer(q, k, mask=mask, return_attention_scores=True)
    w0, b0, w1, b1, w2, b2 = layer.get_weights()
    qs = np.broadcast_to(q[:, None, :], k.shape)
    h = np.concatenate([qs, k, qs - k, qs * k], axis=-1)
    h = sigmoid(sigmoid(h @ w0 + b0) @ w1 + b1)
    scores = np.where(mask, (h @ w2 + b2)[..., 0], 0.0)
    np.testing.assert_allclose(weights.numpy(), scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        out.numpy(), np.einsum("bt,btd->bd", scores, k), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("activation", ["sigmoid", "dice"])
def test_attention_ignores_masked_keys(softmax, activation):
    q, k, mask = attention_inputs()
    layer = DinAttention(hidden_units=[8, 4], activation=activation, softmax=softmax)
    other = np.where(mask[..., None], k, 100 * randn(*k.shape, seed=7))
    np.testing.assert_allclose(
        layer(q, k, mask=mask).numpy(), layer(q, other, mask=mask).numpy(), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("softmax", [False, True])
def test_attention_all_masked_rows_give_zeros(softmax):
    q, k, _ = attention_inputs()
    mask = np.zeros(k.shape[:2], bool)
    mask[2] = True
    layer = DinAttention(hidden_units=[8], softmax=softmax)
    q, k = tf.constant(q), tf.constant(k)
    with tf.GradientTape() as tape:
        tape.watch(k)
        out = layer(q, k, mask=mask)
    np.testing.assert_array_equal(out.numpy()[:2], 0.0)
    assert np.isfinite(out.numpy()).all()
    assert np.isfinite(tape.gradient(out, k).numpy()).all()


def test_attention_softmax_weights_sum_to_one_over_valid_steps():
    q, k, mask = attention_inputs()
    _, weights = DinAttention(softmax=True)(q, k, mask=mask, return_attention_scores=True)
    weights = weights.numpy()
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(weights[~mask], 0.0)
    assert (weights[mask] > 0).all()


def test_attention_without_mask_uses_all_steps():
    q, k, _ = attention_inputs()
    layer = DinAttention(hidden_units=[4])
    full = np.ones(k.shape[:2], bool)
    np.testing.assert_allclose(layer(q, k).numpy(), layer(q, k, mask=full).numpy())


def test_attention_in_functional_model_with_embedding_mask():
    ids = keras.Input((4,), dtype="int64")
    cand = keras.Input((), dtype="int64")
    emb = keras.layers.Embedding(10, 8, mask_zero=True)
    seq = emb(ids)
    att = DinAttention(hidden_units=[8])(emb(cand), seq, mask=tf.not_equal(ids, 0))
    model = keras.Model([ids, cand], [att, MaskedMeanPooling()(seq)])
    outs = model([np.array([[1, 2, 0, 0], [0, 0, 0, 0]]), np.array([3, 4])])
    assert [o.shape for o in outs] == [(2, 8), (2, 8)]
    np.testing.assert_array_equal(outs[0].numpy()[1], 0.0)
    np.testing.assert_array_equal(outs[1].numpy()[1], 0.0)
    table = emb.get_weights()[0]
    np.testing.assert_allclose(outs[1].numpy()[0], table[[1, 2]].mean(0), rtol=1e-6)


def test_attention_unit_is_din_attention():
    assert AttentionUnit is DinAttention


# ---------------------------------------------------------------- pooling


def test_masked_mean_pooling_matches_numpy():
    values = randn(4, 5, 3)
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 0, 1]], bool)
    out = MaskedMeanPooling()(values, mask=mask).numpy()
    expected = np.stack(
        [values[b][mask[b]].mean(0) if mask[b].any() else np.zeros(3) for b in range(4)]
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(MaskedMeanPooling()(values).numpy(), values.mean(1), rtol=1e-5)


# ---------------------------------------------------------------- MMoE


def test_mmoe_shapes_gates_and_mixture():
    x = randn(6, 10)
    layer = MMoE(num_experts=3, expert_units=[8, 4], num_tasks=2)
    outs = layer(x)
    assert len(outs) == 2 and all(o.shape == (6, 4) for o in outs)
    experts = np.stack([e(x).numpy() for e in layer.experts], axis=1)  # [B, E, U]
    for gate, out in zip(layer.gates, outs):
        g = gate(x).numpy()
        assert g.shape == (6, 3)
        np.testing.assert_allclose(g.sum(-1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(
            out.numpy(), np.einsum("be,beu->bu", g, experts), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "bad,name",
    [
        (dict(num_experts=0), "num_experts"),
        (dict(expert_units=[]), "expert_units"),
        (dict(num_tasks=-1), "num_tasks"),
        (dict(expert_activation="nope"), "expert_activation"),
        (dict(dropout=2.0), "dropout"),
        (dict(l2=-0.5), "l2"),
    ],
)
def test_mmoe_rejects_bad_arguments(bad, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        MMoE(**{"num_experts": 2, "expert_units": [4], "num_tasks": 2, **bad})


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="`epsilon` must be a positive float"):
        Dice(epsilon=0)
    with pytest.raises(ValueError, match="`softmax` must be a bool"):
        DinAttention(softmax="yes")
    with pytest.raises(ValueError, match="Received: hidden_units="):
        DinAttention(hidden_units=[0])


# ---------------------------------------------------------------- serialization

ROUND_TRIP = {
    "FM": (lambda: FM(), lambda: [randn(3, 4, 5)]),
    "DNN": (
        lambda: DNN([6, 4], "dice", 0.2, True, 0.01, 2),
        lambda: [randn(3, 5)],
    ),
    "Dice": (lambda: Dice(epsilon=1e-6), lambda: [randn(3, 2, 5)]),
    "DinAttention": (
        lambda: DinAttention([6], activation="dice", softmax=True),
        lambda: list(attention_inputs()),
    ),
    "MaskedMeanPooling": (lambda: MaskedMeanPooling(), lambda: list(attention_inputs()[1:])),
    "MMoE": (lambda: MMoE(3, [6, 4], 2, expert_activation="dice"), lambda: [randn(3, 5)]),
    "Cross": (lambda: Cross(projection_dim=2), lambda: [randn(3, 5)]),
}


def call(layer, args):
    return tf.nest.flatten(layer(*args, training=False))


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_get_config_from_config_round_trip(name):
    make, inputs = ROUND_TRIP[name]
    layer, args = make(), inputs()
    call(layer, args)  # builds the weights
    # Perturb every weight (alpha, moving stats, ...) so all of them matter.
    layer.set_weights([w + 0.1 * randn(*w.shape, seed=3) for w in layer.get_weights()])
    expected = call(layer, args)

    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    call(clone, args)
    clone.set_weights(layer.get_weights())
    for a, b in zip(call(clone, args), expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)

    restored = keras.layers.deserialize(keras.layers.serialize(layer))
    assert type(restored) is type(layer) and restored.get_config() == config


@pytest.mark.parametrize("name", ["FM", "DNN", "Dice", "DinAttention", "MaskedMeanPooling", "MMoE"])
def test_layers_are_registered_under_recflow(name):
    cls = keras.saving.get_registered_object(f"recflow>{name}")
    assert cls is not None and cls.__name__ == name
    assert keras.saving.get_registered_name(cls) == f"recflow>{name}"
