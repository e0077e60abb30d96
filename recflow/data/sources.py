"""Checks of the data sources that run before TensorFlow is imported.

`check_sources` expands the configured globs and reads each file's header (CSV)
or schema (Parquet), so a missing file or column costs no TensorFlow start-up and
prints one line naming the file and the column. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import codecs
import csv
import functools
import glob
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from recflow.config.schema import Config, CsvOptions
from recflow.data import synthetic
from recflow.errors import DataError

# The tag in front of the in-graph message of a malformed record (on_bad_record: fail).
BAD_RECORD_TAG = "recflow-bad-record: "
_BAD_RECORD_RE = re.compile(re.escape(BAD_RECORD_TAG) + r"(.*)\]")

# The text of values (Python `re` and RE2 both read these).
NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
NUMBER_OR_SPECIAL = NUMBER + r"|[+-]?(?i:nan|inf)"  # numeric features: "nan" reads as missing

# TensorFlow's text-to-number parse reads at most 31 characters: a number is read without
# its leading zeros and its decimals past the 16th (below float32's precision, and float64's
# to 1e-16), and one still longer is a bad row. (pattern, replacement) pairs, for `re` and RE2.
SHORTENED = ((r"^([+-]?)0+([0-9])", r"\1\2"), (r"(\.[0-9]{16})[0-9]+", r"\1"))
LONGEST_NUMBER = 31


def shortened(text: str) -> str:
    """`text` as the training reader hands it to TensorFlow's parse (`SHORTENED`)."""
    for pattern, replacement in SHORTENED:
        text = re.sub(pattern, replacement, text)
    return text


@functools.cache
def positive_numbers(values: tuple[str, ...]) -> frozenset[float]:
    """The values of `data.positive` that are numbers, by value (`"4"` matches 4.0 in every
    reader); the others match as text only."""
    return frozenset(float(v) for v in values if re.fullmatch(NUMBER, v))


TOO_LONG = f"a number of at most {LONGEST_NUMBER} characters without its leading zeros and decimals past the 16th"


def _digits_at_most(bound: str) -> str:
    """A pattern of the digit strings of `bound`'s length whose value is at most `bound`."""
    parts = [
        bound[:i] + f"[0-{int(d) - 1}]" + rf"\d{{{len(bound) - i - 1}}}"
        for i, d in enumerate(bound)
        if d != "0"
    ]
    return "|".join(parts + [bound])


