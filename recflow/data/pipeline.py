"""Input pipelines: files or synthetic rows -> batches of `(features, labels, bad)`.

Every pipeline is built from checkpointable tf.data ops only (no generators, no
`py_function`), so `tf.train.Checkpoint(iterator=iter(ds))` saves the input
position. The element of a dataset:

    features: {feature name: [batch] tensor in the raw serving form}
              categorical int64 -> int64 (-1 when empty); categorical string,
              multi_hot and sequence -> string ("a|b|c"); numeric -> float32
              (NaN when empty or missing)
    labels:   {label name: [batch] float32}
    bad:      int64 scalar, malformed records dropped from this batch

`features[NONFINITE]` is an int64 scalar: the numeric values of the kept rows
that are not finite (inf, overflow, "nan"); the transforms treat them as missing.

Batches hold `data.batch_size` records; the last one, and batches that lost
malformed records, are smaller. With shuffle off the order is the file order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from recflow.config.schema import Config
from recflow.data import csv, parquet, sources, synthetic, tfrecord
from recflow.data.records import batched, finish, outputs, parse_key, reused, typed, unique
from recflow.errors import DataError

_READERS = {"csv": csv, "tfrecord": tfrecord, "parquet": parquet}


@tf.autograph.experimental.do_not_convert  # builds a pipeline; may run in a tf.function
def make_dataset(
    config: Config, split: str, *, epochs: int | None, shuffle: bool | None = None
) -> tf.data.Dataset:
    """The dataset of a split of the configured data.

    Args:
        config: the run config (`data` section, features and labels).
        split: "train" or "eval".
        epochs: passes over the data; None repeats forever.
        shuffle: defaults to `data.shuffle` for train and False for eval.

    Raises:
        DataError: no files, a missing column, or no `data.eval` for split "eval".
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if shuffle is None:
        shuffle = config.data.shuffle if split == "train" else False
    if config.data.format == "synthetic":
        sources.check_synthetic(config)
        return synthetic_dataset(config, split, epochs=epochs, shuffle=shuffle)
    patterns = config.data.train if split == "train" else config.data.eval
    if not patterns:
        raise DataError(f"data.{split}: not set")
    files = sources.expand(patterns, f"data.{split}")
    return make_file_dataset(config, files, epochs=epochs, shuffle=shuffle)


@tf.autograph.experimental.do_not_convert  # builds a pipeline; may run in a tf.function
def make_file_dataset(
    config: Config,
    files: Sequence[str],
    *,
    epochs: int | None,
    shuffle: bool | None = None,
    rows: tuple[int, int] | None = None,
    per_record: bool = False,
) -> tf.data.Dataset:
    """The dataset of explicit files of the configured format, in the given order.

    Args:
        config: the run config; `data.format` selects the reader.
        files: the files; with shuffle off they are read in this order.
        epochs: passes over the files; None repeats forever.
        shuffle: defaults to `data.shuffle`.
        rows: `(start, stop)`: only records `start` to `stop - 1` (0-based, a CSV
            header not counted) of the one file (CSV or TFRecord); messages keep
            the file's own line / record numbers. `--follow` reads appended rows so.
        per_record: also give each batch's per-record keys (`records.RECORDS`,
            `STATUS`, `ROW_NONFINITE`; CSV and TFRecord), which `recflow.data.cache` keeps.
    """
    files = [str(f) for f in files]
    if not files:
        raise DataError("no data files to read")
    shuffle = config.data.shuffle if shuffle is None else shuffle
    sources.check_files(config, files)
    fmt = config.data.format
    reader = _READERS.get(fmt)
    if reader is None:
        raise DataError(f"data.format: {fmt!r} has no files; use make_dataset")
    if per_record:
        if fmt == "parquet" or rows is not None:
            raise ValueError("per_record: reads whole CSV or TFRecord files only")
        return reader.dataset(config, files, epochs=epochs, shuffle=shuffle, per_record=True)
    if rows is None:
        return reader.dataset(config, files, epochs=epochs, shuffle=shuffle)
    if len(files) != 1 or fmt == "parquet":
        raise ValueError(f"rows: reads a range of one CSV or TFRecord file, got {len(files)} {fmt} file(s)")
    return reader.dataset(config, files, epochs=epochs, shuffle=shuffle, rows=rows)


@tf.autograph.experimental.do_not_convert  # builds a pipeline; may run in a tf.function
def synthetic_dataset(
    config: Config, split: str, *, epochs: int | None, shuffle: bool
) -> tf.data.Dataset:
    """The synthetic rows of a split, generated once and sliced."""
    columns, _ = synthetic.generate(config.data.synthetic, split)
    uses = unique(sources.needs(config))
    where = f"synthetic schema '{config.data.synthetic.schema}'"
    # Shuffle and batch row indices, then gather whole batches: no per-row tensors.
    data = {c: tf.constant(np.asarray(columns[c])) for c in sorted({u.column for u in uses})}
    rows = len(next(iter(columns.values())))
    ds = batched(tf.data.Dataset.range(rows), config.data, shuffle=shuffle, epochs=epochs)

    def parse(batch):
        decoded = {u.key: typed(batch[u.column], u, where) for u in uses}
        return outputs(config, decoded, tf.constant(0, tf.int64))

    # The parse captures nothing, so a run's epochs and its evaluation trace it once.
    specs = {c: (t.dtype.name, t.shape.rank) for c, t in data.items()}
    parse = reused(parse, parse_key(config, "synthetic", repr(specs)))
    return finish(ds, lambda index: parse({c: tf.gather(t, index) for c, t in data.items()}))


def first_bad_record(config: Config, files: Sequence[str]) -> str | None:
    """`{file}: line {n}: {reason}` of the first malformed record of `files`, in file
    order, or None when there is none. Reads up to that record."""
    strict = dataclasses.replace(config, data=dataclasses.replace(config.data, on_bad_record="fail"))
    ds = make_file_dataset(strict, files, epochs=1, shuffle=False)
    try:
        for _ in ds:
            pass
    except tf.errors.InvalidArgumentError as e:
        return sources.bad_record_message(e)
    return None


def check_bad_fraction(
    config: Config, examples: int, bad: int, files: Sequence[str] | None, where: str = "", by: str = ""
) -> None:
    """Raises DataError when `bad` rows exceed `data.max_bad_fraction` of the rows read
    (`examples + bad`), naming the first bad row of `files` when given: training's check
    and an evaluation's (`where`: `data.eval`, `by`: `the evaluation`)."""
    limit = config.data.max_bad_fraction
    read = examples + bad
    if not bad or bad <= limit * read:
        return
    first = first_bad_record(config, files) if files else None
    raise DataError(
        (f"{where}: " if where else "") + f"{bad} of {read} rows read" + (f" by {by}" if by else "")
        + f" are bad ({bad / read:.1%}, above data.max_bad_fraction {limit:g})"
        + (f"; first: {first}" if first else "")
    )


__all__ = ["make_dataset", "make_file_dataset"]
