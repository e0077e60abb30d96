"""Typed conversion of plain YAML values into frozen dataclasses.

One generic mechanism reads every section of the config: the dataclass field
types say what is allowed, defaults live on the dataclasses, and every error
carries the dotted path of the offending value.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, Union

from recflow.errors import ConfigError

# A dataclass may declare `__discriminator__ = ("kind", {"categorical": Cls, ...})`
# on a base type to pick the concrete class from one key, and `__extra__ = "kwargs"`
# to collect the keys it does not declare into its `dict` field `kwargs` (keyword
# arguments of a class that the schema does not know, e.g. a Keras optimizer's).


_REGISTERED: dict[type, dict[str, type]] = {}  # base -> choices added by extensions


def register_choice(base: type, name: str, cls: type) -> None:
    """Adds `name` -> dataclass `cls` to the `kind`/`type` choices of a discriminated
    section (`Feature`, `OptimizerSpec`): how a registered extension's config is read.
    The schema's own choices (and so the configuration reference) stay as they are.

    Raises:
        ValueError: `name` already selects another class, or `cls` is not a dataclass
            with the discriminating field.
    """
    key, family = base.__discriminator__
    if not dataclasses.is_dataclass(cls) or key not in {f.name for f in dataclasses.fields(cls)}:
        raise ValueError(f"{cls!r} must be a dataclass with a `{key}` field")
    registered = _REGISTERED.setdefault(base, {})
    if {**family, **registered}.get(name, cls) is not cls:
        raise ValueError(f"{key} {name!r} already selects another class")
    registered[name] = cls


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
    if value is None and origin is tuple:
        return ()  # `--set data.eval=null` removes a list: no items
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
        return _integer(value, path)
    if tp is float:
        return _number(value, path)
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


# Integers go to TensorFlow and NumPy as int64; numbers are computed in float32.
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
_EXACT_FLOAT_INT = 2**53  # floats up to here hold every integer exactly


def _integer(value: Any, path: str) -> int:
    """An int; a float written for one (`1e6`, `8.0`) counts when it is a whole number."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        if abs(value) >= 2**63:
            raise ConfigError(path, f"out of range: {value:g} (integers are int64: |x| <= 2**63 - 1)")
        if abs(value) > _EXACT_FLOAT_INT:
            raise ConfigError(
                path, f"expected an integer, got {value:g} (exact with an exponent up to 2**53: write the digits)"
            )
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {_describe(value)}")
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(path, f"out of range: {_huge(value)} (integers are int64: |x| <= 2**63 - 1)")
    return value


def _huge(value: int) -> str:
    """A large int for a message: its digits, or its length when they would not read."""
    if value.bit_length() <= 128:
        return str(value)
    return f"an integer of {len(str(abs(value))) if value.bit_length() < 14000 else 'over 4000'} digits"


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, f"expected a number, got {_describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, f"expected a finite number, got {_describe(value)}")
    if abs(value) > FLOAT32_MAX:
        shown = f"{value:g}" if isinstance(value, float) else _huge(value)
        raise ConfigError(
            path, f"out of range: {shown} (numbers are computed in float32: |x| <= 3.4e38)"
        )
    return float(value)


def _unknown_key(
    key: Any,
    allowed: Iterable[str],
    family: dict[str, type] | None = None,
    disc: str | None = None,
    kind: str | None = None,
) -> str:
    """The message for a key a section does not have: the kind it belongs to (a key of
    another `kind` or `type` of the same section), a close spelling, or the keys allowed."""
    names = sorted(allowed)
    if family and disc:
        owners = [k for k, c in family.items() if key in {f.name for f in dataclasses.fields(c)}]
        if owners:
            kinds = " or ".join(repr(k) for k in owners)
            return (
                f"unknown key {key!r}: it is for {disc} {kinds} "
                f"(allowed for {disc} {kind!r}: {', '.join(names)})"
            )
    close = _close_match(str(key), names)
    if close:
        return f"unknown key {key!r} (did you mean {close!r}?)"
    return f"unknown key {key!r} (allowed: {', '.join(names)})"


def _close_match(key: str, names: list[str]) -> str | None:
    """A name that `key` misspells (`knd`) or lengthens (`dimension` for `dim`)."""
    longer = [n for n in names if len(n) >= 3 and key.startswith(n)]
    if longer:
        return max(longer, key=len)
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    return close[0] if close else None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints evaluates the string annotations: slow, and the same every time.
    return typing.get_type_hints(cls)


def from_dict(cls: type, value: Any, path: str = "") -> Any:
    """Builds dataclass `cls` from a mapping; unknown keys are errors."""
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
    family = disc = kind = None
    if cls.__dict__.get("__discriminator__") is not None:
        disc, family = cls.__discriminator__
        registered = _REGISTERED.get(cls, {})
        # Messages list the named choices: a `module:Class` one belongs to the config
        # that named it, not to every config this process reads.
        family = {**family, **{k: c for k, c in registered.items() if ":" not in k}}
        kind = value.get(disc)
        if isinstance(kind, str) and kind in registered:
            family = {**family, kind: registered[kind]}
        if not isinstance(kind, str) or kind not in family:  # a list or mapping is unhashable
            where = f"{path}.{disc}" if path else disc
            if kind is None:
                known = {f.name for c in family.values() for f in dataclasses.fields(c) if f.init}
                for key in value:  # `knd: categorical` is a misspelt kind, not a missing one
                    if key not in known:
                        raise ConfigError(path, _unknown_key(key, known))
                raise ConfigError(where, f"missing; expected one of {', '.join(map(repr, family))}")
            raise ConfigError(
                where, f"expected one of {', '.join(map(repr, family))}, got {_describe(kind)}"
            )
        cls = family[kind]
    hints = _hints(cls)
    extra = cls.__dict__.get("__extra__")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != extra}
    kwargs = {}
    for key, item in value.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            if extra is not None and isinstance(key, str):
                kwargs.setdefault(extra, {})[key] = item
                continue
            raise ConfigError(path, _unknown_key(key, fields, family, disc, kind))
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
        extra = type(obj).__dict__.get("__extra__")
        out = {
            f.name: to_dict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.init and f.name != extra
        }
        if extra is not None:
            out.update(to_dict(getattr(obj, extra)))
        return out
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