# Exactly the integers of int64, [-2**63, 2**63 - 1].
INT64_TEXT = (  # leading zeros allowed: "007" is 7 (TensorFlow's parse reads any number of them)
    rf"(?:0*(?:\d{{1,18}}|{_digits_at_most(str(2**63 - 1))})"
    rf"|-0*(?:\d{{1,18}}|{_digits_at_most(str(2**63))}))"
)
DIGITS = r"-?\d+"  # an integer of any size, as INT64_TEXT writes one (no "+": TF's parse refuses it)

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
        limit: the values a multi_hot (`max_values`) or sequence (`max_len`) feature
            keeps; the reader cuts a longer value to its first `limit + 1` values
            before anything splits it (the transform then counts and cuts the row).
        positive: for a label, the raw values (stripped) that are 1 (every other
            value is 0), or None for a numeric label.
        binary: a label of a binary head: any value other than 0 or 1 stops the input.
        ints: a multi_hot or sequence feature of int64 ids: each of its values must be one
            (a row holding another is bad).
    """

    column: str
    kind: str
    who: str
    separator: str | None = None
    positive: tuple[str, ...] | None = None
    binary: bool = False
    limit: int | None = None
    ints: bool = False

    @property
    def key(self) -> tuple:
        """Identifies one decoded column; uses with equal keys share it."""
        return (self.column, self.kind, self.separator, self.positive, self.limit)


_SPACE = " \t\n\r\v\f"  # what `tf.strings.strip` strips: ASCII whitespace only
_ESCAPED = {" ": " ", "\t": r"\t", "\n": r"\n", "\r": r"\r", "\v": r"\v", "\f": r"\f"}


def strip(text: str) -> str:
    """`text` without surrounding ASCII whitespace, as the training reader strips a field
    (`str.strip` also strips a no-break space or U+3000: another id than training's)."""
    return text.strip(_SPACE)


def int64_list(separator: str) -> str:
    """The pattern of a multi_hot or sequence column of int64 ids: `INT64_TEXT` values
    joined by `separator`, each with spaces around it or none (the transform strips
    them), empty ones allowed (the transform drops them)."""
    sep, blank = re.escape(separator), blanks(separator)
    value = rf"{blank}(?:{INT64_TEXT})?{blank}"
    return rf"{value}(?:{sep}{value})*"


def blanks(separator: str) -> str:
    """The pattern of the spaces around a value joined by `separator` (none when the
    separator is itself a space: then those are separators)."""
    space = "".join(_ESCAPED[c] for c in _SPACE if c not in separator)  # for `re` and RE2 alike
    return f"[{space}]*" if space else ""


def int64_list_refusal(separator: str) -> str:
    """What every reader says of a value that is not `int64_list(separator)`, between the
    column and the value (`column 'tags': expected ..., got '7|x'`)."""
    return f"expected int64 ids joined by '{separator}', got "


def leading_values(text: str, separator: str, limit: int) -> list[str]:
    """The first `limit + 1` non-empty values of a separator-joined text, found without
    splitting all of it (the Python twin of `records.first_values`): more than `limit`
    values back means the row is cut."""
    sep = re.escape(separator)
    runs = re.compile(f"{sep}(?:{blanks(separator)}{sep})*")
    pieces = runs.split(text, maxsplit=limit + 2)[: limit + 2]  # the rest stays one piece
    return [strip(p) for p in pieces if strip(p)][: limit + 1]


def needs(config: Config) -> list[Need]:
    """Every column use of the config: features first, then labels."""
    result = [
        Need(
            f.source,
            f.read_as,
            f"feature '{f.name}'",
            f.value_separator,
            limit=f.value_limit,
            ints=f.value_separator is not None and f.dtype == INT64,
        )
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


def kernel_libraries(config: Config) -> list[str]:
    """The op libraries the input's graphs need beyond TF's own kernels: tensorflow-io's,
    which reads Parquet. A TF server that runs those graphs (a worker task) loads them
    with `load_op_library`: importing tensorflow_io would import TF's whole Python API."""
    if config.data.format != "parquet":
        return []
    import importlib.util

    spec = importlib.util.find_spec("tensorflow_io")
    if spec is None:
        raise DataError("data.format: parquet needs the tensorflow-io package (pip install tensorflow-io)")
    return [os.path.join(spec.submodule_search_locations[0], "python", "ops", "libtensorflow_io.so")]


def label_need(config: Config, label: str) -> Need:
    """The use of a label column."""
    return next(n for n in needs(config) if n.kind == LABEL and n.column == label)


def expand(patterns: Iterable[str], where: str) -> list[str]:
    """Expands globs into a sorted list of files.

    Args:
        patterns: glob patterns (a plain path is a pattern too).
        where: the config path for messages, e.g. `data.train`.

    Raises:
        DataError: a pattern matches no file (a directory names the glob of its files).
    """
    files: set[str] = set()
    for pattern in patterns:
        found = glob.glob(os.path.expanduser(pattern), recursive=True)
        matched = [p for p in found if os.path.isfile(p)]
        if not matched:
            folders = sorted(p for p in found if os.path.isdir(p))
            if folders:
                raise DataError(f"{where}: {_folder_hint(pattern, folders[0])}")
            raise DataError(f"{where}: no files match {pattern!r}")
        files.update(matched)
    return sorted(files)


def _folder_hint(pattern: str, folder: str) -> str:
    """What to write instead of a pattern that names directories: a glob of the files
    of the first, with their most common extension."""
    names = [n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n))]
    extensions = Counter(os.path.splitext(n)[1] for n in names if not n.startswith("."))
    extension = max(sorted(extensions), key=extensions.__getitem__, default="")
    suggestion = os.path.join(folder, "*" + extension)
    if os.path.isdir(os.path.expanduser(pattern)):
        what = f"{pattern!r} is a directory"
    else:
        what = f"{pattern!r} matches only directories (first: {folder!r})"
    return f"{what}; name its files with a glob, e.g. {suggestion!r}"


# File signatures that are not plain UTF-8 text, and what to do about them.
_SIGNATURES = (
    (b"\x1f\x8b", "a gzip-compressed file", "decompress it first (gunzip -k)"),
    (b"BZh", "a bzip2-compressed file", "decompress it first (bunzip2 -k)"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "decompress it first (unxz -k)"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it first (unzstd)"),
    (b"PK\x03\x04", "a zip archive", "extract its files first (unzip)"),
    (b"PAR1", "a Parquet file", "set data.format: parquet"),
    (b"\xff\xfe\x00\x00", "UTF-32 text (byte order mark FF FE 00 00)", "convert it to UTF-8 first (iconv -f UTF-32 -t UTF-8)"),
    (b"\x00\x00\xfe\xff", "UTF-32 text (byte order mark 00 00 FE FF)", "convert it to UTF-8 first (iconv -f UTF-32 -t UTF-8)"),
    (b"\xff\xfe", "UTF-16 text (byte order mark FF FE)", "convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8)"),
    (b"\xfe\xff", "UTF-16 text (byte order mark FE FF)", "convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8)"),
)  # fmt: skip


def not_text(file: str) -> str | None:
    """Why a file is not the plain UTF-8 text a CSV reader expects (compressed, an
    archive, Parquet, UTF-16/32, binary), from its first bytes; None when it looks like text.

    Raises:
        DataError: the file cannot be read.
    """
    try:
        with open(file, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror})") from None
    for magic, what, advice in _SIGNATURES:
        if head.startswith(magic):
            return f"{what}; recflow reads plain UTF-8 CSV: {advice}"
    zeros = head.count(0)
    if zeros:
        even = head[0::2].count(0)
        if zeros * 4 >= len(head) and even in (0, zeros):  # ASCII text in UTF-16, no mark
            order = "little" if even == 0 else "big"
            return (
                f"UTF-16 text ({order}-endian, no byte order mark); recflow reads plain UTF-8 CSV: "
                f"convert it to UTF-8 first (iconv -f UTF-16{order[0].upper()}E -t UTF-8)"
            )
        if zeros * 100 >= len(head):
            return "binary data (NUL bytes), not CSV text"
    return None


