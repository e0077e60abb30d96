"""The configuration reference (docs/configuration-reference.md), generated from the schema.

Every key of `recflow.config.schema` with its type, default, allowed values and
a one-line description. The descriptions are the `Attributes:` sections of the
dataclasses' docstrings (inherited fields from the base classes' docstrings):

    @dataclass(frozen=True)
    class CsvOptions:
        \"\"\"CSV parsing.

        Attributes:
            delimiter: the field separator, one character.
        \"\"\"

A field without a description is an error, so a new key cannot ship
undocumented. Regenerate the page with

    python -m recflow.config.reference docs/configuration-reference.md

(`tests/test_docs.py` fails while the page is stale).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
import types
import typing
from typing import Any, Literal, Union

from recflow.config import schema

HEADER = """# Configuration reference

Every key of a recflow config, generated from the schema's dataclasses
(`recflow/config/schema.py`) by `python -m recflow.config.reference`; do not
edit this page by hand. [Configuration](configuration.md) explains how the
sections fit together. Unknown keys are errors; a list key also takes a single
value (a list of one); `--set KEY=VALUE` overrides any key on the command line.
"""


@functools.cache
def descriptions(cls: type) -> dict[str, str]:
    """The `Attributes:` descriptions of a dataclass's fields, base classes' included."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update(_attributes(inspect.getdoc(klass) if "__doc__" in klass.__dict__ else None))
    return out


def _attributes(doc: str | None) -> dict[str, str]:
    """`name: text` entries of a docstring's `Attributes:` section (continuation lines joined)."""
    out: dict[str, str] = {}
    if not doc:
        return out
    lines = doc.splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return out
    name = None
    for line in lines[start:]:
        if line and not line.startswith(" "):  # the next section
            break
        match = re.match(r"^ {4}(\w+): (.*)$", line)
        if match:
            name = match.group(1)
            out[name] = match.group(2).strip()
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def describe(cls: type, name: str) -> str:
    """The one-line description of field `name` of dataclass `cls` (e.g. for `--help`)."""
    return descriptions(cls)[name]


# ----------------------------------------------------------------------------- types


def _strip_none(tp: Any) -> tuple[Any, bool]:
    """(`tp` without None, whether None is allowed)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], type(None) in args
        return Union[tuple(rest)], type(None) in args  # noqa: UP007
    return tp, False


def _choices(tp: Any) -> tuple[str, dict[str, type]] | None:
    """The (key, {value: class}) dispatch of a discriminated base class, else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp.__dict__.get("__discriminator__")
    return None


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"' if value in ("", "|", ",") or value != value.strip() else value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


