"""`recflow predict`: score a CSV or Parquet file with an exported SavedModel.

Only the export is needed: the serving signature names every input and its
dtype, and `assets.extra/recflow_config.yaml` (written with every export) holds
the training config's CSV settings (`header`, `columns`, `delimiter`) and each
feature's source column (`column:`), so the file is read as training read it:
the same number and integer patterns (a bad value names its file, line and
column), multi_hot / sequence values cut to their first `max_values` / `max_len`
(+ 1) before the serving graph splits them. A CSV file may be gzip-compressed;
other non-text files (UTF-16, bzip2, ...) and directories are one-line errors.
"""

from __future__ import annotations

import csv
import gzip
import numbers
import os
import re
from array import array
from collections.abc import Callable, Iterator

import numpy as np
import tensorflow as tf
import yaml

from recflow.data.records import number_text
from recflow.data.sources import (
    DIGITS,
    INT64_TEXT,
    LONGEST_NUMBER,
    NUMBER_OR_SPECIAL,
    TOO_LONG,
    csv_reader,
    delimiter_hint,
    int64_list,
    int64_list_refusal,
    leading_values,
    not_text,
    require_pyarrow,
    shortened,
    strip,
)
from recflow.errors import DataError, RecflowError, op_reason

CONFIG_ASSET = os.path.join("assets.extra", "recflow_config.yaml")


def _export_config(export_dir: str) -> dict:
    """The export's config as a plain mapping ({} for an export without one)."""
    path = os.path.join(export_dir, CONFIG_ASSET)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def _open_text(path: str):
    """The file as text: plain UTF-8, or gzip-compressed (decompressed as it is read)."""
    with open(path, "rb") as f:
        if f.read(2) == b"\x1f\x8b":
            return gzip.open(path, "rt", newline="", encoding="utf-8-sig")
    problem = not_text(path)
    if problem is not None:
        raise DataError(f"{path}: {problem}")
    return open(path, newline="", encoding="utf-8-sig")


def _read_csv(
    path: str, options: dict, sources: dict[str, str]
) -> tuple[dict[str, list[str]], array]:
    """Column values (stripped) of the inputs, read with the training CSV settings, and
    the line number of each row."""
    delimiter = options.get("delimiter") or ","
    header_line = options.get("header", True)
    with _open_text(path) as f:
        reader = csv_reader(f, delimiter)
        try:
            if header_line:
                header = [strip(h) for h in next(reader, [])]
            else:
                header = list(options.get("columns") or ())
            for name, column in sources.items():
                if column not in header:
                    hint = delimiter_hint(column, header, delimiter) if header_line else ""
                    raise DataError(
                        f"{path}: missing column {column!r} (input {name!r} of the model){hint}"
                    )
            index = {name: header.index(column) for name, column in sources.items()}
            columns: dict[str, list[str]] = {name: [] for name in sources}
            lines = array("q")  # 8 bytes a row
            for row in reader:
                if not row or (len(row) == 1 and not strip(row[0])):
                    continue  # blank lines are ignored, as in training
                if len(row) != len(header):
                    raise DataError(
                        f"{path}: line {reader.line_num}: expected {len(header)} fields, got {len(row)}"
                    )
                for name, i in index.items():
                    columns[name].append(strip(row[i]))
                lines.append(reader.line_num)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text after line {reader.line_num} ({e.reason})") from None
        except csv.Error as e:
            raise DataError(f"{path}: line {reader.line_num}: {e}") from None
    return columns, lines


def _read_parquet(path: str, sources: dict[str, str]) -> dict[str, list | np.ndarray]:
    """Each input's column: a string column as a list, a typed one (numbers, bools) as a
    numpy array of its own dtype, converted by `_typed` as the training reader does."""
    require_pyarrow(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    out = {}
    for name, column in sources.items():
        if column not in table.column_names:
            raise DataError(f"{path}: missing column {column!r} (input {name!r} of the model)")
        values = table.column(column)
        typed = pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)
        out[name] = values.to_numpy() if typed else values.to_pylist()
    return out


_INT64 = re.compile(INT64_TEXT)
_DIGITS = re.compile(DIGITS)
_NUMBER = re.compile(NUMBER_OR_SPECIAL)


def _typed(name: str, column: str, values, dtype: tf.DType, where: Callable) -> np.ndarray:
    """One input's values in its serving dtype, read as training reads them; a bad value
    names its row (`where(index)`) and column. `values`: strings (a CSV or a Parquet
    string column) or a typed Parquet column (a numpy array of numbers or bools)."""
    if isinstance(values, np.ndarray):  # as `records.typed` reads a typed column
        if dtype == tf.string:  # its text, as training reads it: 1005.0 is "1005"
            return number_text(tf.constant(values)).numpy().astype(object)
        if dtype == tf.int64 and not np.issubdtype(values.dtype, np.integer):
            raise DataError(f"{where(0)}: column {column!r} holds {values.dtype} values, but input {name!r} expects int64")
        return values.astype(np.int64 if dtype == tf.int64 else np.float32)
    if dtype == tf.string:
        return np.array(["" if v is None else str(v) for v in values], dtype=object)
    floats = dtype == tf.float32
    out = np.empty(len(values), np.float32 if floats else np.int64)
    for i, v in enumerate(values):
        if v in ("", None):
            out[i] = np.nan if floats else -1
        elif not isinstance(v, str):
            out[i] = v  # a typed Parquet value
        elif (_NUMBER if floats else _INT64).fullmatch(v) and (not floats or len(shortened(v)) <= LONGEST_NUMBER):
            with np.errstate(over="ignore"):  # 1e39 is inf in float32, as training reads it
                out[i] = float(v) if floats else int(v)
        else:
            at = f"{where(i)}: column {column!r} (input {name!r})"
            if not floats and _DIGITS.fullmatch(v):
                raise DataError(f"{at}: {v!r} does not fit in int64")
            if floats and _NUMBER.fullmatch(v):
                raise DataError(f"{at}: expected {TOO_LONG}, got {v!r}")
            raise DataError(f"{at}: expected {'a number' if floats else 'an integer'}, got {v!r}")
    return out


