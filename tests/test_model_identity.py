"""A trained model's identity: config changes against a model dir are refused with
one line and nothing written; reordered config lines change nothing; an export
version is never rewritten; exports are readable by other users."""

import json
import os
import shutil
import stat

import pytest
import yaml
from conftest import DEMO as CONFIG
from conftest import TRAINED as SMALL
from conftest import sets

import recflow
import recflow.api
from recflow.cli import main


@pytest.fixture
def trained(trained_demo, tmp_path):
    """A copy of the session's trained demo (8 steps, 2 checkpoints and the export):
    the tests below run commands against it."""
    model_dir, metrics = trained_demo
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy, metrics


def _snapshot(model_dir) -> dict:
    """Every file of the model dir (but the lock) with its bytes."""
    out = {}
    for root, _, files in os.walk(model_dir):
        for name in files:
            path = os.path.join(root, name)
            if name != ".lock":
                with open(path, "rb") as f:
                    out[os.path.relpath(path, model_dir)] = f.read()
    return out


def _reordered_config(tmp_path) -> str:
    """The demo config with its feature lines in reverse order and its table lines swapped."""
    with open(CONFIG, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["features"] = raw["features"][::-1]
    raw["tables"] = dict(reversed(list(raw["tables"].items())))
    path = tmp_path / "reordered.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def test_reordered_feature_lines_read_the_same_model(trained, tmp_path):
    model_dir, metrics = trained
    reordered = _reordered_config(tmp_path)
    again = recflow.evaluate(reordered, model_dir=str(model_dir), overrides=SMALL)
    assert again["auc"] == metrics["auc"]
    assert again["logloss"] == metrics["logloss"]
    # The plan is the same whatever the order of the lines: same physical tables, same slots.
    from recflow.embedding.plan import plan_tables

    a = recflow.api.load(CONFIG, overrides=SMALL)
    b = recflow.api.load(reordered, overrides=SMALL)
    assert [f.name for f in a.features] == sorted(f.name for f in a.features)
    assert plan_tables(a, first_order=True) == plan_tables(b, first_order=True)


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"tables.user.dim": 16}, "tables.user.dim: 8 in"),
        ({"embedding.fusion": False}, "fusion."),
        # user's policy dropped: it joins the fused group, and the line says why the plan changed
        ({"tables.user.eviction": None}, "(the tables fuse differently: category, city, tags shared one"),
        ({"model.params": {"dnn": {"hidden_units": [16]}}}, "model.params.dnn.hidden_units: [8] in"),
        ({"train.sparse_optimizer": {"type": "adagrad"}}, "optimizer: adam in"),
        ({"features.city.kind": "multi_hot"}, "features.city.kind: categorical in"),
        ({"train.optimizer": {"type": "sgd"}}, "dense_optimizer: adam in"),
    ],
)
@pytest.mark.parametrize("command", ["train", "evaluate", "export"])
def test_a_changed_structure_is_refused_and_nothing_is_written(
    trained, capsys, override, expected, command
):
    model_dir, _ = trained
    before = _snapshot(model_dir)
    capsys.readouterr()
    code = main([command, CONFIG, "--model-dir", str(model_dir), *sets({**SMALL, **override})])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recflow: "), err
    assert expected in lines[0] and "in this config" in lines[0], lines[0]
    assert _snapshot(model_dir) == before  # config.yaml, checkpoints and exports untouched


@pytest.mark.parametrize("change", ["added", "removed"])
def test_an_added_or_removed_feature_is_refused_naming_it(trained, capsys, change):
    model_dir, _ = trained
    raw = yaml.safe_load(open(CONFIG, encoding="utf-8"))
    if change == "added":
        raw["features"].append({"name": "region", "kind": "categorical", "column": "city", "dim": 8})
        expected = "features.region: absent in"
    else:
        raw["features"] = [f for f in raw["features"] if f["name"] != "price"]
        expected = 'features.price: {"kind": "numeric", "normalizer": "log1p"} in'
    path = model_dir.parent / f"{change}.yaml"  # beside the copy, in tmp_path
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    code = main(["evaluate", str(path), "--model-dir", str(model_dir), *sets(SMALL)])
    err = capsys.readouterr().err
    assert code == 2
    assert expected in err and "--warm-start" in err, err


def test_features_pointed_at_other_columns_are_named_in_a_warning(trained, capsys):
    """The identity leaves columns out (a column renamed in the data may follow its
    feature), so swapped columns resume; the run names each moved feature."""
    model_dir, metrics = trained
    swap = {"features.category.column": "city", "features.city.column": "category"}
    capsys.readouterr()
    assert main(["evaluate", CONFIG, "--model-dir", str(model_dir), *sets({**SMALL, **swap})]) == 0
    err = capsys.readouterr().err
    assert "'category' reads column 'city' (trained on 'category'); " in err, err
    assert "'city' reads column 'category' (trained on 'city'); fine for a column renamed" in err, err
    assert main(["evaluate", CONFIG, "--model-dir", str(model_dir), *sets(SMALL)]) == 0
    assert "reads column" not in capsys.readouterr().err


