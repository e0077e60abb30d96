"""Extension points used from a module outside recflow (tests/extensions/my_extensions.py):
a task head, a sparse optimizer and a feature kind named `my_extensions:ClassName` in the YAML, trained,
evaluated and exported through the CLI; dense optimizers by Keras name with their kwargs;
the docs show the extension code verbatim."""

import json
import re
import types
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
import yaml

from recflow.cli import main
from recflow.config import config_from_dict, load_config
from recflow.config.convert import to_dict
from recflow.errors import ConfigError
from recflow.features.keys import encode
from recflow.features.transform import sparse_ids as transform_one
from recflow.features.transform import transform
from recflow.models import RankingModel, build_model, register_model
from recflow.models.base import RankingModel as Base
from recflow.training.dense_optimizer import make_dense_optimizer

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = Path(__file__).resolve().parent / "extensions"


@pytest.fixture
def extensions(monkeypatch):
    """`my_extensions` importable, as a user's module on the Python path is."""
    monkeypatch.syspath_prepend(str(EXTENSIONS))
    import my_extensions

    return my_extensions


# ----------------------------------------------------------------------------- the CLI run


def write_counts(path: Path, rows: int, seed: int):
    """A CSV of (user, item, price, count) rows; counts drawn from Poisson(rate of the
    user and the price)."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 20, rows)
    items = rng.integers(0, 30, rows)
    prices = np.round(rng.uniform(0.0, 6.0, rows), 2)
    counts = rng.poisson(0.3 + 0.1 * (users % 5) + 0.2 * (prices > 4.0))
    lines = ["user,item,price,count"] + [
        f"{u},i{i},{p},{c}" for u, i, p, c in zip(users, items, prices, counts)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return users, items, prices, counts


def extension_config(tmp_path: Path) -> str:
    config = {
        "data": {
            "format": "csv",
            "train": str(tmp_path / "train.csv"),
            "eval": str(tmp_path / "eval.csv"),
            "label": "count",
            "batch_size": 64,
            "shuffle": False,
        },
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64"},
            {"name": "item", "kind": "categorical", "dtype": "string"},
            {"name": "price", "kind": "my_extensions:Bucketized", "boundaries": [1.0, 2.0, 4.0]},
        ],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [8]}}},
        "task": {"type": "my_extensions:PoissonHead", "metrics": ["poisson_nll", "mae"]},
        "train": {
            "model_dir": str(tmp_path / "run"),
            "epochs": 2,
            "optimizer": {"type": "adamw", "learning_rate": 0.01, "weight_decay": 0.01},
            "sparse_optimizer": {
                "type": "my_extensions:MomentumSGD",
                "learning_rate": 0.05,
                "momentum": 0.5,
            },
        },
    }
    path = tmp_path / "extensions.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def newest_export(model_dir: Path) -> Path:
    return max((model_dir / "export").iterdir(), key=lambda p: int(p.name))


def test_head_optimizer_and_feature_kind_of_a_user_module_train_evaluate_and_export(
    tmp_path, extensions, capsys
):
    write_counts(tmp_path / "train.csv", 400, seed=1)
    users, items, prices, counts = write_counts(tmp_path / "eval.csv", 120, seed=2)
    config = extension_config(tmp_path)
    run = tmp_path / "run"

    assert main(["train", config, "--quiet"]) == 0
    trained = json.loads((run / "metrics.json").read_text())
    assert main(["evaluate", config]) == 0
    evaluated = json.loads((run / "metrics.json").read_text())
    assert main(["export", config]) == 0
    export = newest_export(run)

    # The export serves the head's activation under its output name; the evaluated
    # metrics are the head's own functions of those rates and the labels.
    serve = tf.saved_model.load(str(export)).signatures["serving_default"]
    out = serve(
        user=tf.constant(users, tf.int64),
        item=tf.constant([f"i{i}" for i in items]),
        price=tf.constant(prices, tf.float32),
    )
    assert list(out) == ["rate"]
    rates = out["rate"].numpy().reshape(-1).astype(np.float64)
    assert (rates > 0).all()
    nll = np.mean(rates - counts * np.log(rates))
    mae = np.mean(np.abs(rates - counts))
    for metrics in (trained, evaluated):
        assert metrics["eval_examples"] == 120
        assert metrics["poisson_nll"] == pytest.approx(nll, rel=1e-4, abs=1e-5)
        assert metrics["mae"] == pytest.approx(mae, rel=1e-4, abs=1e-5)
    # Training lowered the loss below a constant rate at the training data's mean.
    constant = counts.mean()
    assert nll < constant - counts.mean() * np.log(constant) + 0.05

    # The model's identity records the head and the optimizers: a resume with another
    # sparse optimizer is refused before anything is trained.
    # The feature kind: one bucket, one row; the export reads the raw float price.
    same = serve(
        user=tf.constant([3, 3, 3, 3], tf.int64),
        item=tf.constant(["i1"] * 4),
        price=tf.constant([1.0, 1.99, 4.5, 0.5], tf.float32),
    )["rate"].numpy().reshape(-1)
    assert same[0] == same[1] and same[0] != same[2] and same[0] != same[3]

    structure = json.loads((export / "assets.extra" / "structure.json").read_text())
    assert structure["task"]["type"] == "my_extensions:PoissonHead"
    assert structure["features"]["price"] == {
        "kind": "my_extensions:Bucketized", "dtype": "string", "table": "price",
        "boundaries": [1.0, 2.0, 4.0],
    }
    assert {t["optimizer"] for t in structure["tables"].values()} == {"my_extensions:MomentumSGD"}
    assert structure["dense_optimizer"] == "adamw"
    capsys.readouterr()
    assert main(["train", config, "--quiet", "--set", "train.sparse_optimizer={type: sgd}"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("recflow: ") and "tables.item.optimizer: my_extensions:MomentumSGD in" in line


def test_the_resolved_config_names_the_extensions_and_reloads(tmp_path, extensions):
    write_counts(tmp_path / "train.csv", 10, seed=1)
    config = load_config(extension_config(tmp_path))
    price = config.feature("price")
    assert isinstance(price, extensions.BucketizedFeature) and price.boundaries == (1.0, 2.0, 4.0)
    opt = config.train.sparse_optimizer
    assert isinstance(opt, extensions.MomentumConfig) and opt.momentum == 0.5
    raw = to_dict(config)
    assert raw["train"]["optimizer"] == {"type": "adamw", "learning_rate": 0.01, "weight_decay": 0.01}
    assert config_from_dict(raw) == config


def test_an_extension_config_is_checked_with_its_path(tmp_path, extensions):
    write_counts(tmp_path / "train.csv", 10, seed=1)
    path = extension_config(tmp_path)
    with pytest.raises(ConfigError, match=r"train\.sparse_optimizer\.momentum: expected a number in \[0, 1\), got 1\.5"):
        load_config(path, ["train.sparse_optimizer.momentum=1.5"])
    with pytest.raises(ConfigError, match=r"train\.sparse_optimizer: unknown key 'beta'"):
        load_config(path, ["train.sparse_optimizer.beta=0.5"])
    with pytest.raises(ConfigError, match=r"train\.sparse_optimizer\.type: module 'my_extensions' has no class 'Nesterov'"):
        load_config(path, ["train.sparse_optimizer.type=my_extensions:Nesterov"])
    with pytest.raises(ConfigError, match=r"task\.type: 'my_extensions:MomentumSGD' is not a Head subclass"):
        build_model(load_config(path, ["task.type=my_extensions:MomentumSGD"]))
    with pytest.raises(ConfigError, match=r"features\[2\]\.boundaries: expected strictly increasing numbers"):
        load_config(path, ["features.price.boundaries=[2.0, 1.0]"])
    with pytest.raises(ConfigError, match=r"features\[2\]: unknown key 'max_len'"):
        load_config(path, ["features.price.max_len=3"])


def test_a_bucketized_price_has_the_keys_of_its_bucket_index(tmp_path, extensions):
    """The kind's ids against those of an int64 categorical of the bucket index, by hand."""
    write_counts(tmp_path / "train.csv", 10, seed=1)
    config = load_config(extension_config(tmp_path))
    by_bucket = config_from_dict(
        {**to_dict(config), "features": [{"name": "user", "kind": "categorical", "dtype": "int64"}]}
    ).feature("user")
    prices = tf.constant([0.5, 1.0, 1.99, 2.0, 7.0, float("nan")], tf.float32)
    buckets = tf.constant([0, 1, 1, 2, 3, -1], tf.int64)  # boundaries [1, 2, 4]
    got = transform(config, {"user": buckets, "item": tf.constant(["a"] * 6), "price": prices})
    np.testing.assert_array_equal(got["price"].numpy(), transform_one(by_bucket, buckets).numpy())


