"""Reading a config file: YAML, `--set` overrides, typed conversion, cross checks."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from typing import Any

import yaml

from recflow.atomic import write_text
from recflow.config import limits, model_module
from recflow.config.convert import from_dict, register_choice, to_dict
from recflow.config.schema import (
    Config,
    Feature,
    OptimizerSpec,
    check_kafka,
)
from recflow.errors import ConfigError, RecflowError


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b.c=value` into (["a", "b", "c"], parsed YAML value)."""
    key, sep, raw = text.partition("=")
    keys = _split_key(key) if sep else None
    if not keys:
        raise RecflowError(f"--set {text}: expected KEY=VALUE with a dotted KEY, e.g. train.steps=100")
    try:
        value = safe_load(raw) if raw.strip() else ""
    except NodeLimitError as e:
        raise RecflowError(f"--set {text}: {e}") from None
    except DuplicateKeyError as e:
        raise RecflowError(f"--set {text}: duplicate key {e.key!r}") from None
    except yaml.YAMLError as e:
        raise RecflowError(f"--set {text}: value is not valid YAML ({_first_line(e)})") from None
    return keys, value


_KEY_PART = re.compile(r"([^.\[\]]+)((?:\[[0-9]+\])*)")


def _split_key(key: str) -> list[str] | None:
    """`features[5].max_len` (the form errors print) or `features.5.max_len` -> parts;
    None when malformed."""
    keys: list[str] = []
    for part in key.split("."):
        match = _KEY_PART.fullmatch(part)
        if match is None:
            return None
        keys.append(match.group(1))
        keys += re.findall(r"[0-9]+", match.group(2))
    return keys


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Applies `--set` overrides to the raw mapping, creating missing sections."""
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for i, key in enumerate(keys[:-1]):
            child = _child(node, key, ".".join(keys[: i + 1]), text)
            if child is None:
                child = {}
                _assign(node, key, child, text)
            node = child
        _assign(node, keys[-1], value, text)
        # epochs and steps are alternatives: the one given last wins.
        other = {"steps": "epochs", "epochs": "steps"}.get(keys[-1])
        if keys[:-1] == ["train"] and other and value is not None and isinstance(node, dict):
            node.pop(other, None)
    return raw


def _child(node: Any, key: str, where: str, text: str) -> Any:
    if isinstance(node, list):
        index = _index(node, key, text)
        return node[index]
    if not isinstance(node, dict):
        raise RecflowError(f"--set {text}: {where} is not a mapping")
    return node.get(key)


def _assign(node: Any, key: str, value: Any, text: str) -> None:
    if isinstance(node, list):
        node[_index(node, key, text)] = value
    elif isinstance(node, dict):
        node[key] = value
    else:
        raise RecflowError(f"--set {text}: cannot set {key!r} inside a {type(node).__name__}")


def _index(node: list, key: str, text: str) -> int:
    # Lists are addressed by position (`features.0.dim`) or by the `name` of an item.
    if key.isdigit() and int(key) < len(node):
        return int(key)
    for i, item in enumerate(node):
        if isinstance(item, dict) and item.get("name") == key:
            return i
    raise RecflowError(f"--set {text}: no list item {key!r}")


MAX_NODES = 100_000  # YAML nodes after alias expansion; a real config has a few hundred


class NodeLimitError(ValueError):
    """A YAML document too large once aliases are expanded (an alias bomb) or recursive."""


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """The node count of `root` with every alias expanded, stopping past `limit`.

    Sizes are memoized per node, so the walk costs the document's own size even
    when expansion would be exponential.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            sizes[key] = 1
            continue
        if children_done:
            active.discard(key)
            size = 1 + sum(sizes[id(c)] for c in children)
            if size > limit:
                raise NodeLimitError(f"more than {limit} YAML nodes once aliases are expanded")
            sizes[key] = size
            continue
        if key in active:
            raise NodeLimitError("a YAML alias refers to a node that contains it")
        active.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in active:
                raise NodeLimitError("a YAML alias refers to a node that contains it")
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)]