def test_an_export_version_is_never_rewritten(trained, capsys):
    model_dir, metrics = trained
    export = model_dir / "export" / str(metrics["steps"])
    before = _snapshot(export)
    stamp = os.stat(export / "saved_model.pb").st_mtime_ns
    assert main(["export", CONFIG, "--model-dir", str(model_dir), *sets(SMALL)]) == 0
    assert capsys.readouterr().out.strip() == str(export)
    assert _snapshot(export) == before
    assert os.stat(export / "saved_model.pb").st_mtime_ns == stamp
    saved = json.loads((export / "assets.extra" / "structure.json").read_text())
    assert saved["tables"]["user"] == {"dim": 8, "optimizer": "adam"}
    assert saved["parameter_servers"] == 1


def test_exports_honour_the_umask(trained):
    model_dir, metrics = trained
    old = os.umask(0o022)
    os.umask(old)
    assert old == 0o022  # what the expectations below assume
    export = model_dir / "export" / str(metrics["steps"])
    for root, dirs, files in os.walk(export):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o755, d
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o644, name
    assert stat.S_IMODE(os.stat(export).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(model_dir / "metrics.json").st_mode) == 0o644


def test_a_checkpoint_of_another_shard_count_resumes_and_records_the_new_count(tmp_path, capsys):
    """A model dir written with 2 parameter-server shards resumes in one process: the shard
    count is recorded, not compared (the rows are resharded: tests/test_reshard.py), while
    a real change beside it is still refused."""
    from recflow.embedding.placement import ModPlacement
    from recflow.training.trainer import Trainer

    model_dir = tmp_path / "two_shards"
    config = recflow.api.load(CONFIG, model_dir=str(model_dir), overrides={**SMALL, "train.steps": 2})
    Trainer(config, verbose=0, placement=ModPlacement(2)).fit()
    before = _snapshot(model_dir)
    code = main(["train", CONFIG, "--model-dir", str(model_dir),
                 *sets({**SMALL, "train.steps": 4, "tables.user.dim": 16})])
    err = capsys.readouterr().err
    assert code == 2
    assert "tables.user.dim: 8 in" in err and "parameter_servers" not in err, err
    assert _snapshot(model_dir) == before

    assert main(["train", CONFIG, "--model-dir", str(model_dir), *sets({**SMALL, "train.steps": 4}),
                 "--quiet"]) == 0
    # Said even by a quiet run (a launched chief is one): the cluster's size changed.
    assert "recflow: warning: Resharding the tables of ckpt-" in capsys.readouterr().err
    saved = json.loads((model_dir / "export" / "4" / "assets.extra" / "structure.json").read_text())
    assert saved["parameter_servers"] == 1


def test_a_model_dir_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """A read-only model dir (stood in for by a lock file that may not be opened: the
    tests run as root, who writes anywhere) ends with one line, not a traceback."""
    model_dir = tmp_path / "ro"
    model_dir.mkdir()
    real_open = os.open

    def refuse_lock(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_lock)
    # train: a reader of a dir without a checkpoint (evaluate) now stops before the lock
    code = main(["train", CONFIG, "--model-dir", str(model_dir), *sets(SMALL)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{model_dir}: not writable" in err


TOWER = """
import tensorflow as tf
import tf_keras as keras

from recflow.models import RankingModel


class Tiny(RankingModel):
    def __init__(self, config, hidden=3, **kwargs):
        super().__init__(config, **kwargs)
        self.hidden = keras.layers.Dense(WIDTH, activation="relu")
        self.head = keras.layers.Dense(1)

    def tower(self, inputs, training=False):
        x = tf.concat(self.pooled(inputs) + [self.numeric(inputs)], axis=-1)
        return self.head(EXTRA(self.hidden(x)))
"""


@pytest.mark.parametrize(
    "width, extra, expected",
    [
        ("hidden", "self.more", "dense.more/kernel: absent in"),  # a layer added, same params
        ("2 * hidden", "", "dense.hidden/kernel: [9, 3] in"),  # a width changed: was a traceback
    ],
)
def test_a_tower_whose_code_changed_is_refused_naming_its_weights(tmp_path, capsys, monkeypatch, width, extra, expected):
    import sys

    from test_cli_errors import HEADER, ROWS, tiny_config, write_config, write_csv

    write_csv(tmp_path, [HEADER, *ROWS])
    name = f"identity_tower_{len(extra)}"  # one module name a case: a process caches modules
    module = tmp_path / f"{name}.py"
    module.write_text(TOWER.replace("WIDTH", "hidden").replace("EXTRA", ""))
    raw = tiny_config(tmp_path)
    raw["model"] = {"type": f"{name}:Tiny"}
    config = write_config(tmp_path, raw)
    assert main(["train", config, "--quiet"]) == 0, capsys.readouterr().err
    changed = TOWER.replace("WIDTH", width).replace("EXTRA", extra)
    if extra:
        changed = changed.replace("self.head = ", "self.more = keras.layers.Dense(3)\n        self.head = ")
    module.write_text(changed)
    monkeypatch.delitem(sys.modules, name)  # the changed code is imported again
    capsys.readouterr()
    assert main(["evaluate", config]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "variables mean" in lines[0], lines