class _Page:
    """Walks the schema from `Config`, depth first, and renders one section per dataclass."""

    def __init__(self, used_at: dict[type, list[str]] | None = None) -> None:
        self.anchors: dict[type, str] = {}
        self.pending: list[tuple[type, str]] = []  # sections reached by the section being rendered
        # class -> the paths it is reached at (complete only after a whole walk)
        self.used_at: dict[type, list[str]] = used_at if used_at is not None else {}

    def anchor(self, cls: type, path: str) -> str:
        """The anchor of `cls`'s section; the section is rendered after the current one."""
        paths = self.used_at.setdefault(cls, [])
        if path not in paths:
            paths.append(path)
        if cls not in self.anchors:
            self.anchors[cls] = re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")
            self.pending.append((cls, path))
        return self.anchors[cls]

    def type_text(self, tp: Any, path: str) -> str:
        """What a value of type `tp` may be, with links to the sections it opens."""
        tp, nullable = _strip_none(tp)
        text = self._type_text(tp, path)
        return f"{text}, or `null`" if nullable else text

    def _type_text(self, tp: Any, path: str) -> str:
        origin = typing.get_origin(tp)
        if origin is Literal:
            args = typing.get_args(tp)
            if len(args) == 1:
                return f"`{_yaml(args[0])}`"
            return "one of " + ", ".join(f"`{_yaml(a)}`" for a in args)
        if origin in (Union, types.UnionType):
            return " or ".join(self._type_text(a, path) for a in typing.get_args(tp))
        if origin is tuple:
            return f"list of {self._type_text(typing.get_args(tp)[0], path + '[]')}"
        if origin is dict:
            value = typing.get_args(tp)[1]
            if value is Any:
                return "mapping"
            return f"mapping of name to {self._type_text(value, path + '.<name>')}"
        choices = _choices(tp)
        if choices is not None:
            key, classes = choices
            links = ", ".join(
                f"[`{value}`](#{self.anchor(cls, f'{path} ({key}: {value})')})"
                for value, cls in classes.items()
            )
            return f"mapping, by `{key}`: {links}"
        if dataclasses.is_dataclass(tp):
            return f"[mapping](#{self.anchor(tp, path)})"
        names = {int: "integer", float: "number", bool: "`true` or `false`", str: "string"}
        return names[tp]

    def rows(self, cls: type, path: str) -> list[str]:
        hints = typing.get_type_hints(cls)
        docs = descriptions(cls)
        rows = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.name not in docs:
                raise ValueError(
                    f"{cls.__name__}.{f.name}: no description; add it to the `Attributes:` "
                    f"section of the {cls.__name__} docstring"
                )
            key = f"{path}.{f.name}" if path else f.name
            kind = self.type_text(hints[f.name], key)
            rows.append(_row(f"`{key}`", kind, _default(f, hints[f.name]), docs[f.name]))
        return rows

    def section(self, cls: type, path: str) -> list[str]:
        """The section of `cls` reached at `path`, then the sections it reaches first."""
        self.pending = []
        rows = self.rows(cls, re.sub(r" \(.*\)$", "", path))
        reached = self.pending
        title = f"`{path}`" if path else "Top level"
        block = [f"## {title} {{#{self.anchors.get(cls, 'top-level')}}}", ""]
        if _summary(cls):
            block += [_summary(cls), ""]
        others = self.used_at[cls][1:] if cls in self.used_at else []
        if others:
            block += ["Also at " + ", ".join(f"`{p}`" for p in others) + ".", ""]
        block += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
        out = ["\n".join(block)]
        for child, child_path in reached:
            out += self.section(child, child_path)
        return out

    def render(self) -> str:
        return "\n".join([HEADER, *self.section(schema.Config, "")])


def _default(f: dataclasses.Field, tp: Any) -> str:
    """A field's default as YAML; a section of defaults as `(defaults)`."""
    if f.default is not dataclasses.MISSING:
        return f"`{_yaml(f.default)}`"
    if f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default_factory()
    choices = _choices(_strip_none(tp)[0])
    if choices is not None:  # one variant of a dispatching type: name it
        return f"`{{{choices[0]}: {getattr(value, choices[0])}}}`"
    if dataclasses.is_dataclass(value):
        return "(defaults)"
    return f"`{_yaml(value)}`"


def _summary(cls: type) -> str:
    """The docstring's text before `Attributes:`, on one line."""
    if "__doc__" not in cls.__dict__ or not cls.__doc__:
        return ""
    text = inspect.getdoc(cls).split("Attributes:")[0]
    return " ".join(text.split())


def _row(*cells: str) -> str:
    """A table row; a `|` outside code spans is escaped (it would split the cell)."""
    return "| " + " | ".join(_escape(c) for c in cells) + " |"


def _escape(cell: str) -> str:
    parts = cell.split("`")  # odd parts are inside code spans, which MkDocs keeps whole
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def render() -> str:
    """The configuration reference page (Markdown)."""
    first = _Page()
    first.render()  # a whole walk: every path each section is reached at
    return _Page(first.used_at).render()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if not argv:
        sys.stdout.write(text)
        return 0
    with open(argv[0], "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