class DuplicateKeyError(ValueError):
    """A mapping that names one key twice (YAML lets the last one win silently)."""

    def __init__(self, key, first: int, line: int):
        self.key, self.first, self.line = key, first, line
        super().__init__(f"duplicate key {key!r} (first at line {first})")


# YAML 1.1 (PyYAML) reads `1e13` and `1.0e5` as strings: its floats need a dot and a signed
# exponent. YAML 1.2 and every config a person writes mean numbers.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses duplicate keys and reads `1e13` as a number."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                    continue  # merged keys (`<<: *base`) may be overridden, as YAML says
                key = self.construct_object(key_node)  # a scalar: hashable
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python refuses to read ints of more than 4300 digits
            raise yaml.constructor.ConstructorError(
                None, None, "integer too long (more than 4300 digits)", node.start_mark
            ) from None


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)


class StrictDumper(yaml.SafeDumper):
    """Quotes the strings `StrictLoader` would read as numbers (`'1e5'`)."""


for _cls in (StrictLoader, StrictDumper):
    _cls.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+.0123456789"))


def safe_load(text: str, limit: int = MAX_NODES):
    """YAML through `StrictLoader`, refusing documents over `limit` nodes after alias
    expansion before any Python object is built.

    Raises:
        NodeLimitError: too many nodes, or a recursive alias.
        DuplicateKeyError: a mapping names a key twice.
        yaml.YAMLError: a syntax error.
    """
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, limit)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _first_line(error: Exception) -> str:
    return " ".join(str(error).split())


