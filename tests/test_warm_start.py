"""`--warm-start`: a new model dir starts from another one's rows and weights wherever
they still fit, checked by value."""

import json

import numpy as np
import pytest
import yaml
from conftest import DEMO as CONFIG
from conftest import sets, small

import recflow
from recflow.cli import main

# Two hidden layers: a wider input changes the first layer's shape, not the second's.
SMALL = small({"model.params": {"dnn": {"hidden_units": [8, 4]}}})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("warm") / "source"
    recflow.train(CONFIG, model_dir=str(model_dir), overrides=SMALL)
    return model_dir


def _changed_config(tmp_path) -> str:
    """The demo config with a feature added (`region`, its own table), and the user
    table's dim changed from 8 to 16."""
    raw = yaml.safe_load(open(CONFIG, encoding="utf-8"))
    raw["features"].append({"name": "region", "kind": "categorical", "column": "city", "dim": 8})
    raw["tables"]["user"]["dim"] = 16
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def _restored_model(model_dir):
    import tensorflow as tf

    from recflow.config import load_config
    from recflow.models import build_model

    model = build_model(load_config(str(model_dir / "config.yaml")))
    model.build_weights()
    tf.train.Checkpoint(model=model).restore(
        tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    ).expect_partial()
    return model


def _weights(model) -> dict:
    """The model's dense weights by path: its variables but the embedding engine's and the
    run's own counters (step, bad rows), which a warm start never carries."""
    from recflow.models.identity import dense_paths

    return {p: v for p, v in dense_paths(model).items() if p not in ("global_step", "bad_records")}


def test_rows_and_dense_weights_that_fit_are_carried_by_value(source, tmp_path):
    from recflow.api import load
    from recflow.training.trainer import Trainer
    from recflow.training.warm_start import warm_start

    old = _restored_model(source)
    config = load(_changed_config(tmp_path), model_dir=str(tmp_path / "new"), overrides=SMALL)
    new = Trainer(config, verbose=0).model
    report = warm_start(new, str(source))

    old_rows, new_rows = old.embedding.logical_rows(), new.embedding.logical_rows()
    carried = {"item", "category", "city", "tags", "item.linear", "category.linear", "city.linear",
               "tags.linear", "user.linear"}
    assert set(report["tables"]) == carried
    assert report["fresh_tables"] == ["region", "region.linear", "user"]
    for name in carried:
        a, b = old_rows[name], new_rows[name]
        assert a.ids.size > 0 and report["tables"][name] == a.ids.size
        ia, ib = np.argsort(a.ids), np.argsort(b.ids)
        np.testing.assert_array_equal(a.ids[ia], b.ids[ib], err_msg=name)
        np.testing.assert_array_equal(a.emb[ia], b.emb[ib], err_msg=name)
        np.testing.assert_array_equal(a.slots[ia], b.slots[ib], err_msg=name)
        np.testing.assert_array_equal(a.count[ia], b.count[ib], err_msg=name)
        assert (b.last_step == 0).all()  # seen at the warm start, step 0 of the new run
    for name in ("user", "region", "region.linear"):
        assert new_rows[name].ids.size == 0  # new or resized tables start empty

    # A feature was added: the tower's inputs changed, so no dense weight is carried (the
    # later layers' shapes still fit, but they were trained on the old first layer's outputs).
    assert report["dense"] == {"carried": 0, "fresh": sorted(_weights(new)),
                               "why_fresh": "the tower's inputs changed"}


