"""Reading a config file: YAML, `--set` overrides, typed conversion, cross checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import yaml

from recflow.atomic import write_text
from recflow.config.convert import from_dict, to_dict
from recflow.config.schema import Config, SequenceFeature
from recflow.errors import ConfigError, RecflowError


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b.c=value` into (["a", "b", "c"], parsed YAML value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecflowError(f"--set {text}: expected KEY=VALUE with a dotted KEY, e.g. train.steps=100")
    try:
        value = safe_load(raw) if raw.strip() else ""
    except NodeLimitError as e:
        raise RecflowError(f"--set {text}: {e}") from None
    except yaml.YAMLError as e:
        raise RecflowError(f"--set {text}: value is not valid YAML ({_first_line(e)})") from None
    return key.split("."), value


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


def safe_load(text: str, limit: int = MAX_NODES):
    """`yaml.safe_load`, refusing documents over `limit` nodes after alias expansion
    before any Python object is built."""
    loader = yaml.SafeLoader(text)
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


def load_config(path: str, overrides: Iterable[str] = ()) -> Config:
    """Loads, overrides and validates a config file.

    Raises:
        RecflowError: one line naming the file and the offending path.
    """
    raw = apply_overrides(read_yaml(path), overrides)
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise e.with_file(path) from None


def config_from_dict(raw: dict) -> Config:
    """Converts and cross-checks a raw mapping.

    The features come out sorted by name: the order of the config's lines then
    decides nothing (table slots, the fusion plan and the tower's inputs all follow
    this order), so reordering them cannot scramble a trained model.
    """
    config = from_dict(Config, raw)
    check_references(config)
    return dataclasses.replace(config, features=tuple(sorted(config.features, key=lambda f: f.name)))


def check_references(config: Config) -> None:
    """Checks what spans sections: names, table links, labels, group_by."""
    if not config.features:
        raise ConfigError("features", "expected at least one feature")
    seen: dict[str, int] = {}
    for i, f in enumerate(config.features):
        if f.name in seen:
            raise ConfigError(f"features[{i}].name", f"duplicate feature name {f.name!r}")
        seen[f.name] = i
        if f.is_sparse and f.table is not None and f.table not in config.tables:
            known = ", ".join(sorted(config.tables)) or "none defined"
            raise ConfigError(f"features[{i}].table", f"no table {f.table!r} (tables: {known})")
        if f.is_sparse and f.table is None and f.name in config.tables:
            raise ConfigError(
                f"features[{i}].table",
                f"a table named {f.name!r} exists; set `table: {f.name}` to use it",
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
    if config.task.type == "multitask":
        names = [t.name for t in config.task.tasks]
        if len(set(names)) != len(names):
            raise ConfigError("task.tasks", "task names must be unique")
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
    for i, f in enumerate(config.features):
        if isinstance(f, SequenceFeature) and f.dtype not in ("int64", "string"):
            raise ConfigError(f"features[{i}].dtype", "expected 'int64' or 'string'")


def dump_config(config: Config, path: str) -> None:
    """Writes the resolved config as YAML, atomically (no temp file is left on failure)."""
    write_text(path, yaml.safe_dump(to_dict(config), sort_keys=False))
