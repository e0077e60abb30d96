"""User-facing errors: each one prints as a single `recflow: ...` line (exit 2)."""

from __future__ import annotations

import re


def one_line(text: str) -> str:
    """`text` with line breaks and other unprintable characters escaped, as `repr` does."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def op_reason(message: str) -> str:
    """The reason line of a TensorFlow op error's message, without its function and node
    names, stack and `[Op:...]` parts (`StringToNumberOp could not correctly convert ...`)."""
    lines = [
        line for line in message.splitlines()
        if line.strip() and not line[0].isspace()
        and not line.startswith(("Graph execution error", "Detected at node", "<stack traces"))
    ]
    text = lines[-1] if lines else message
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[\[.*$|\s*\[Op:[^\]]*\].*$", "", text).strip()


def listed(names: list[str], shown: int = 3) -> str:
    """`a, b, c`; a longer list names its first `shown`: `a, b, c and 2 more`."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class RecflowError(Exception):
    """A mistake the user can fix (bad config, bad arguments, unreadable data).

    Its `str` is always one line: names taken from a file (keys, columns) may hold
    line breaks, which are escaped.
    """

    def __str__(self) -> str:
        return one_line(super().__str__())


class ConfigError(RecflowError):
    """An invalid config value.

    Args:
        path: dotted path of the offending value, e.g. `features[2].dim`.
        message: what is wrong with it.
        file: the config file, when known.
    """

    def __init__(self, path: str, message: str, file: str | None = None):
        self.path = path
        self.message = message
        self.file = file
        super().__init__(str(self))

    def with_file(self, file: str) -> ConfigError:
        return ConfigError(self.path, self.message, file)

    def __str__(self) -> str:
        parts = [p for p in (self.file, self.path) if p]
        return one_line(": ".join(parts + [self.message]))


class DataError(RecflowError):
    """Data that cannot be read: a missing column, a malformed row, no files."""