def test_registered_names_work_like_module_names(tmp_path, extensions, monkeypatch):
    """`register_*` from the Python API: short names in the config, no `module:`."""
    from recflow.config import convert
    from recflow.embedding import optimizers
    from recflow.embedding.optimizers import register_sparse_optimizer
    from recflow.features import kinds
    from recflow.features.kinds import kind_of, register_feature_kind
    from recflow.models import heads, register_head
    from recflow.models.heads import RegressionHead

    # The names registered here are this test's only.
    monkeypatch.setattr(heads, "_HEADS", dict(heads._HEADS))
    monkeypatch.setattr(optimizers, "_OPTIMIZERS", dict(optimizers._OPTIMIZERS))
    monkeypatch.setattr(kinds, "_KINDS", dict(kinds._KINDS))
    monkeypatch.setattr(convert, "_REGISTERED", {k: dict(v) for k, v in convert._REGISTERED.items()})

    register_head("ext_poisson")(extensions.PoissonHead)
    register_sparse_optimizer("ext_momentum")(extensions.MomentumSGD)
    register_feature_kind("ext_bucketized")(extensions.Bucketized)
    write_counts(tmp_path / "train.csv", 10, seed=1)
    config = load_config(
        extension_config(tmp_path),
        [
            "task.type=ext_poisson",
            "train.sparse_optimizer.type=ext_momentum",
            "features.price.kind=ext_bucketized",
        ],
    )
    assert isinstance(config.train.sparse_optimizer, extensions.MomentumConfig)
    assert isinstance(kind_of(config.feature("price")), extensions.Bucketized)
    model = build_model(config)
    assert [type(h) for h in model.heads] == [extensions.PoissonHead]
    assert {type(t.optimizer) for t in model.embedding.physical_tables} == {extensions.MomentumSGD}
    with pytest.raises(ValueError, match="a head named 'ext_poisson' is already registered"):
        register_head("ext_poisson")(RegressionHead)
    with pytest.raises(TypeError, match="is not a Head subclass"):
        register_head("ext_other")(extensions.MomentumSGD)