def _check_id_list(name: str, column: str, values: np.ndarray, feature: dict, where: Callable) -> None:
    """A multi_hot or sequence input of int64 ids holds int64 ids only (as training
    checks: `records.id_list_checks`); else the row is named."""
    separator = feature.get("separator")
    if feature.get("dtype") != "int64" or feature.get("kind") not in ("multi_hot", "sequence") or not separator:
        return
    pattern = re.compile(int64_list(separator))
    for i, v in enumerate(values):
        if not pattern.fullmatch(strip(v)):
            raise DataError(f"{where(i)}: column {column!r} (input {name!r}): {int64_list_refusal(separator)}{v!r}")


def _cut(values: list[str], feature: dict) -> list[str]:
    """A multi_hot / sequence input's values cut to their first `max_values` / `max_len`
    + 1 values before the serving graph splits them (as the training input does)."""
    limit = feature.get("max_values") or feature.get("max_len")
    separator = feature.get("separator")
    if not limit or not separator or isinstance(values, np.ndarray):
        return values
    longest = (limit + 2) * (1 + len(separator)) - len(separator)
    return [
        separator.join(leading_values(v, separator, limit))
        if isinstance(v, str) and len(v) >= longest
        else v
        for v in values
    ]


def _format(values: np.ndarray) -> list[str]:
    """One output of a batch as text per row: a number, or space-joined numbers, each
    with the 9 significant digits that read back as the same float32 (6 decimals made
    ties of close scores, and 0 of one under 5e-7: an AUC from them was off)."""
    if values.ndim == 2 and values.shape[1] > 1:
        return [" ".join(f"{v:.9g}" for v in row) for row in values]
    return [f"{v:.9g}" for v in values.reshape(-1)]


def predict_file(export_dir: str, data_file: str, batch_size: int = 4096) -> Iterator[str]:
    """Yields the lines `recflow predict` prints: every output of each row, in file order.

    One output (a probability, a prediction, a retrieval embedding) gives one value
    per line; several (one per task) give a header line of their names, then one
    comma-separated line per row. A CSV file may be gzip-compressed.

    Raises:
        RecflowError: `batch_size` is not a positive integer, or `export_dir` is not a
            readable SavedModel.
        DataError: `data_file` cannot be read as the export's inputs.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
        raise RecflowError(f"batch_size: expected a positive integer, got {batch_size!r}")
    if not os.path.exists(os.path.join(export_dir, "saved_model.pb")):
        raise RecflowError(f"{export_dir}: not a SavedModel directory")
    if os.path.isdir(data_file):
        raise DataError(f"{data_file}: a directory; predict scores one CSV or Parquet file")
    if not os.path.exists(data_file):
        raise DataError(f"{data_file}: no such file")
    config = _export_config(export_dir)
    serve = _load(export_dir).signatures["serving_default"]
    specs = serve.structured_input_signature[1]
    features = {f["name"]: f for f in config.get("features", [])}
    sources = {name: features.get(name, {}).get("column") or name for name in sorted(specs)}
    if _is_parquet(data_file):
        raw = _read_parquet(data_file, sources)
        where = lambda i: f"{data_file}: row {i + 1}"  # noqa: E731
    else:
        raw, lines = _read_csv(data_file, (config.get("data") or {}).get("csv") or {}, sources)
        where = lambda i: f"{data_file}: line {lines[i]}"  # noqa: E731
    columns = {
        n: _typed(n, sources[n], _cut(raw[n], features.get(n, {})), specs[n].dtype, where)
        for n in sources
    }
    for n, values in columns.items():
        _check_id_list(n, sources[n], values, features.get(n, {}), where)
    outputs = sorted(serve.structured_outputs)
    if len(outputs) > 1:
        yield ",".join(outputs)
    rows = len(next(iter(columns.values()))) if columns else 0
    for start in range(0, rows, batch_size):
        batch = {n: tf.constant(c[start : start + batch_size], specs[n].dtype) for n, c in columns.items()}
        result = serve(**batch)
        texts = [_format(result[o].numpy()) for o in outputs]
        yield from (",".join(parts) for parts in zip(*texts))


def _load(export_dir: str):
    """The SavedModel at `export_dir`; a damaged one (a variables file missing, cut
    short or with flipped bytes, a saved_model.pb that does not parse) is one line
    naming the export and what is wrong."""
    index = os.path.join("variables", "variables.index")
    if not os.path.exists(os.path.join(export_dir, index)):
        raise RecflowError(f"{export_dir}: damaged SavedModel: {index} is missing")
    try:
        return tf.saved_model.load(export_dir)
    except (tf.errors.OpError, OSError, IndexError, ValueError) as e:
        # A data file cut short: IndexError; a saved_model.pb that does not parse: OSError.
        reason = op_reason(getattr(e, "message", None) or str(e) or type(e).__name__)
        raise RecflowError(f"{export_dir}: damaged SavedModel, it does not load: {reason[:200]}") from None


def _is_parquet(path: str) -> bool:
    """A Parquet file by its name or its first bytes (`PAR1`)."""
    if path.endswith(".parquet"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"