def csv_reader(f, delimiter: str):
    """`csv.reader` without its 128 KiB field limit (training reads any line length)."""
    csv.field_size_limit(2**31 - 1)
    return csv.reader(f, delimiter=delimiter)


def read_header(file: str, options: CsvOptions) -> list[str]:
    """The column names of a CSV file: its first line, or `csv.columns`.

    Raises:
        DataError: the file cannot be read, is not UTF-8 text (gzip, UTF-16, ...: named),
            or has no header line.
    """
    problem = not_text(file)
    if problem is not None:
        raise DataError(f"{file}: {problem}")
    if not options.header:
        return list(options.columns or ())
    try:
        with open(file, encoding="utf-8-sig", newline="") as f:
            row = next(csv_reader(f, options.delimiter), None)
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{file}: cannot read the header line ({e})") from None
    if not row:
        raise DataError(f"{file}: empty file (expected a header line)")
    return [strip(name) for name in row]


def require_pyarrow(what: str) -> None:
    """Raises DataError when pyarrow (Parquet's schema, null counts; predict's reader) is
    not installed: without it a null in a file aborted the process (exit 134)."""
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise DataError(f"{what}: Parquet needs the pyarrow package (pip install 'pyarrow<18', or the parquet extra)")


def parquet_columns(file: str) -> list[str]:
    """The column names of a Parquet file."""
    require_pyarrow(file)
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(file).names)
    except OSError as e:
        raise DataError(f"{file}: cannot read the Parquet schema ({e})") from None


def check_parquet_nulls(file: str, columns: list[str]) -> None:
    """Raises DataError naming the first of `columns` that holds a null: tensorflow-io
    mis-reads them (the values after a null shift; a null in a string column aborts the
    process). Counted from the file's statistics, or by reading the column where a row
    group has none."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
        meta = parquet.metadata
        index = {meta.schema.column(i).name: i for i in range(meta.num_columns)}
        for column in columns:
            nulls = 0
            for group in range(meta.num_row_groups):
                stats = meta.row_group(group).column(index[column]).statistics
                if stats is None or not stats.has_null_count:
                    nulls = parquet.read(columns=[column]).column(0).null_count
                    break
                nulls += stats.null_count
            if nulls:
                raise DataError(
                    f"{file}: column '{column}' holds {nulls} null(s), which the Parquet reader "
                    "mis-reads (the values after a null shift): write a missing number as a NaN value "
                    "(pandas' to_parquet stores NaN as null; pyarrow keeps it with "
                    "pa.array(x, from_pandas=False)) and a missing string as \"\""
                )
    except OSError as e:
        raise DataError(f"{file}: cannot read the Parquet metadata ({e})") from None


def check_columns(
    file: str, available: Iterable[str], uses: Iterable[Need], delimiter: str | None = None
) -> None:
    """Raises DataError naming the file and the first missing column.

    With the CSV `delimiter` the header was split by, a column found in the header
    under another separator names that separator (`data.csv.delimiter`).
    """
    names = list(available)
    present = set(names)
    for need in uses:
        if need.column not in present:
            hint = delimiter_hint(need.column, names, delimiter) if delimiter else ""
            raise DataError(f"{file}: missing column '{need.column}' (needed by {need.who}){hint}")


_DELIMITERS = {",": "','", ";": "';'", "\t": "tabs", "|": "'|'"}  # the usual ones, as named


def delimiter_hint(column: str, names: list[str], delimiter: str) -> str:
    """`; the header holds it separated by ';' (set data.csv.delimiter: ";")` when one
    header name holds `column` between another delimiter's separators, else ""."""
    for other, shown in _DELIMITERS.items():
        if other == delimiter:
            continue
        if any(column in (part.strip() for part in name.split(other)) for name in names):
            return f"; the header holds it separated by {shown} (set data.csv.delimiter: {json.dumps(other)})"
    return ""


def check_files(config: Config, files: list[str]) -> None:
    """Checks the columns of explicit files of the configured format."""
    uses = needs(config)
    fmt = config.data.format
    for file in files:
        if fmt == "csv":
            options = config.data.csv
            delimiter = options.delimiter if options.header else None
            check_columns(file, read_header(file, options), uses, delimiter)
        elif fmt == "parquet":
            check_columns(file, parquet_columns(file), uses)
            check_parquet_nulls(file, sorted({use.column for use in uses}))
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