# ----------------------------------------------------------------------------- by value


@register_model("extensions_sum_tower")
class SumTower(RankingModel):
    """logit = sum of every pooled embedding: no dense weights, so gradients are known."""

    def tower(self, inputs, training=False):
        return tf.add_n([tf.reduce_sum(v, axis=1, keepdims=True) for v in self.pooled(inputs)])


def test_momentum_sgd_rows_match_numpy(extensions):
    lr, momentum = 0.3, 0.5
    config = config_from_dict(
        {
            "data": {"format": "synthetic", "label": "click"},
            "features": [{"name": "item", "kind": "categorical", "dtype": "int64", "table": "t"}],
            "tables": {
                "t": {
                    "dim": 3,
                    "optimizer": {
                        "type": "my_extensions:MomentumSGD",
                        "learning_rate": lr,
                        "momentum": momentum,
                    },
                }
            },
            "model": {"type": "extensions_sum_tower"},
        }
    )
    model = build_model(config)
    model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
    step = tf.function(model.train_step)
    table = model.embedding.physical_tables[0]
    assert table.layout.num_slots == 1
    rng = np.random.default_rng(0)
    keys = np.array([10, 20, 30], np.int64)
    e = rng.normal(size=(3, 3)).astype(np.float32)
    v = rng.normal(size=(3, 3)).astype(np.float32)
    table.rows.insert(
        encode(tf.constant(keys), 0),
        table.layout.pack(tf.constant(e), tf.constant(v), tf.ones([3], tf.int32), tf.zeros([3], tf.int32)),
    )
    ids = np.array([10, 20, 10, 20], np.int64)  # key 10 twice (gradients add up); 30 unseen
    y = np.array([1.0, 0.0, 0.0, 1.0])
    for t in (1, 2, 3):
        features = transform(config, {"item": tf.constant(ids)})
        step((features, {"click": tf.constant(y, tf.float32)}, tf.constant(0, tf.int64)))
        logits = np.array([e[k // 10 - 1].sum() for k in ids])
        per_example = (1.0 / (1.0 + np.exp(-logits)) - y) / len(ids)
        g = np.zeros_like(e)
        for k, d in zip(ids, per_example):
            g[k // 10 - 1] += d
        for row in (0, 1):  # by hand: v <- momentum v + g; w <- w - lr v
            v[row] = momentum * v[row] + g[row]
            e[row] = e[row] - lr * v[row]
        got_e, got_v, count, last = table.layout.split_numpy(
            table.rows.lookup(encode(tf.constant(keys), 0)).numpy()
        )
        np.testing.assert_allclose(got_e, e, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(got_v, v, rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(last, [t, t, 0])


def test_the_export_serves_the_optimizers_serving_rows(extensions, monkeypatch):
    monkeypatch.setattr(
        extensions.MomentumSGD, "serving_rows", lambda self, emb, slots: emb + slots, raising=False
    )
    config = load_config(
        str(ROOT / "configs" / "deepfm_demo.yaml"),
        ["train.sparse_optimizer={type: 'my_extensions:MomentumSGD'}", "embedding.fusion=false"],
    )
    engine = build_model(config).embedding
    table = engine.physical_tables[0]
    keys = np.array([[0, 5], [0, 7]], np.int64)
    emb, slots = np.ones((2, table.spec.dim), np.float32), np.full((2, table.spec.dim), 2.0, np.float32)
    table.rows.insert(
        tf.constant(keys),
        table.layout.pack(tf.constant(emb), tf.constant(slots), tf.ones([2], tf.int32), tf.ones([2], tf.int32)),
    )
    _, served = engine.serving_rows(0)
    np.testing.assert_array_equal(served.numpy(), np.full((2, table.spec.dim), 3.0))
    (ids, rows), = [v for v in engine.updated_rows(0).values() if v[0].size]
    np.testing.assert_array_equal(rows, np.full((2, table.spec.dim), 3.0))


# ----------------------------------------------------------------------------- dense


def dense_config(optimizer: dict):
    return load_config(str(ROOT / "configs" / "deepfm_demo.yaml"), [f"train.optimizer={json.dumps(optimizer)}"])


def test_any_keras_optimizer_by_name_with_its_kwargs():
    opt = make_dense_optimizer(
        dense_config({"type": "adamw", "learning_rate": 0.003, "weight_decay": 0.02}).train.optimizer
    )
    assert type(opt) is keras.optimizers.AdamW
    assert float(opt.learning_rate) == pytest.approx(0.003) and opt.weight_decay == 0.02
    opt = make_dense_optimizer(
        dense_config({"type": "SGD", "momentum": 0.9, "nesterov": True}).train.optimizer
    )
    assert type(opt) is keras.optimizers.SGD and opt.momentum == 0.9 and opt.nesterov
    assert float(opt.learning_rate) == pytest.approx(0.001)  # recflow's default


@pytest.mark.parametrize(
    "optimizer, message",
    [
        ({"type": "adamx"}, r"^train\.optimizer\.type: no Keras optimizer 'adamx' \(known: adadelta, adafactor, adagrad, adam, adamax, adamw, ftrl, lion, nadam, rmsprop, sgd; or 'package.module:ClassName'\)$"),
        ({"type": "adamw", "weight_decy": 0.1}, r"^train\.optimizer\.weight_decy: not an argument of AdamW \(allowed: .*weight_decay"),
        ({"type": "adam", "use_ema": True}, r"^train\.optimizer\.use_ema: not supported"),
        ({"type": "sgd", "momentum": "high"}, r"^train\.optimizer\.momentum: expected a number, got 'high'$"),
        ({"type": "sgd", "nesterov": 1}, r"^train\.optimizer\.nesterov: expected true or false, got 1$"),
        ({"type": "sgd", "momentum": 2.0}, r"^train\.optimizer: SGD: `momentum` must be between \[0, 1\]"),
        ({"type": "recflow:Nope"}, r"^train\.optimizer\.type: module 'recflow' has no class 'Nope'$"),
    ],
)
def test_dense_optimizer_errors_name_the_path(optimizer, message):
    with pytest.raises(ConfigError, match=message):
        make_dense_optimizer(dense_config(optimizer).train.optimizer)


@pytest.mark.parametrize("in_loop", [False, True])
def test_the_in_loop_dense_update_clips_and_decays_like_apply_gradients(in_loop):
    """Both dense update paths (`in_loop`: the parameter-server chunk's) against numpy."""
    w0 = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
    g = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)  # norm 5, clipped to norm 1
    lr, wd = 0.1, 0.2
    variable = tf.Variable(w0)
    opt = keras.optimizers.AdamW(learning_rate=lr, weight_decay=wd, clipnorm=1.0)
    owner = types.SimpleNamespace(optimizer=opt)
    tf.function(lambda: Base._apply_dense(owner, [tf.constant(g)], [variable], in_loop))()
    clipped = g / 5.0
    w = w0 - lr * wd * w0  # decoupled weight decay first, as Keras applies it
    m, v = 0.1 * clipped, 0.001 * clipped**2
    lr_t = lr * np.sqrt(1 - 0.999) / (1 - 0.9)
    w = w - lr_t * m / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(variable.numpy(), w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- docs


def test_the_docs_show_the_extension_code_verbatim():
    source = (EXTENSIONS / "my_extensions.py").read_text(encoding="utf-8")
    doc = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    for name in ("head", "optimizer", "kind"):
        code = re.search(rf"# \[start:{name}\]\n(.*?)# \[end:{name}\]\n", source, re.S).group(1)
        assert code in blocks, f"docs/models.md does not show the {name} of {EXTENSIONS.name}/my_extensions.py"