def read_yaml(path: str) -> dict:
    """Reads a YAML mapping; syntax errors name the line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise RecflowError(f"{path}: cannot read config ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise RecflowError(f"{path}: cannot read config (not UTF-8 text at byte {e.start})") from None
    try:
        raw = safe_load(text)
    except NodeLimitError as e:
        raise RecflowError(f"{path}: {e}") from None
    except DuplicateKeyError as e:
        raise RecflowError(f"{path}:{e.line}: {e}") from None
    except RecursionError:
        raise RecflowError(f"{path}: YAML nested too deeply") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RecflowError(f"{path}: {line}invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise RecflowError(f"{path}: invalid YAML: {_first_line(e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecflowError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def load_config(
    path: str, overrides: Iterable[str] = (), needs_data: bool = True, needs_model: bool = True
) -> Config:
    """Loads, overrides and validates a config file.

    Args:
        path: the YAML file; a `model.type: "module:Class"` module is also looked for
            in its folder.
        overrides: `--set` items, `KEY=VALUE`.
        needs_data: the command reads the data (train, evaluate, data check): then
            `data.train` is required and the synthetic rows must fit in memory.
            `plan` and `export` read none.
        needs_model: the command builds the model, so a `module:Class` model's module
            must be found (`recflow tables` reads the tables only).

    Raises:
        RecflowError: one line naming the file and the offending path.
    """
    raw = apply_overrides(read_yaml(path), overrides)
    try:
        config = config_from_dict(raw, os.path.dirname(os.path.abspath(path)), needs_model)
        if needs_data:
            check_data(config)
    except ConfigError as e:
        raise e.with_file(path) from None
    return config


def config_from_dict(raw: dict, config_dir: str | None = None, needs_model: bool = True) -> Config:
    """Converts and cross-checks a raw mapping; `config_dir` is where a `module:Class`
    model's module may live besides the Python path and the working directory (looked
    for only when `needs_model`).

    The features come out sorted by name: the order of the config's lines then
    decides nothing (table slots, the fusion plan and the tower's inputs all follow
    this order), so reordering them cannot scramble a trained model.
    """
    read_extensions(raw, config_dir)
    config = from_dict(Config, raw)
    check_references(config)
    check_memory(config)
    if needs_model:
        model_module.locate(config.model.type, config_dir)
    for path, type_name in _extension_names(config):
        model_module.locate(type_name, config_dir, path)
    return dataclasses.replace(config, features=tuple(sorted(config.features, key=lambda f: f.name)))


def _items(node: Any, *keys: str) -> Iterable[tuple[str, Any]]:
    """(dotted path, value) of `raw[keys[0]][keys[1]]...`, where every step is a mapping
    (`*` for each entry of a mapping, `[]` for each item of a list)."""
    found = [("", node)]
    for key in keys:
        step = []
        for path, value in found:
            if key == "[]" and isinstance(value, list):
                step += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
            elif key == "*" and isinstance(value, dict):
                step += [(f"{path}.{k}".lstrip("."), v) for k, v in value.items()]
            elif isinstance(value, dict) and key in value:
                step.append((f"{path}.{key}".lstrip("."), value[key]))
        found = step
    return found


# Sections whose schema an extension brings: (base with `__discriminator__`, raw path).
_SCHEMA_EXTENSIONS = (
    (Feature, ("features", "[]", "kind")),
    (OptimizerSpec, ("train", "sparse_optimizer", "type")),
    (OptimizerSpec, ("tables", "*", "optimizer", "type")),
)


def read_extensions(raw: dict, config_dir: str | None) -> None:
    """Imports the `"module:ClassName"` extensions whose config keys the schema must know
    before it reads the file (feature kinds, sparse optimizers), adding each class's
    `config_class` to its section's choices.

    Only a config that names such a class imports it here (its module imports
    TensorFlow); every other config is still checked before TensorFlow loads.
    """
    for base, keys in _SCHEMA_EXTENSIONS:
        for path, type_name in _items(raw, *keys):
            if not model_module.is_class_path(type_name):
                continue
            model_module.locate(type_name, config_dir, path)
            cls = model_module.import_class(type_name, path)
            config_class = getattr(cls, "config_class", None)
            try:
                register_choice(base, type_name, config_class)
            except ValueError as e:
                raise ConfigError(path, f"{type_name!r}: `config_class`: {e}") from None


def _extension_names(config: Config) -> list[tuple[str, str]]:
    """(path, value) of the config's other `module:ClassName` values (imported when the
    model is built)."""
    names = [("task.type", config.task.type), ("train.optimizer.type", config.train.optimizer.type)]
    names += [(f"task.tasks[{i}].type", t.type) for i, t in enumerate(config.task.tasks)]
    return [(path, name) for path, name in names if model_module.is_class_path(name)]


def check_data(config: Config) -> None:
    """Checks what only a command that reads the data needs."""
    data = config.data
    if data.format == "kafka":
        check_kafka(config)
        return
    if data.format != "synthetic":
        if not data.train:
            raise ConfigError(
                "data.train",
                f"required for format {data.format!r} (in the file or --set data.train=PATH)",
            )
        return
    rows = data.synthetic.rows + data.synthetic.eval_rows
    reason = limits.beyond_memory(rows * limits.SYNTHETIC_ROW_BYTES)
    if reason is not None:
        raise ConfigError(
            "data.synthetic.rows",
            f"{data.synthetic.rows} rows (+ {data.synthetic.eval_rows} eval rows) are generated "
            f"in memory at once, {limits.SYNTHETIC_ROW_BYTES} bytes a row or more: {reason}",
        )


def check_memory(config: Config) -> None:
    """Tables sized up front (`expected_keys`) must fit in memory when they live in this
    process (`distribute.strategy: local`); each key takes its 8-byte key and `dim`
    float32 values at least."""
    if config.distribute.strategy != "local":
        return  # the tables are spread over the parameter servers' memory
    sized = {n: t for n, t in config.tables.items() if t.expected_keys}
    total = sum(t.expected_keys * (8 + 4 * t.dim) for t in sized.values())
    reason = limits.beyond_memory(total)
    if reason is None:
        return
    name = max(sized, key=lambda n: sized[n].expected_keys * (8 + 4 * sized[n].dim))
    table = sized[name]
    together = " (with the other tables' expected_keys)" if len(sized) > 1 else ""
    raise ConfigError(
        f"tables.{name}.expected_keys",
        f"{table.expected_keys} keys of dim {table.dim} are allocated up front{together}: {reason}",
    )


def check_references(config: Config) -> None:
    """Checks what spans sections: names, table links, labels, group_by."""
    if not config.features:
        raise ConfigError("features", "expected at least one feature")
    seen: dict[str, int] = {}
    signature_names: dict[str, int] = {}  # as an export's signature tells its inputs apart
    first: dict[str, Feature] = {}  # per table: its first feature
    for i, f in enumerate(config.features):
        if f.name in seen:
            raise ConfigError(f"features[{i}].name", f"duplicate feature name {f.name!r}")
        seen[f.name] = i
        clash = signature_names.setdefault(f.name.lower().replace("-", "_"), i)
        if clash != i:
            raise ConfigError(
                f"features[{i}].name",
                f"{f.name!r} and {config.features[clash].name!r} (features[{clash}]) are one input "
                "name in an export's signature (it tells neither case nor '-' from '_' apart); rename one",
            )
        if f.is_sparse and f.table is not None and f.table not in config.tables:
            known = ", ".join(sorted(config.tables)) or "none defined"
            raise ConfigError(f"features[{i}].table", f"no table {f.table!r} (tables: {known})")
        if f.is_sparse and f.table is None and f.name in config.tables:
            raise ConfigError(
                f"features[{i}].table",
                f"a table named {f.name!r} exists; set `table: {f.name}` to use it",
            )
        # One dtype a table: an int64 id's key is its value, a string's its fingerprint.
        sharing = first.setdefault(f.table_name, f) if f.is_sparse else None
        if sharing is not None and sharing.dtype != f.dtype:
            raise ConfigError(
                f"features[{i}].dtype",
                f"{f.dtype}, but {sharing.name!r} reads table {f.table_name!r} as {sharing.dtype}: "
                f"the same id would be two keys there; give the features of a table one dtype",
            )
    if not config.sparse_features:
        raise ConfigError("features", "expected at least one categorical, multi_hot or sequence feature")
    for name in config.tables:
        if name not in config.table_names():
            raise ConfigError(f"tables.{name}", "defined but used by no feature")
    labels = config.labels
    for i, label in enumerate(labels):
        if label in seen:
            raise ConfigError(f"data.label[{i}]", f"{label!r} is also a feature")
    for i, f in enumerate(config.features):
        if f.source in labels:
            raise ConfigError(
                f"features[{i}].column", f"reads the label column {f.source!r}: the label would leak in"
            )
    if config.task.type == "multitask":
        names = [t.name for t in config.task.tasks]
        if len(set(names)) != len(names):
            raise ConfigError("task.tasks", "task names must be unique")
        for i, t in enumerate(config.task.tasks):
            other = next(o for o in config.task.tasks if o.label == t.label)
            if other is not t:
                raise ConfigError(
                    f"task.tasks[{i}].label",
                    f"{t.label!r} is also task {other.name!r}'s label; each task reads its own label column",
                )
        if config.data.label and set(config.data.label) != set(labels):
            raise ConfigError(
                "data.label",
                f"the labels come from task.tasks ({', '.join(labels)}); remove data.label",
            )
    elif not config.data.label:
        raise ConfigError("data.label", "required")
    elif len(config.data.label) != 1:
        raise ConfigError("data.label", f"expected one label for task type {config.task.type!r}")
    for column in config.data.positive:
        if column not in labels:
            raise ConfigError(f"data.positive.{column}", f"not a label (labels: {', '.join(labels)})")
    group_by = config.task.group_by
    if group_by is not None and group_by not in seen:
        raise ConfigError("task.group_by", f"no feature {group_by!r}")
    if group_by is not None and config.features[seen[group_by]].kind in ("multi_hot", "sequence"):
        kind = config.features[seen[group_by]].kind
        raise ConfigError("task.group_by", f"{group_by!r} is a {kind} feature (several ids a row); group by one id a row")
    if group_by is not None and config.features[seen[group_by]].kind == "numeric":
        raise ConfigError(
            "task.group_by",
            f"{group_by!r} is a numeric feature (gauc would group by its normalized value, not "
            "its values); group by a categorical feature",
        )


def dump_config(config: Config, path: str) -> None:
    """Writes the resolved config as YAML, atomically (no temp file is left on failure)."""
    write_text(path, yaml.dump(to_dict(config), Dumper=StrictDumper, sort_keys=False))
