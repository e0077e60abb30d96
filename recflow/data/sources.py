"""Checks of the data sources that run before TensorFlow is imported.

`check_sources` expands the configured globs and reads each file's header (CSV)
or schema (Parquet), so a missing file or column costs no TensorFlow start-up and
prints one line naming the file and the column. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import codecs
import csv
import glob
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from recflow.config.schema import Config, CsvOptions, Feature
from recflow.errors import DataError

# The tag in front of the in-graph message of a malformed record (on_bad_record: fail).
BAD_RECORD_TAG = "recflow-bad-record: "
_BAD_RECORD_RE = re.compile(re.escape(BAD_RECORD_TAG) + r"(.*)\]")

# The text of values (Python `re` and RE2 both read these).
NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
NUMBER_OR_SPECIAL = NUMBER + r"|[+-]?(?i:nan|inf)"  # numeric features: "nan" reads as missing


def _digits_at_most(bound: str) -> str:
    """A pattern of the digit strings of `bound`'s length whose value is at most `bound`."""
    parts = [
        bound[:i] + f"[0-{int(d) - 1}]" + rf"\d{{{len(bound) - i - 1}}}"
        for i, d in enumerate(bound)
        if d != "0"
    ]
    return "|".join(parts + [bound])


# Exactly the integers of int64, [-2**63, 2**63 - 1].
INT64_TEXT = (
    rf"(?:\d{{1,18}}|{_digits_at_most(str(2**63 - 1))}"
    rf"|-(?:\d{{1,18}}|{_digits_at_most(str(2**63))}))"
)
DIGITS = r"[+-]?\d+"  # an integer, of any size

# Raw column kinds: the dtype a column has in the serving signature.
INT64, STRING, FLOAT, LABEL = "int64", "string", "float", "label"


@dataclass(frozen=True)
class Need:
    """One use of a source column.

    Args:
        column: the source column name.
        kind: `int64`, `string`, `float` (a numeric feature, NaN when empty) or
            `label` (float32, must be a number).
        who: for messages, e.g. `feature 'price'` or `label`.
        separator: the separator of a multi_hot or sequence feature, else None.
        positive: for a label, the raw values (stripped) that are 1 (every other
            value is 0), or None for a numeric label.
        binary: a label of a binary head: any value other than 0 or 1 stops the input.
    """

    column: str
    kind: str
    who: str
    separator: str | None = None
    positive: tuple[str, ...] | None = None
    binary: bool = False

    @property
    def key(self) -> tuple:
        """Identifies one decoded column; uses with equal keys share it."""
        return (self.column, self.kind, self.separator, self.positive)


def raw_kind(feature: Feature) -> str:
    """The raw serving dtype of a feature: `int64`, `string` or `float`.

    Only a categorical int64 feature is int64; multi_hot and sequence features are
    separator-joined strings whatever their dtype; numeric features are float.
    """
    if feature.kind == "numeric":
        return FLOAT
    if feature.kind == "categorical" and getattr(feature, "dtype", "string") == "int64":
        return INT64
    return STRING


def needs(config: Config) -> list[Need]:
    """Every column use of the config: features first, then labels."""
    result = [
        Need(f.source, raw_kind(f), f"feature '{f.name}'", getattr(f, "separator", None))
        for f in config.features
    ]
    binary = config.binary_labels
    result += [
        Need(
            label,
            LABEL,
            "label",
            positive=config.data.positive_values(label),
            binary=label in binary,
        )
        for label in config.labels
    ]
    return result


def label_need(config: Config, label: str) -> Need:
    """The use of a label column."""
    return next(n for n in needs(config) if n.kind == LABEL and n.column == label)


def expand(patterns: Iterable[str], where: str) -> list[str]:
    """Expands globs into a sorted list of files.

    Args:
        patterns: glob patterns (a plain path is a pattern too).
        where: the config path for messages, e.g. `data.train`.

    Raises:
        DataError: a pattern matches no file.
    """
    files: set[str] = set()
    for pattern in patterns:
        matched = [
            p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
        ]
        if not matched:
            raise DataError(f"{where}: no files match {pattern!r}")
        files.update(matched)
    return sorted(files)


