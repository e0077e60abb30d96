"""Writes columns (e.g. the synthetic data set) as CSV, TFRecord or Parquet files.

Column types follow the numpy dtype: integers -> int64, floats -> float (NaN is
missing), anything else -> string. Each file is written to a temporary name and
renamed, so a crash never leaves a half-written file.

Example:
    >>> write_synthetic("data/demo", rows=10_000, fmt="csv")
    ['data/demo/train.csv', 'data/demo/eval.csv']
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Mapping

import numpy as np

from recflow.config.schema import SyntheticOptions
from recflow.data import synthetic
from recflow.errors import DataError

FORMATS = {"csv": "csv", "tfrecord": "tfrecord", "parquet": "parquet"}  # format -> file suffix


def write_synthetic(
    out_dir: str, rows: int, fmt: str = "csv", schema: str = "demo", seed: int = 7
) -> list[str]:
    """Writes the synthetic train split (`rows` rows) and eval split (`rows // 5`).

    Args:
        out_dir: the directory, created if needed.
        rows: train rows; eval gets `max(rows // 5, 1)`.
        fmt: csv | tfrecord | parquet.
        schema: demo | criteo | sequence (see `recflow.data.synthetic`).
        seed: the data seed (the same seed gives the same files).

    Returns:
        The paths written: `[out_dir/train.<fmt>, out_dir/eval.<fmt>]`.

    Raises:
        DataError: a bad `fmt` or `rows`, `out_dir` cannot be a directory (a file), or
            it holds one of the files already (a user's data is never replaced).
    """
    if fmt not in FORMATS:
        raise DataError(f"--format: expected one of {sorted(FORMATS)}, got {fmt!r}")
    if rows <= 0:
        raise DataError(f"--rows: expected a positive integer, got {rows}")
    options = SyntheticOptions(rows=rows, eval_rows=max(rows // 5, 1), seed=seed, schema=schema)
    labels = synthetic.label_columns(schema)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"--out {out_dir}: an existing file, not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise DataError(f"--out {out_dir}: cannot create the directory ({e.strerror})") from None
    paths = [os.path.join(out_dir, f"{split}.{FORMATS[fmt]}") for split in ("train", "eval")]
    for path in paths:
        if os.path.lexists(path):
            raise DataError(f"--out {out_dir}: {os.path.basename(path)} is there already (remove it, or write elsewhere)")
    for split, path in zip(("train", "eval"), paths):
        columns, _ = synthetic.generate(options, split)
        write_columns(path, columns, fmt, labels=labels)
    return paths


def write_columns(
    path: str, columns: Mapping[str, np.ndarray], fmt: str, labels: Iterable[str] = ()
) -> None:
    """Writes equally long columns as one file, atomically.

    Args:
        path: the file to write.
        columns: name -> 1-D numpy array (int, float with NaN for missing, or str).
        fmt: csv | tfrecord | parquet.
        labels: columns stored as floats in TFRecord (labels are read as float32).
    """
    arrays = {name: np.asarray(values) for name, values in columns.items()}
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) > 1:
        raise ValueError(f"columns differ in length: {sorted(lengths)}")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        {"csv": _write_csv, "tfrecord": _write_tfrecord, "parquet": _write_parquet}[fmt](
            tmp, arrays, set(labels)
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _kind(a: np.ndarray) -> str:
    if np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
        return "int64"
    if np.issubdtype(a.dtype, np.floating):
        return "float"
    return "string"


def _csv_text(a: np.ndarray) -> list[str]:
    kind = _kind(a)
    if kind == "int64":
        return [str(int(v)) for v in a]
    if kind == "float":
        # str() of a numpy float is the shortest text that reads back to the same value.
        return ["" if np.isnan(v) else str(v) for v in a]
    return [str(v) for v in a]


def _write_csv(path: str, arrays: dict[str, np.ndarray], labels: set[str]) -> None:
    texts = [_csv_text(a) for a in arrays.values()]
    with open(path, "w", encoding="utf-8", newline="") as f:
        out = csv.writer(f, lineterminator="\n")  # QUOTE_MINIMAL: quotes fields that need it
        out.writerow(list(arrays))
        out.writerows(zip(*texts))


def _write_tfrecord(path: str, arrays: dict[str, np.ndarray], labels: set[str]) -> None:
    import tensorflow as tf

    kinds = {name: "float" if name in labels else _kind(a) for name, a in arrays.items()}
    n = len(next(iter(arrays.values()))) if arrays else 0
    with tf.io.TFRecordWriter(path) as out:
        for row in range(n):
            feature = {}
            for name, a in arrays.items():
                value = a[row]
                if kinds[name] == "int64":
                    feature[name] = tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[int(value)])
                    )
                elif kinds[name] == "float":
                    feature[name] = tf.train.Feature(
                        float_list=tf.train.FloatList(value=[float(value)])
                    )
                else:
                    data = str(value).encode("utf-8")
                    feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            out.write(example.SerializeToString())


def _write_parquet(path: str, arrays: dict[str, np.ndarray], labels: set[str]) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("writing Parquet needs pyarrow: pip install pyarrow") from None
    fields = {}
    for name, a in arrays.items():
        kind = _kind(a)
        if kind == "string":
            # Missing strings are "", never null: tensorflow-io 0.37.1 mis-reads nulls.
            fields[name] = pa.array([str(v) for v in a], type=pa.string())
        else:
            # from_pandas=False keeps NaN a float value instead of a null (see above).
            fields[name] = pa.array(
                a.astype(np.int64 if kind == "int64" else a.dtype), from_pandas=False
            )
        if fields[name].null_count:
            raise DataError(f"{path}: column '{name}' would hold nulls")
    pq.write_table(pa.table(fields), path)
