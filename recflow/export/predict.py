"""`recflow predict`: score a CSV or Parquet file with an exported SavedModel.

Only the SavedModel is needed: the serving signature names every input
column and its dtype.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from recflow.errors import DataError, RecflowError


def _columns_csv(path: str, names: list[str]) -> dict[str, list[str]]:
    # utf-8-sig: a byte-order mark (Excel's CSV) is not part of the first column name.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [n for n in names if n not in header]
        if missing:
            raise DataError(f"{path}: missing column {missing[0]!r} (an input of the model)")
        index = [header.index(n) for n in names]
        columns: dict[str, list[str]] = {n: [] for n in names}
        for line, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise DataError(f"{path}: line {line}: expected {len(header)} fields, got {len(row)}")
            for n, i in zip(names, index):
                columns[n].append(row[i].strip())
    return columns


def _columns_parquet(path: str, names: list[str]) -> dict[str, list]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column {missing[0]!r} (an input of the model)")
    return {n: table.column(n).to_pylist() for n in names}


def _typed(path: str, name: str, values: list, dtype: tf.DType) -> np.ndarray:
    try:
        if dtype == tf.float32:
            return np.array([np.nan if v in ("", None) else float(v) for v in values], np.float32)
        if dtype == tf.int64:
            return np.array([-1 if v in ("", None) else int(v) for v in values], np.int64)
    except ValueError as e:
        raise DataError(f"{path}: column {name!r}: {e}") from None
    return np.array(["" if v is None else str(v) for v in values], dtype=object)


def predict_file(export_dir: str, data_file: str, batch_size: int = 4096) -> Iterator[float | str]:
    """Yields the first output of each row, in file order: a probability / prediction,
    or a space-joined embedding for a retrieval export."""
    if not os.path.exists(os.path.join(export_dir, "saved_model.pb")):
        raise RecflowError(f"{export_dir}: not a SavedModel directory")
    if not os.path.exists(data_file):
        raise DataError(f"{data_file}: no such file")
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    specs = serve.structured_input_signature[1]
    names = sorted(specs)
    reader = _columns_parquet if data_file.endswith(".parquet") else _columns_csv
    raw = reader(data_file, names)
    columns = {n: _typed(data_file, n, raw[n], specs[n].dtype) for n in names}
    output = sorted(serve.structured_outputs)[0]
    rows = len(columns[names[0]]) if names else 0
    for start in range(0, rows, batch_size):
        batch = {n: tf.constant(c[start : start + batch_size], specs[n].dtype) for n, c in columns.items()}
        values = serve(**batch)[output].numpy()
        if values.ndim == 2 and values.shape[1] > 1:
            yield from (" ".join(f"{v:.6f}" for v in row) for row in values)
        else:
            yield from values.reshape(-1).tolist()