def read_header(file: str, options: CsvOptions) -> list[str]:
    """The column names of a CSV file: its first line, or `csv.columns`."""
    if not options.header:
        return list(options.columns or ())
    try:
        with open(file, encoding="utf-8-sig", newline="") as f:
            row = next(csv.reader(f, delimiter=options.delimiter), None)
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{file}: cannot read the header line ({e})") from None
    if not row:
        raise DataError(f"{file}: empty file (expected a header line)")
    return [name.strip() for name in row]


def parquet_columns(file: str) -> list[str] | None:
    """The column names of a Parquet file, or None when pyarrow is not installed."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    try:
        return list(pq.read_schema(file).names)
    except OSError as e:
        raise DataError(f"{file}: cannot read the Parquet schema ({e})") from None


def check_columns(file: str, available: Iterable[str], uses: Iterable[Need]) -> None:
    """Raises DataError naming the file and the first missing column."""
    present = set(available)
    for need in uses:
        if need.column not in present:
            raise DataError(f"{file}: missing column '{need.column}' (needed by {need.who})")


def check_files(config: Config, files: list[str]) -> None:
    """Checks the columns of explicit files of the configured format."""
    uses = needs(config)
    fmt = config.data.format
    for file in files:
        if fmt == "csv":
            check_columns(file, read_header(file, config.data.csv), uses)
        elif fmt == "parquet":
            columns = parquet_columns(file)
            if columns is not None:
                check_columns(file, columns, uses)
        elif not os.path.isfile(file):
            raise DataError(f"{file}: no such file")


def has_rows(file: str, options: CsvOptions) -> bool:
    """Whether a CSV file has a non-blank line after its header (if any)."""
    try:
        with open(file, "rb") as f:
            if options.header:
                f.readline()
            return any(line.strip() for line in f)
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror})") from None


def check_rows(config: Config, files: list[str], where: str) -> None:
    """Raises DataError when no CSV file of a split has a data row."""
    if config.data.format != "csv" or any(has_rows(f, config.data.csv) for f in files):
        return
    header = " after the header line" if config.data.csv.header else ""
    if len(files) == 1:
        raise DataError(f"{files[0]}: no rows{header} ({where})")
    raise DataError(f"{where}: none of the {len(files)} files has a row{header} (first: {files[0]})")


def check_synthetic(config: Config) -> None:
    """Checks that every feature source and label is a column of the synthetic schema."""
    from recflow.data import synthetic

    schema = config.data.synthetic.schema
    columns = synthetic.columns(schema)
    for need in needs(config):
        if need.column not in columns:
            raise DataError(
                f"missing column '{need.column}' (needed by {need.who}) in synthetic schema '{schema}'"
            )
        have = columns[need.column]
        if (need.kind == INT64 and have != "int64") or (
            need.kind in (FLOAT, LABEL) and have == "string"
        ):
            raise DataError(
                f"column '{need.column}' of synthetic schema '{schema}' holds {have} values, "
                f"but {need.who} expects {'int64' if need.kind == INT64 else 'numbers'}"
            )


def check_sources(config: Config) -> None:
    """Checks that the configured data exists and has every needed column.

    Runs before TensorFlow is imported: expands `data.train` / `data.eval`, reads
    CSV headers and Parquet schemas (TFRecord files are only globbed).

    Raises:
        DataError: one line naming the file (or glob) and the column.
    """
    if config.data.format == "synthetic":
        check_synthetic(config)
        return
    for where, patterns in (("data.train", config.data.train), ("data.eval", config.data.eval)):
        if patterns:
            files = expand(patterns, where)
            check_files(config, files)
            check_rows(config, files, where)


def bad_record_message(exc: BaseException) -> str | None:
    """Extracts `{file}: line {n}: {reason}` from the error of a malformed record.

    Args:
        exc: usually a `tf.errors.InvalidArgumentError` raised while iterating a
            dataset made with `on_bad_record: fail`.

    Returns:
        The message, or None when `exc` is not about a malformed record.
    """
    text = getattr(exc, "message", None) or str(exc)
    match = _BAD_RECORD_RE.search(text)
    if not match:
        return None
    # tf.debugging.Assert prints string data C-escaped (\' \" \\ and octal bytes).
    try:
        return codecs.escape_decode(match.group(1).encode("utf-8"))[0].decode("utf-8", "replace")
    except ValueError:
        return match.group(1)
