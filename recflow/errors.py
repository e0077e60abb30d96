"""User-facing errors: each one prints as a single `recflow: ...` line (exit 2)."""

from __future__ import annotations


class RecflowError(Exception):
    """A mistake the user can fix (bad config, bad arguments, unreadable data)."""


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
        return ": ".join(parts + [self.message])


class DataError(RecflowError):
    """Data that cannot be read: a missing column, a malformed row, no files."""
