"""Config loading: defaults, path-named errors, `--set` overrides, round trips.

Every invalid config must raise `RecflowError` whose message is one line naming
the file and the dotted path of the offending value.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recflow.config import (
    CategoricalFeature,
    MultiHotFeature,
    NumericFeature,
    SequenceFeature,
    config_from_dict,
    dump_config,
    load_config,
    to_dict,
)
from recflow.config.loader import apply_overrides, parse_override
from recflow.config.schema import AdamConfig, SGDConfig, TableConfig
from recflow.errors import ConfigError, RecflowError

DEMO = Path(__file__).resolve().parent.parent / "configs" / "deepfm_demo.yaml"

# A config touching every section; the indices of its features are used below.
BASE = """
version: 1
data:
  format: csv
  train: data/train/*.csv
  eval: data/eval/*.csv
  label: click
  csv: {delimiter: ",", header: true}
features:
  - {name: user_id,    kind: categorical, dtype: int64, table: user}      # 0
  - {name: item_id,    kind: categorical, dtype: string, table: item}     # 1
  - {name: category,   kind: categorical, dim: 16}                        # 2
  - {name: tags,       kind: multi_hot, separator: "|", combiner: mean}   # 3
  - {name: hist_items, kind: sequence, max_len: 10, table: item}          # 4
  - {name: price,      kind: numeric, normalizer: {type: log1p}}          # 5
  - {name: age,        kind: numeric, normalizer: {type: standard, mean: 35.0, std: 10.0}}  # 6
  - {name: hour,       kind: numeric, normalizer: {type: bucketize, boundaries: [6, 12, 18]}}  # 7
tables:
  user: {dim: 8}
  item:
    dim: 16
    initializer: {type: truncated_normal, stddev: 0.01}
    admission: {min_count: 2}
    eviction: {ttl_steps: 1000}
    optimizer: {type: sgd, learning_rate: 0.1}
model:
  type: deepfm
  params: {dnn: {hidden_units: [8, 4], dropout: 0.0}}
task:
  type: binary
  metrics: [auc, logloss]
train:
  model_dir: runs/test
  epochs: 1
  optimizer: {type: adam, learning_rate: 0.001}
  sparse_optimizer: {type: adagrad, learning_rate: 0.05}
"""


def base_raw() -> dict:
    return yaml.safe_load(BASE)


def write(tmp_path: Path, raw, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return str(path)


def assert_one_line(message: str) -> None:
    assert message and len(message.splitlines()) == 1 and "\n" not in message, repr(message)


# ----------------------------------------------------------------------------- valid configs


def test_demo_config_loads():
    config = load_config(str(DEMO))
    assert config.version == 1
    assert config.data.format == "synthetic"
    assert config.data.label == ("click",)
    assert config.model.type == "deepfm"
    # features come out sorted by name: the order of the lines decides nothing
    assert [f.name for f in config.features][:2] == ["age", "category"]
    # every logical table in use resolves to a table config
    for name in config.table_names():
        assert config.table(name).dim > 0


def test_base_config_kinds_and_values(tmp_path):
    config = load_config(write(tmp_path, base_raw()))
    kinds = {f.name: type(f) for f in config.features}
    assert kinds == {
        "user_id": CategoricalFeature,
        "item_id": CategoricalFeature,
        "category": CategoricalFeature,
        "tags": MultiHotFeature,
        "hist_items": SequenceFeature,
        "price": NumericFeature,
        "age": NumericFeature,
        "hour": NumericFeature,
    }
    # sorted by name, whatever the order of the lines
    assert [f.name for f in config.features] == sorted(kinds)
    assert config.data.train == ("data/train/*.csv",)  # a scalar stands for a one-element list
    assert config.feature("hour").normalizer.boundaries == (6.0, 12.0, 18.0)
    assert config.feature("hist_items").max_len == 10
    assert config.tables["item"].admission.min_count == 2
    assert config.tables["item"].eviction.ttl_steps == 1000
    assert [f.name for f in config.sparse_features] == ["category", "hist_items", "item_id", "tags", "user_id"]
    assert [f.name for f in config.numeric_features] == ["age", "hour", "price"]
    assert config.table_names() == ("category", "item", "tags", "user")


def test_defaults_applied(tmp_path):
    raw = base_raw()
    del raw["train"]["sparse_optimizer"]
    raw["embedding"] = {"default_dim": 4}
    config = load_config(write(tmp_path, raw))
    # dataclass defaults
    assert config.data.batch_size == 1024
    assert config.data.shuffle is True
    assert config.data.on_bad_record == "skip"
    assert config.data.csv.delimiter == ","
    assert config.embedding.fusion is True
    assert config.distribute.strategy == "local"
    assert config.export.every_steps is None
    assert config.train.checkpoint_every_steps == 1000
    assert config.feature("tags").dtype == "string"
    assert config.feature("tags").separator == "|"
    assert config.feature("price").default is None  # missing -> neutral (see transform.normalize)
    assert config.task.metrics == ("auc", "logloss")
    # an implicit table takes its dim from the feature, or embedding.default_dim
    assert "category" not in config.tables
    assert config.table("category") == TableConfig(dim=16)
    assert config.table("tags") == TableConfig(dim=4)
    # a table without an optimizer falls back to train.sparse_optimizer (itself defaulted)
    assert config.train.sparse_optimizer == AdamConfig(learning_rate=0.005)
    assert config.sparse_optimizer("user") == AdamConfig(learning_rate=0.005)
    assert config.sparse_optimizer("category") == AdamConfig(learning_rate=0.005)
    assert config.sparse_optimizer("item") == SGDConfig(learning_rate=0.1)


def test_sparse_optimizer_falls_back_to_train_section(tmp_path):
    raw = base_raw()
    raw["train"]["sparse_optimizer"] = {"type": "ftrl", "learning_rate": 0.2, "l1": 0.5}
    config = load_config(write(tmp_path, raw))
    assert config.sparse_optimizer("user").type == "ftrl"
    assert config.sparse_optimizer("user").l1 == 0.5
    assert config.sparse_optimizer("user").learning_rate == pytest.approx(0.2)
    assert config.sparse_optimizer("item").type == "sgd"


def test_ints_accepted_where_numbers_expected(tmp_path):
    raw = base_raw()
    raw["train"]["optimizer"]["learning_rate"] = 1
    config = load_config(write(tmp_path, raw))
    assert config.train.optimizer.learning_rate == 1.0
    assert isinstance(config.train.optimizer.learning_rate, float)


# ----------------------------------------------------------------------------- invalid configs


def _set(path: str, value):
    """A mutation that sets `a.b[2].c` (dotted, with list indices as numbers)."""

    def mutate(raw):
        *parents, last = path.split(".")
        node = raw
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(path: str):
    def mutate(raw):
        *parents, last = path.split(".")
        node = raw
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[int(last) if isinstance(node, list) else last]

    return mutate


def _all(*mutations):
    def mutate(raw):
        for m in mutations:
            m(raw)

    return mutate


# (id, mutation, error path, message fragment)
BAD = [
    ("string-dim", _set("features.2.dim", "8"), "features[2].dim", "expected an integer, got '8'"),
    ("float-dim", _set("features.2.dim", 8.5), "features[2].dim", "expected an integer, got 8.5"),
    (
        "list-batch-size",
        _set("data.batch_size", [1, 2]),
        "data.batch_size",
        "expected an integer, got list",
    ),
    (
        "bool-int",
        _set("train.checkpoint_every_steps", True),
        "train.checkpoint_every_steps",
        "expected an integer, got True",
    ),
    (
        "bool-float",
        _set("train.optimizer.learning_rate", False),
        "train.optimizer.learning_rate",
        "expected a number, got False",
    ),
    (
        "string-float",
        _set("features.6.normalizer.std", "ten"),
        "features[6].normalizer.std",
        "expected a number, got 'ten'",
    ),
    ("int-bool", _set("data.shuffle", 1), "data.shuffle", "expected true or false, got 1"),
    ("null-int", _set("data.batch_size", None), "data.batch_size", "expected an integer, got null"),
    ("mapping-section", _set("train", [1]), "train", "expected a mapping, got list"),
    ("mapping-features", _set("features", {"name": "a"}), "features", "expected a list, got dict"),
    (
        "string-feature",
        _set("features.1", "item_id"),
        "features[1]",
        "expected a mapping, got 'item_id'",
    ),
    (
        "negative-dim",
        _set("features.2.dim", -3),
        "features[2].dim",
        "expected a positive integer, got -3",
    ),
    (
        "zero-table-dim",
        _set("tables.user.dim", 0),
        "tables.user.dim",
        "expected a positive integer, got 0",
    ),
    (
        "zero-batch-size",
        _set("data.batch_size", 0),
        "data.batch_size",
        "expected a positive integer, got 0",
    ),
    (
        "negative-learning-rate",
        _set("train.optimizer.learning_rate", -0.1),
        "train.optimizer.learning_rate",
        "expected a positive number, got -0.1",
    ),
    (
        "negative-table-learning-rate",
        _set("tables.item.optimizer.learning_rate", -1.0),
        "tables.item.optimizer.learning_rate",
        "expected a positive number, got -1.0",
    ),
    (
        "nan-learning-rate",
        _set("train.sparse_optimizer.learning_rate", float("nan")),
        "train.sparse_optimizer.learning_rate",
        "expected a finite number, got nan",
    ),
    (
        "boundaries-not-increasing",
        _set("features.7.normalizer.boundaries", [6, 18, 12]),
        "features[7].normalizer.boundaries",
        "strictly increasing",
    ),
    (
        "boundaries-repeated",
        _set("features.7.normalizer.boundaries", [6, 6, 12]),
        "features[7].normalizer.boundaries",
        "strictly increasing",
    ),
    (
        "boundaries-empty",
        _set("features.7.normalizer.boundaries", []),
        "features[7].normalizer.boundaries",
        "non-empty",
    ),
    (
        "zero-std",
        _set("features.6.normalizer.std", 0),
        "features[6].normalizer.std",
        "expected a positive number",
    ),
    (
        "max-len-zero",
        _set("features.4.max_len", 0),
        "features[4].max_len",
        "expected a positive integer, got 0",
    ),
    ("empty-separator", _set("features.3.separator", ""), "features[3].separator", "non-empty"),
    (
        "beta-out-of-range",
        _set("tables.item.optimizer", {"type": "adam", "beta_1": 1.0}),
        "tables.item.optimizer.beta_1",
        "[0, 1)",
    ),
    # a zero gradient over a zero denominator: the loss turned NaN ("lower the learning rates")
    ("adam-zero-epsilon", _set("tables.item.optimizer", {"type": "adam", "epsilon": 0}),
     "tables.item.optimizer.epsilon", "expected a positive number, got 0"),
    ("adagrad-zero-epsilon-and-accumulator",
     _set("tables.item.optimizer", {"type": "adagrad", "epsilon": 0, "initial_accumulator_value": 0}),
     "tables.item.optimizer.epsilon", "expected a positive number when initial_accumulator_value is 0"),
    ("adagrad-negative-epsilon", _set("tables.item.optimizer", {"type": "adagrad", "epsilon": -1e-7}),
     "tables.item.optimizer.epsilon", "expected a non-negative"),
    (
        "eviction-empty",
        _set("tables.item.eviction", {}),
        "tables.item.eviction.ttl_steps",
        "max_keys",
    ),
    ("unknown-kind", _set("features.0.kind", "embedding"), "features[0].kind", "got 'embedding'"),
    ("list-kind", _set("features.0.kind", ["categorical"]), "features[0].kind", "got list"),
    ("missing-kind", _delete("features.0.kind"), "features[0].kind", "missing"),
    ("missing-name", _delete("features.2.name"), "features[2].name", "required"),
    ("bad-name", _set("features.2.name", "a b"), "features[2].name", "'a b'"),
    ("digit-name", _set("features.2.name", "1c"), "features[2].name", "must start with a letter, got '1c'"),
    (
        "names-one-in-a-signature",
        _set("features.2.name", "Item-ID"),
        "features[2].name",
        "'Item-ID' and 'item_id' (features[1]) are one input name",
    ),
    (
        "unknown-normalizer",
        _set("features.5.normalizer.type", "zscore"),
        "features[5].normalizer.type",
        "got 'zscore'",
    ),
    ("unknown-dtype", _set("features.1.dtype", "float"), "features[1].dtype", "got 'float'"),
    ("unknown-format", _set("data.format", "json"), "data.format", "got 'json'"),
    (
        "unknown-optimizer",
        _set("train.sparse_optimizer.type", "lion"),
        "train.sparse_optimizer.type",
        "got 'lion'",
    ),
    ("bad-version", _set("version", 2), "version", "got 2"),
    ("bool-version", _set("version", True), "version", "got True"),
    ("dangling-table", _set("features.1.table", "items"), "features[1].table", "no table 'items'"),
    ("unused-table", _set("tables.spare", {"dim": 4}), "tables.spare", "used by no feature"),
    ("dim-with-table", _set("features.0.dim", 4), "features[0].dim", "set the dim on the table"),
    (
        "table-shared-across-dtypes",  # item_id (string) and hist_items share table item
        _set("features.4.dtype", "int64"),
        "features[4].dtype",
        "int64, but 'item_id' reads table 'item' as string",
    ),
    (
        "implicit-table-shadowed",  # category has no `table`, but a table named category exists
        _set("tables.category", {"dim": 4}),
        "features[2].table",
        "set `table: category`",
    ),
    ("missing-label", _delete("data.label"), "data.label", "required"),
    ("label-is-feature", _set("data.label", "price"), "data.label[0]", "also a feature"),
    ("two-labels-binary", _set("data.label", ["click", "buy"]), "data.label", "expected one label"),
    (
        "duplicate-feature",
        _set("features.3.name", "category"),
        "features[3].name",
        "duplicate feature name 'category'",
    ),
    ("no-features", _set("features", []), "features", "at least one feature"),
    (
        "only-numeric-features",
        _set("features", [{"name": "price", "kind": "numeric"}]),
        "features",
        "at least one categorical",
    ),
    (
        "gauc-without-group-by",
        _set("task.metrics", ["auc", "gauc"]),
        "task.group_by",
        "required when metrics include 'gauc'",
    ),
    (
        "group-by-no-feature",
        _set("task.group_by", "nobody"),
        "task.group_by",
        "no feature 'nobody'",
    ),
    ("multitask-without-tasks", _set("task.type", "multitask"), "task.tasks", "required"),
    (
        "two-tasks-one-label",  # trained, then every evaluation failed (labels appended twice)
        _all(_set("task.type", "multitask"), _delete("data.label"),
             _set("task.tasks", [{"name": "a", "label": "click"}, {"name": "b", "label": "click", "type": "regression"}])),
        "task.tasks[1].label",
        "'click' is also task 'a''s label",
    ),
    (
        "group-by-multi-hot",  # gauc came out null
        _all(_set("task.metrics", ["auc", "gauc"]), _set("task.group_by", "tags")),
        "task.group_by",
        "'tags' is a multi_hot feature",
    ),
    (
        "group-by-numeric",  # gauc grouped by the normalized value (a bucketized hour: 4 groups)
        _all(_set("task.metrics", ["auc", "gauc"]), _set("task.group_by", "price")),
        "task.group_by",
        "'price' is a numeric feature (gauc would group by its normalized value, not its values); "
        "group by a categorical feature",
    ),
    (
        "tasks-without-multitask",
        _set("task.tasks", [{"name": "a", "label": "click"}]),
        "task.tasks",
        "only allowed",
    ),
    (
        "epochs-and-steps",
        _set("train.steps", 10),
        "train.steps",
        "set either epochs or steps, not both",
    ),
    ("zero-epochs", _set("train.epochs", 0), "train.epochs", "expected a positive integer, got 0"),
    ("empty-model-dir", _set("train.model_dir", ""), "train.model_dir", "non-empty"),
    ("long-delimiter", _set("data.csv.delimiter", ";;"), "data.csv.delimiter", "one ASCII character"),
    # one character of two bytes: TensorFlow's CSV parse failed after data check had passed
    ("non-ascii-delimiter", _set("data.csv.delimiter", "\u00a6"), "data.csv.delimiter", "one ASCII character"),
    (
        "no-header-no-columns",
        _set("data.csv.header", False),
        "data.csv.columns",
        "required when header is false",
    ),
    (
        "params-not-mapping",
        _set("model.params", [1]),
        "model.params",
        "expected a mapping, got list",
    ),
    (
        "unknown-strategy",
        _set("distribute.strategy", "mirrored"),
        "distribute.strategy",
        "got 'mirrored'",
    ),
]


@pytest.mark.parametrize("mutate, path, fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_names_file_and_path(tmp_path, mutate, path, fragment):
    raw = base_raw()
    mutate(raw)
    file = write(tmp_path, raw, "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    error = info.value
    message = str(error)
    assert_one_line(message)
    assert error.path == path
    assert error.file == file
    assert message.startswith(f"{file}: {path}: "), message
    assert fragment in message
    # the same error without a file, straight from the dict
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert str(info.value) == f"{path}: {error.message}"


def test_exact_message_for_negative_dim(tmp_path):
    raw = base_raw()
    raw["features"][2]["dim"] = -3
    file = write(tmp_path, raw, "model.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == f"{file}: features[2].dim: expected a positive integer, got -3"


# (id, mutation, path of the section, rest of the message)
UNKNOWN = [
    (
        "top",
        _set("extras", 1),
        "",
        "unknown key 'extras' (allowed: data, distribute, "
        "embedding, export, features, model, tables, task, train, version)",
    ),
    (
        "data-misspelt",
        _set("data.batchsize", 8),
        "data",
        "unknown key 'batchsize' (did you mean 'batch_size'?)",
    ),
    (
        "table-longer",
        _set("tables.item.dimension", 3),
        "tables.item",
        "unknown key 'dimension' (did you mean 'dim'?)",
    ),
    (
        "feature",
        _set("features.2.colour", "red"),
        "features[2]",
        "unknown key 'colour' (allowed: column, dim, dtype, kind, name, table)",
    ),
    (
        "optimizer",
        _set("tables.item.optimizer.momentum", 0.9),
        "tables.item.optimizer",
        "unknown key 'momentum' (allowed: learning_rate, type)",
    ),
    # max_len belongs to sequence features only: say so, and what a categorical takes
    (
        "key-of-other-kind",
        _set("features.0.max_len", 3),
        "features[0]",
        "unknown key 'max_len': it is for kind 'sequence' "
        "(allowed for kind 'categorical': column, dim, dtype, kind, name, table)",
    ),
    (
        "key-of-two-kinds",
        _set("features.0.separator", ","),
        "features[0]",
        "unknown key 'separator': it is for kind 'multi_hot' or 'sequence' "
        "(allowed for kind 'categorical': column, dim, dtype, kind, name, table)",
    ),
    (
        "normalizer-key-of-other-type",
        _set("features.5.normalizer.boundaries", [1]),
        "features[5].normalizer",
        "unknown key 'boundaries': it is for type 'bucketize' (allowed for type 'log1p': type)",
    ),
]


@pytest.mark.parametrize(
    "mutate, path, message", [u[1:] for u in UNKNOWN], ids=[u[0] for u in UNKNOWN]
)
def test_unknown_key_names_the_key_and_a_fix(tmp_path, mutate, path, message):
    raw = base_raw()
    mutate(raw)
    file = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == ": ".join(p for p in (file, path, message) if p)


def test_misspelt_kind_is_an_unknown_key_not_a_missing_kind(tmp_path):
    """Finding 10: `knd: categorical` was reported as `features[3].kind: missing`."""
    raw = base_raw()
    raw["features"][3]["knd"] = raw["features"][3].pop("kind")
    file = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == f"{file}: features[3]: unknown key 'knd' (did you mean 'kind'?)"
    # a `--set` value gets the same message, and `--set` takes the path as errors print it
    raw = base_raw()
    del raw["features"][3]["kind"]
    file = write(tmp_path, raw, "set.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(file, ["features[3].knd=multi_hot"])
    assert str(info.value) == f"{file}: features[3]: unknown key 'knd' (did you mean 'kind'?)"


def test_key_with_line_break_still_one_line(tmp_path):
    raw = base_raw()
    raw["data"]["bad\nkey"] = 1
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, raw))
    assert_one_line(str(info.value))
    assert "data: unknown key 'bad\\nkey'" in str(info.value)


# ----------------------------------------------------------------------------- file-level errors


@pytest.mark.parametrize(
    "text, line",
    [
        ("version: 1\ndata:\n  label: click\n batch_size: 3\n", 4),
        ("version: 1\nfeatures: [a, b\ntrain: {}\n", 3),
        ("version: 1\ndata:\n  label: click\n  train: a: b\n", 4),
        ("version: 1\n\tdata: {}\n", 2),
    ],
    ids=["indentation", "unclosed-list", "nested-colon", "tab"],
)
def test_yaml_syntax_error_names_line(tmp_path, text, line):
    file = tmp_path / "broken.yaml"
    file.write_text(text, encoding="utf-8")
    with pytest.raises(RecflowError) as info:
        load_config(str(file))
    message = str(info.value)
    assert_one_line(message)
    assert message.startswith(f"{file}: line {line}, column ")
    assert "invalid YAML" in message


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("- a\n- b\n", "expected a mapping at the top level, got list"),
        ("just a string\n", "expected a mapping at the top level, got str"),
        ("42\n", "expected a mapping at the top level, got int"),
    ],
)
def test_top_level_not_a_mapping(tmp_path, text, fragment):
    file = tmp_path / "list.yaml"
    file.write_text(text, encoding="utf-8")
    with pytest.raises(RecflowError) as info:
        load_config(str(file))
    assert str(info.value) == f"{file}: {fragment}"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file(tmp_path, text):
    file = tmp_path / "empty.yaml"
    file.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(str(file))
    assert str(info.value).startswith(f"{file}: features: ")


def test_missing_file(tmp_path):
    file = tmp_path / "nope.yaml"
    with pytest.raises(RecflowError) as info:
        load_config(str(file))
    assert str(info.value).startswith(f"{file}: cannot read config (")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(RecflowError, match="cannot read config"):
        load_config(str(tmp_path))


def test_binary_file(tmp_path):
    file = tmp_path / "binary.yaml"
    file.write_bytes(b"version: 1\n\xff\xfe\x00: x\n")
    with pytest.raises(RecflowError) as info:
        load_config(str(file))
    assert_one_line(str(info.value))
    assert str(info.value).startswith(f"{file}: ")


# ----------------------------------------------------------------------------- --set overrides


def test_set_scalars(tmp_path):
    file = write(tmp_path, base_raw())
    config = load_config(
        file, ["data.batch_size=32", "train.epochs=null", "train.steps=5", "data.shuffle=false"]
    )
    assert config.data.batch_size == 32
    assert config.train.epochs is None
    assert config.train.steps == 5
    assert config.train.total_epochs is None
    assert config.data.shuffle is False
    # null removes a list (it was `data.eval: expected a list, got null`)
    raw = base_raw()
    raw["data"]["eval"] = raw["data"]["train"]
    assert load_config(write(tmp_path, raw), ["data.eval=null"]).data.eval == ()


def test_set_string_with_equals_sign(tmp_path):
    config = load_config(write(tmp_path, base_raw()), ["train.model_dir=runs/a=b"])
    assert config.train.model_dir == "runs/a=b"


@pytest.mark.parametrize(
    "override, params",
    [
        ("model.params={}", {}),
        ("model.params={hidden: 32}", {"hidden": 32}),
        ("model.params={dnn: {hidden_units: [4]}}", {"dnn": {"hidden_units": [4]}}),
        ("model.params.dnn.dropout=0.5", {"dnn": {"hidden_units": [8, 4], "dropout": 0.5}}),
        (
            "model.params.new.deep=1",
            {"dnn": {"hidden_units": [8, 4], "dropout": 0.0}, "new": {"deep": 1}},
        ),
    ],
)
def test_set_yaml_mapping(tmp_path, override, params):
    config = load_config(write(tmp_path, base_raw()), [override])
    assert config.model.params == params


def test_set_creates_missing_sections(tmp_path):
    raw = base_raw()
    del raw["tables"]["user"]
    raw["tables"]["user"] = {}  # an empty table section: every key defaulted
    config = load_config(
        write(tmp_path, raw),
        ["tables.user.eviction.ttl_steps=30", "embedding.default_dim=4", "export.every_steps=7"],
    )
    assert config.tables["user"].eviction.ttl_steps == 30
    assert config.tables["user"].eviction.max_keys is None
    assert config.tables["user"].dim == 8
    assert config.embedding.default_dim == 4
    assert config.export.every_steps == 7


def test_set_creates_missing_table(tmp_path):
    raw = base_raw()
    del raw["tables"]
    raw["features"][0].pop("table")
    raw["features"][1].pop("table")
    raw["features"][4].pop("table")
    config = load_config(
        write(tmp_path, raw),
        ["tables.user_id.eviction.ttl_steps=30", "features.user_id.table=user_id"],
    )
    assert config.tables["user_id"].eviction.ttl_steps == 30


def test_set_list_item_by_index_and_name(tmp_path):
    config = load_config(
        write(tmp_path, base_raw()),
        [
            "features.2.dim=32",
            "features.price.default=1.5",
            "features.hour.normalizer.boundaries=[1, 2]",
        ],
    )
    assert config.feature("category").dim == 32  # features.2 is the file's third line
    assert config.feature("price").default == 1.5
    assert config.feature("hour").normalizer.boundaries == (1.0, 2.0)


def test_set_result_is_validated(tmp_path):
    file = write(tmp_path, base_raw())
    with pytest.raises(ConfigError) as info:
        load_config(file, ["features.category.dim=-3"])
    assert str(info.value) == f"{file}: features[2].dim: expected a positive integer, got -3"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("foo", "--set foo: expected KEY=VALUE"),
        ("=3", "--set =3: expected KEY=VALUE"),
        ("a..b=1", "--set a..b=1: expected KEY=VALUE"),
        ("train.=1", "--set train.=1: expected KEY=VALUE"),
        ("train.steps=[1", "--set train.steps=[1: value is not valid YAML"),
        ("features.nosuch.dim=3", "--set features.nosuch.dim=3: no list item 'nosuch'"),
        ("features.99.dim=3", "--set features.99.dim=3: no list item '99'"),
        ("version.x=1", "--set version.x=1: cannot set 'x' inside a int"),
        ("data.label.x=1", "--set data.label.x=1: cannot set 'x' inside a str"),
    ],
)
def test_bad_override(tmp_path, override, fragment):
    file = write(tmp_path, base_raw())
    with pytest.raises(RecflowError) as info:
        load_config(file, [override])
    assert_one_line(str(info.value))
    assert str(info.value).startswith(fragment), str(info.value)


def test_parse_override():
    assert parse_override("a.b.c=1") == (["a", "b", "c"], 1)
    assert parse_override("a=") == (["a"], "")
    assert parse_override("a=x: 1") == (["a"], {"x": 1})
    assert parse_override("a='quoted'") == (["a"], "quoted")


def test_apply_overrides_does_not_touch_other_keys():
    raw = {"a": {"b": 1, "c": [{"name": "x", "v": 1}, {"name": "y", "v": 2}]}}
    apply_overrides(raw, ["a.c.y.v=3", "a.c.0.v=4", "a.d.e=5"])
    assert raw == {
        "a": {"b": 1, "c": [{"name": "x", "v": 4}, {"name": "y", "v": 3}], "d": {"e": 5}}
    }


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("source", ["demo", "base"])
def test_to_dict_round_trip(tmp_path, source):
    config = (
        load_config(str(DEMO)) if source == "demo" else load_config(write(tmp_path, base_raw()))
    )
    plain = to_dict(config)
    assert config_from_dict(plain) == config
    # the plain form is YAML-able, and dump_config writes what load_config reads back
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain
    path = str(tmp_path / "resolved.yaml")
    dump_config(config, path)
    assert load_config(path) == config
    assert list(tmp_path.glob("resolved.yaml.tmp-*")) == []


# ----------------------------------------------------------------------------- property test

_KINDS = ["categorical", "multi_hot", "sequence", "numeric"]
_DEMO_RAW = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_SCALARS = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.integers(max_value=-1),
    st.floats(),  # nan and inf included
    _TEXT,
    st.sampled_from(["", "0", "true", "null", "categorical", "user", "click", "auc"]),
    st.booleans(),
    st.none(),
)
_VALUES = st.one_of(
    _SCALARS,
    st.lists(_SCALARS, max_size=3),
    st.dictionaries(_TEXT, _SCALARS, max_size=3),
    st.lists(st.dictionaries(_TEXT, _SCALARS, max_size=2), max_size=2),
)


def _paths(node, prefix=()):
    """Every path in a raw config, containers included (the root is `()`)."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


def _get(node, path):
    for key in path:
        node = node[key]
    return node


def _mutate(raw, data):
    """Applies one random mutation to `raw` in place; returns the (new) root."""
    op = data.draw(st.sampled_from(["delete", "replace", "add_key", "rename_kind"]))
    paths = list(_paths(raw))
    if op == "delete":
        path = data.draw(st.sampled_from(paths))
        if not path:
            return raw
        del _get(raw, path[:-1])[path[-1]]
    elif op == "replace":
        path = data.draw(st.sampled_from(paths))
        value = data.draw(_VALUES)
        if not path:
            return value
        _get(raw, path[:-1])[path[-1]] = value
    elif op == "add_key":
        mappings = [p for p in paths if isinstance(_get(raw, p), dict)]
        if mappings:
            node = _get(raw, data.draw(st.sampled_from(mappings)))
            node[data.draw(_TEXT)] = data.draw(_VALUES)
    else:
        features = raw.get("features") if isinstance(raw, dict) else None
        items = (
            [f for f in features or [] if isinstance(f, dict)] if isinstance(features, list) else []
        )
        if items:
            feature = data.draw(st.sampled_from(items))
            feature["kind"] = data.draw(st.one_of(st.sampled_from(_KINDS), _TEXT))
    return raw


@settings(
    max_examples=300,
    database=None,  # write nothing to the working directory
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_mutated_configs_load_or_fail_in_one_line(tmp_path, data):
    raw = copy.deepcopy(_DEMO_RAW)
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        raw = _mutate(raw, data)
    file = tmp_path / "mutated.yaml"
    file.write_text(yaml.dump(raw, Dumper=_DUMPER, allow_unicode=True), encoding="utf-8")

    for load in (lambda: load_config(str(file)), lambda: config_from_dict(copy.deepcopy(raw))):
        try:
            config = load()
        except RecflowError as e:
            assert_one_line(str(e))
            assert not str(e).startswith(": ")
            continue
        # A config that loads survives the round trip unchanged.
        assert repr(config_from_dict(to_dict(config))) == repr(config)


def test_mutation_ops_reach_the_loader(tmp_path):
    """Sanity check of the property test's helpers on a fixed mutation."""
    raw = copy.deepcopy(_DEMO_RAW)
    paths = list(_paths(raw))
    assert () in paths and ("features", 0, "kind") in paths
    raw["features"][0]["kind"] = "numeric"  # a numeric feature cannot have dtype/table
    with pytest.raises(ConfigError, match=r"^features\[0\]: unknown key '(dtype|table)'"):
        config_from_dict(raw)


# ----------------------------------------------------------------------------- issue 19
# Each test below failed before the fix it names (issue 19's findings 4, 6, 9, 10, 11).

MMOE = Path(__file__).resolve().parent.parent / "configs" / "mmoe.yaml"


def test_feature_reading_the_label_column_is_refused(tmp_path):
    """Finding 4: `{name: leak, column: click}` trained with train AUC 1.0."""
    raw = base_raw()
    raw["features"].append({"name": "leak", "kind": "categorical", "column": "click"})
    file = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == (
        f"{file}: features[8].column: reads the label column 'click': the label would leak in"
    )
    # a numeric feature, and the label of any task of a multi-task config
    raw = yaml.safe_load(MMOE.read_text(encoding="utf-8"))
    raw["features"].insert(1, {"name": "years", "kind": "numeric", "column": "age"})
    with pytest.raises(ConfigError, match=r"^features\[1\]\.column: reads the label column 'age'"):
        config_from_dict(raw)
    # another column is fine, and so is a column named like a feature
    raw = base_raw()
    raw["features"].append({"name": "user_copy", "kind": "categorical", "column": "user_id"})
    assert load_config(write(tmp_path, raw)).features[-1].source == "user_id"


@pytest.mark.parametrize(
    "text, line, first, key",
    [
        ("version: 1\ntrain: {steps: 3}\ndata: {}\ntrain:\n  epochs: 2\n", 4, 2, "train"),
        (
            "version: 1\ndata:\n  batch_size: 8\n  label: click\n  batch_size: 16\n",
            5,
            3,
            "batch_size",
        ),
        ("features:\n  - {name: a, kind: numeric, name: b}\n", 2, 2, "name"),
        (
            "model:\n  params:\n    dnn: {hidden_units: [4]}\n    fm: true\n    dnn: {}\n",
            5,
            3,
            "dnn",
        ),
    ],
    ids=["top-level", "nested", "same-line-flow", "inside-params"],
)
def test_duplicate_yaml_keys_are_refused_naming_both_lines(tmp_path, text, line, first, key):
    """Finding 6: a second `train:` block silently replaced the first."""
    file = tmp_path / "config.yaml"
    file.write_text(text, encoding="utf-8")
    with pytest.raises(RecflowError) as info:
        load_config(str(file))
    assert str(info.value) == f"{file}:{line}: duplicate key {key!r} (first at line {first})"


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    """A key given next to `<<:` overrides the merged one, as YAML says: no duplicate."""
    assert "  user: {dim: 8}\n" in BASE
    file = tmp_path / "merge.yaml"
    file.write_text(BASE.replace("  user: {dim: 8}\n", "  user:\n    <<: {dim: 4}\n    dim: 8\n"))
    assert load_config(str(file)).tables["user"].dim == 8


def test_duplicate_key_in_a_set_value(tmp_path):
    with pytest.raises(RecflowError) as info:
        load_config(write(tmp_path, base_raw()), ["model.params={fm: true, fm: false}"])
    assert str(info.value) == "--set model.params={fm: true, fm: false}: duplicate key 'fm'"


def test_exponent_numbers_are_numbers(tmp_path):
    """YAML 1.1 read `1e13` as a string ('expected a number, got '1e300''); a whole
    number written with an exponent is an integer where one is expected."""
    raw = base_raw()
    text = yaml.safe_dump(raw, sort_keys=False)
    text = text.replace("learning_rate: 0.001", "learning_rate: 1e-3", 1)
    text = text.replace("  user:\n    dim: 8\n", "  user:\n    dim: 8\n    expected_keys: 1e6\n", 1)
    file = tmp_path / "exp.yaml"
    file.write_text(text, encoding="utf-8")
    config = load_config(str(file))
    assert config.train.optimizer.learning_rate == 0.001
    assert config.tables["user"].expected_keys == 1_000_000
    assert type(config.tables["user"].expected_keys) is int


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.optimizer.learning_rate=1e300",
            "train.optimizer.learning_rate: out of range: "
            "1e+300 (numbers are computed in float32: |x| <= 3.4e38)",
        ),
        (
            "features.price.default=-4e38",
            "features[5].default: out of range: -4e+38 "
            "(numbers are computed in float32: |x| <= 3.4e38)",
        ),
        ("features.price.default=1e400", "features[5].default: expected a finite number, got inf"),
        (
            "train.steps=1e300",
            "train.steps: out of range: 1e+300 (integers are int64: |x| <= 2**63 - 1)",
        ),
        (
            "train.steps=9223372036854775808",
            "train.steps: out of range: 9223372036854775808 (integers are int64: |x| <= 2**63 - 1)",
        ),
        ("train.steps=2.5e0", "train.steps: expected an integer, got 2.5"),
        (
            "train.steps=" + "9" * 50,
            "train.steps: out of range: an integer of 50 digits (integers are int64: |x| <= 2**63 - 1)",
        ),
        (
            "train.optimizer.learning_rate=" + "9" * 50,
            "train.optimizer.learning_rate: out of range: an integer of 50 digits "
            "(numbers are computed in float32: |x| <= 3.4e38)",
        ),
        (
            "train.steps=1.5e17",
            "train.steps: expected an integer, got 1.5e+17 "
            "(exact with an exponent up to 2**53: write the digits)",
        ),
        ("train.seed=-1", "train.seed: expected an integer in [0, 2**32 - 1], got -1"),
        (
            "data.seed=4294967296",
            "data.seed: expected an integer in [0, 2**32 - 1], got 4294967296",
        ),
        (
            "data.synthetic.seed=-3",
            "data.synthetic.seed: expected an integer in [0, 2**32 - 1], got -3",
        ),
    ],
)
def test_numbers_out_of_range(tmp_path, override, message):
    """Finding 9/10: these ended in a NumPy or TensorFlow traceback, or named no range."""
    raw = base_raw()
    raw["train"].pop("epochs")
    file = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file, [override])
    assert str(info.value) == f"{file}: {message}"


def test_integer_too_long_for_python_is_one_line(tmp_path):
    """Python refuses to read ints of more than 4300 digits (a ValueError traceback before)."""
    file = tmp_path / "long.yaml"
    file.write_text("version: 1\ntrain: {steps: " + "9" * 5000 + "}\n", encoding="utf-8")
    with pytest.raises(RecflowError) as info:
        load_config(str(file))
    assert str(info.value) == (
        f"{file}: line 2, column 16: invalid YAML: integer too long (more than 4300 digits)"
    )


def test_largest_values_in_range_are_accepted(tmp_path):
    raw = base_raw()
    raw["train"].pop("epochs")
    config = load_config(
        write(tmp_path, raw),
        [
            "train.seed=4294967295",
            "train.steps=9223372036854775807",
            "features.price.default=3.4e38",
        ],
    )
    assert config.train.seed == 2**32 - 1
    assert config.train.steps == 2**63 - 1
    assert config.feature("price").default == 3.4e38


def test_strings_that_look_like_numbers_survive_dump_and_load(tmp_path):
    """The resolved config dumped to MODEL_DIR/config.yaml quotes `'1e5'`, so it reads back."""
    raw = base_raw()
    raw["features"][2]["column"] = "1e5"  # a feature name starts with a letter; a column may not
    config = config_from_dict(raw)
    path = str(tmp_path / "resolved.yaml")
    dump_config(config, path)
    assert load_config(path) == config


def test_set_takes_the_path_form_errors_print(tmp_path):
    """Finding 10: `--set features[5].max_len=3` set a top-level key `features[5]`."""
    config = load_config(
        write(tmp_path, base_raw()), ["features[4].max_len=3", "task.metrics[1]=auc"]
    )
    assert config.feature("hist_items").max_len == 3  # the file's fifth feature line
    assert config.task.metrics == ("auc", "auc")
    file = write(tmp_path, base_raw())
    with pytest.raises(ConfigError) as info:
        load_config(file, ["features[0].max_len=3"])
    assert str(info.value) == (
        f"{file}: features[0]: unknown key 'max_len': it is for kind 'sequence' "
        "(allowed for kind 'categorical': column, dim, dtype, kind, name, table)"
    )
    with pytest.raises(RecflowError, match=r"^--set features\[x\]\.dim=3: expected KEY=VALUE"):
        load_config(file, ["features[x].dim=3"])


@pytest.fixture
def memory(monkeypatch):
    """This machine's memory, as the limits see it: 1 GB (10**9 bytes)."""
    from recflow.config import limits

    monkeypatch.setattr(limits, "physical_memory", lambda: 10**9)
    return 10**9


def test_expected_keys_beyond_memory_are_refused(tmp_path, memory):
    """Finding 9: `expected_keys: 1e13` ended in a TensorFlow OOM traceback. A key takes
    its 8-byte key and `dim` float32 values at least: user has dim 8, 40 bytes a key."""
    raw = base_raw()
    raw["tables"]["user"]["expected_keys"] = memory // 40  # exactly the memory: fits
    assert load_config(write(tmp_path, raw)).tables["user"].expected_keys == 25_000_000
    raw["tables"]["user"]["expected_keys"] = memory // 40 + 1
    file = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == (
        f"{file}: tables.user.expected_keys: 25000001 keys of dim 8 are allocated up front: "
        "at least 1 GB, more than this machine's memory (1 GB)"
    )
    # two tables that fit alone but not together (item: dim 16, 72 bytes a key)
    raw["tables"]["user"]["expected_keys"] = 10_000_000  # 0.4 GB
    raw["tables"]["item"]["expected_keys"] = 9_000_000  # 0.648 GB, the larger share
    with pytest.raises(
        ConfigError,
        match=r"^tables\.item\.expected_keys: 9000000 keys of dim 16 "
        r"are allocated up front \(with the other tables' expected_keys\)",
    ):
        config_from_dict(raw)
    # on parameter servers the tables live in their memory, not this process's
    raw["distribute"] = {"strategy": "parameter_server"}
    assert config_from_dict(raw).tables["item"].expected_keys == 9_000_000


def test_synthetic_rows_beyond_memory_are_refused(tmp_path, memory):
    """Finding 9: a huge `synthetic.rows` ended in a NumPy MemoryError traceback (or ran
    into swap). 500 bytes a row: 2,000,000 rows (train + eval) is exactly 1 GB."""
    raw = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    raw["data"]["synthetic"].update(rows=1_960_000, eval_rows=40_000)
    assert load_config(write(tmp_path, raw)).data.synthetic.rows == 1_960_000
    raw["data"]["synthetic"]["rows"] = 1_960_001
    file = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == (
        f"{file}: data.synthetic.rows: 1960001 rows (+ 40000 eval rows) are generated in memory "
        "at once, 500 bytes a row or more: at least 1 GB, more than this machine's memory (1 GB)"
    )
    # plan and export read no data: the rows are not theirs to check
    assert load_config(file, needs_data=False).data.synthetic.rows == 1_960_001


def test_data_train_is_required_only_by_commands_that_read_data(tmp_path):
    """Finding 11: `recflow plan` and `recflow export` demanded data.train."""
    raw = base_raw()
    del raw["data"]["train"]
    file = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == (
        f"{file}: data.train: required for format 'csv' (in the file or --set data.train=PATH)"
    )
    assert load_config(file, needs_data=False).data.train == ()
    assert config_from_dict(raw).data.train == ()


def test_model_module_is_found_next_to_the_config_or_in_the_working_directory(
    tmp_path, monkeypatch
):
    """Finding 11: `model.type: "mymodule:Cls"` needed PYTHONPATH. The lookup runs before
    TensorFlow (no module code runs); a module found nowhere names where it looked."""
    import sys

    from recflow.config import model_module

    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "tower_next_to_config.py").write_text("raise AssertionError('not run')\n")
    (tmp_path / "tower_in_cwd.py").write_text("raise AssertionError('not run')\n")
    monkeypatch.chdir(tmp_path)
    raw = base_raw()
    raw["model"] = {"type": "tower_next_to_config:Tower"}
    config = load_config(write(folder, raw))
    assert config.model.type == "tower_next_to_config:Tower"
    assert model_module.folder_of("tower_next_to_config") == str(folder)
    raw["model"] = {"type": "tower_in_cwd.sub:Tower"}
    load_config(write(folder, raw))
    assert model_module.folder_of("tower_in_cwd.sub") == str(tmp_path)
    assert "tower_next_to_config" not in sys.modules and "tower_in_cwd" not in sys.modules
    raw["model"] = {"type": "tower_nowhere:Tower"}
    file = write(folder, raw)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == (
        f"{file}: model.type: no module 'tower_nowhere' on the Python path, in the config's "
        f"folder {folder}, or in the working directory {tmp_path}"
    )