@pytest.fixture(scope="module")
def source_bn(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("warm_bn") / "source"
    recflow.train(CONFIG, model_dir=str(model_dir), overrides=BATCH_NORM)
    return model_dir


BATCH_NORM = small({"model.params": {"dnn": {"hidden_units": [8, 4], "use_batch_norm": True}}})


def _warm(config_path, source, tmp_path):
    from recflow.api import load
    from recflow.training.trainer import Trainer
    from recflow.training.warm_start import warm_start

    new = Trainer(load(config_path, model_dir=str(tmp_path / "new"), overrides=BATCH_NORM), verbose=0).model
    return new, warm_start(new, str(source))


def test_dense_weights_and_batch_norm_statistics_are_carried_when_the_inputs_are_the_same(source_bn, tmp_path):
    """A table policy changed (the identity refuses a resume, warm start takes it): every
    dense variable is carried, the batch norms' moving statistics too (they were left at
    their initial values, so the export scored differently until they caught up)."""

    raw = yaml.safe_load(open(CONFIG, encoding="utf-8"))
    raw["tables"]["item"]["eviction"] = {"ttl_steps": 1000}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    new, report = _warm(str(path), source_bn, tmp_path)
    old_vars, new_vars = _weights(_restored_model(source_bn)), _weights(new)
    moving = [p for p in new_vars if "moving_" in p]
    assert moving and set(new_vars) == set(old_vars)
    for p in moving:  # trained away from their initial values (mean 0, variance 1)
        assert not np.allclose(old_vars[p].numpy(), 1.0 if p.endswith("variance") else 0.0), p
    for p, v in new_vars.items():
        np.testing.assert_array_equal(v.numpy(), old_vars[p].numpy(), err_msg=p)
    assert report["dense"] == {"carried": len(new_vars), "fresh": []}


def test_a_swapped_feature_of_the_same_width_leaves_the_dense_weights_fresh(source_bn, tmp_path):
    """`age` renamed `zage` (the same column): the numeric inputs, in name order, went from
    [age, price] to [price, zage], and price took age's first-layer rows by shape."""

    raw = yaml.safe_load(open(CONFIG, encoding="utf-8"))
    (age,) = [f for f in raw["features"] if f["name"] == "age"]
    age.update(name="zage", column="age")
    path = tmp_path / "swap.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    new, report = _warm(str(path), source_bn, tmp_path)
    assert report["dense"] == {"carried": 0, "fresh": sorted(_weights(new)),
                               "why_fresh": "the tower's inputs changed"}
    assert report["tables"]["item"] > 0  # the rows still come over


def test_rows_whose_ids_changed_dtype_start_fresh(source, tmp_path):
    """user_id read as strings: the source's int64-keyed user rows would never be found
    by a string's fingerprint, so its tables start empty (they were carried as dead rows)."""
    from recflow.api import load
    from recflow.training.trainer import Trainer
    from recflow.training.warm_start import warm_start

    raw = yaml.safe_load(open(CONFIG, encoding="utf-8"))
    (user,) = [f for f in raw["features"] if f["name"] == "user_id"]
    assert user["dtype"] == "int64"
    user["dtype"] = "string"
    path = tmp_path / "strings.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    config = load(str(path), model_dir=str(tmp_path / "new"), overrides=SMALL)
    new = Trainer(config, verbose=0).model
    report = warm_start(new, str(source))
    assert report["fresh_tables"] == ["user", "user.linear"]
    assert "user" not in report["tables"] and report["tables"]["item"] > 0
    rows = new.embedding.logical_rows()
    assert rows["user"].ids.size == 0 and rows["user.linear"].ids.size == 0


def test_cli_warm_start_trains_a_new_model_dir_and_a_rerun_resumes_it(source, tmp_path, capsys):
    target = tmp_path / "target"
    args = ["train", _changed_config(tmp_path), "--quiet", "--model-dir", str(target),
            "--warm-start", str(source)]
    args += sets(SMALL)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warm start from " in out and "item (" in out and "fresh tables: region, region.linear, user" in out
    metrics = json.loads((target / "metrics.json").read_text())
    assert metrics["warm_start"]["tables"]["item"] > 0 and metrics["steps"] == 8
    # The model dir has its checkpoint now: a rerun resumes it (already done), no second warm start.
    assert main(args) == 0
    assert "already at step 8" in capsys.readouterr().out


def test_a_missing_source_is_one_line(tmp_path, capsys):
    code = main(["train", CONFIG, "--model-dir", str(tmp_path / "t"), "--warm-start", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2 and "no such model dir" in err and len(err.strip().splitlines()) == 1
