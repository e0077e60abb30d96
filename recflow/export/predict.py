"""`recflow predict`: score a CSV or Parquet file with an exported SavedModel.

Only the export is needed: the serving signature names every input and its
dtype, and `assets.extra/recflow_config.yaml` (written with every export) holds
the training config's CSV settings (`header`, `columns`, `delimiter`) and each
feature's source column (`column:`), so the file is read as training read it.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
import yaml

from recflow.errors import DataError, RecflowError

CONFIG_ASSET = os.path.join("assets.extra", "recflow_config.yaml")


def _export_config(export_dir: str) -> dict:
    """The export's config as a plain mapping ({} for an export without one)."""
    path = os.path.join(export_dir, CONFIG_ASSET)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def _read_csv(path: str, options: dict, sources: dict[str, str]) -> dict[str, list[str]]:
    """Column values (stripped) of the inputs, read with the training CSV settings."""
    delimiter = options.get("delimiter") or ","
    header_line = options.get("header", True)
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter=delimiter)
        if header_line:
            header = [h.strip() for h in next(reader, [])]
            first = 2
        else:
            header, first = list(options.get("columns") or ()), 1
        for name, column in sources.items():
            if column not in header:
                raise DataError(f"{path}: missing column {column!r} (input {name!r} of the model)")
        index = {name: header.index(column) for name, column in sources.items()}
        columns: dict[str, list[str]] = {name: [] for name in sources}
        for line, row in enumerate(reader, start=first):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank lines are ignored, as in training
            if len(row) != len(header):
                raise DataError(f"{path}: line {line}: expected {len(header)} fields, got {len(row)}")
            for name, i in index.items():
                columns[name].append(row[i].strip())
    return columns


def _read_parquet(path: str, sources: dict[str, str]) -> dict[str, list]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for name, column in sources.items():
        if column not in table.column_names:
            raise DataError(f"{path}: missing column {column!r} (input {name!r} of the model)")
    return {name: table.column(column).to_pylist() for name, column in sources.items()}


def _typed(path: str, name: str, values: list, dtype: tf.DType) -> np.ndarray:
    try:
        if dtype == tf.float32:
            return np.array([np.nan if v in ("", None) else float(v) for v in values], np.float32)
        if dtype == tf.int64:
            return np.array([-1 if v in ("", None) else int(v) for v in values], np.int64)
    except (ValueError, OverflowError) as e:
        raise DataError(f"{path}: column {name!r}: {e}") from None
    return np.array(["" if v is None else str(v) for v in values], dtype=object)


def _format(values: np.ndarray) -> list[str]:
    """One output of a batch as text per row: a number, or space-joined numbers."""
    if values.ndim == 2 and values.shape[1] > 1:
        return [" ".join(f"{v:.6f}" for v in row) for row in values]
    return [f"{v:.6f}" for v in values.reshape(-1)]


def predict_file(export_dir: str, data_file: str, batch_size: int = 4096) -> Iterator[str]:
    """Yields the lines `recflow predict` prints: every output of each row, in file order.

    One output (a probability, a prediction, a retrieval embedding) gives one value
    per line; several (one per task) give a header line of their names, then one
    comma-separated line per row.
    """
    if not os.path.exists(os.path.join(export_dir, "saved_model.pb")):
        raise RecflowError(f"{export_dir}: not a SavedModel directory")
    if not os.path.exists(data_file):
        raise DataError(f"{data_file}: no such file")
    config = _export_config(export_dir)
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    specs = serve.structured_input_signature[1]
    column_of = {f["name"]: f.get("column") or f["name"] for f in config.get("features", [])}
    sources = {name: column_of.get(name, name) for name in sorted(specs)}
    if data_file.endswith(".parquet"):
        raw = _read_parquet(data_file, sources)
    else:
        raw = _read_csv(data_file, (config.get("data") or {}).get("csv") or {}, sources)
    columns = {n: _typed(data_file, n, raw[n], specs[n].dtype) for n in sources}
    outputs = sorted(serve.structured_outputs)
    if len(outputs) > 1:
        yield ",".join(outputs)
    rows = len(next(iter(columns.values()))) if columns else 0
    for start in range(0, rows, batch_size):
        batch = {n: tf.constant(c[start : start + batch_size], specs[n].dtype) for n, c in columns.items()}
        result = serve(**batch)
        texts = [_format(result[o].numpy()) for o in outputs]
        yield from (",".join(parts) for parts in zip(*texts))
