"""Typed conversion of plain YAML values into frozen dataclasses.

One generic mechanism reads every section of the config: the dataclass field
types say what is allowed, defaults live on the dataclasses, and every error
carries the dotted path of the offending value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal, Union

from recflow.errors import ConfigError

# A dataclass may declare `__discriminator__ = ("kind", {"categorical": Cls, ...})`
# on a base type to pick the concrete class from one key.


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (dict, list)):
        return type(value).__name__
    return repr(value)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def convert(value: Any, tp: Any, path: str) -> Any:
    """Converts `value` to type `tp`, raising ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if type(None) in typing.get_args(tp):
                return None
        if len(args) == 1:
            return convert(value, args[0], path)
        errors = []
        for arg in args:
            try:
                return convert(value, arg, path)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if value is None:
        raise ConfigError(path, f"expected {_type_name(tp)}, got null")
    if origin is Literal:
        allowed = typing.get_args(tp)
        # Compare types too: `true` and `1.0` are not the literal 1.
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise ConfigError(
                path, f"expected one of {', '.join(repr(a) for a in allowed)}, got {_describe(value)}"
            )
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(path, f"expected a finite number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {_describe(value)}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if isinstance(value, dict):
            raise ConfigError(path, f"expected a list, got {_describe(value)}")
        if not isinstance(value, list):
            value = [value]  # a scalar stands for a one-element list
        return tuple(convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(path, f"expected string keys, got {_describe(k)}")
            out[k] = convert(v, val_tp, f"{path}.{k}" if path else k)
        return out
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    raise TypeError(f"unsupported config type {tp!r} at {path}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints evaluates the string annotations: slow, and the same every time.
    return typing.get_type_hints(cls)


def from_dict(cls: type, value: Any, path: str = "") -> Any:
    """Builds dataclass `cls` from a mapping; unknown keys are errors."""
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
    disc = getattr(cls, "__discriminator__", None)
    if disc is not None and cls.__dict__.get("__discriminator__") is not None:
        key, choices = disc
        kind = value.get(key)
        if not isinstance(kind, str) or kind not in choices:  # a list or mapping is unhashable
            where = f"{path}.{key}" if path else key
            if kind is None:
                raise ConfigError(where, f"missing; expected one of {', '.join(map(repr, choices))}")
            raise ConfigError(
                where, f"expected one of {', '.join(map(repr, choices))}, got {_describe(kind)}"
            )
        cls = choices[kind]
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, item in value.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(where, f"unknown key (allowed: {known})")
        kwargs[key] = convert(item, hints[key], where)
    for name, field in fields.items():
        no_default = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if no_default and name not in kwargs:
            raise ConfigError(f"{path}.{name}" if path else name, "required")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError as e:
            raise ConfigError(f"{path}.{e.path}" if path and e.path else (e.path or path), e.message) from None
    return obj


def to_dict(obj: Any) -> Any:
    """The inverse of `from_dict`: plain YAML-able values."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
