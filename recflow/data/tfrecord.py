"""TFRecord files of `tf.train.Example` -> batches, parsed with `tf.io.parse_example`.

One Example per row and one feature per column: int64 ids as `int64_list`,
numbers and labels as `float_list`, everything else as `bytes_list` (what
`recflow.data.writer` writes). The list type of each column is read from the
first record of the first file, so an int64 column also serves a string feature.
A scalar column holds at most one value: a record with more is malformed
(`on_bad_record`), one with none reads as missing. Every column is parsed as a
list (`RaggedFeature`), so a record of another length is one bad row, not a
failed batch. A missing numeric value reads as NaN, a missing id as -1, a missing string as "";
a multi_hot/sequence column stored as a list of several values is joined with the
feature's separator. A record without a label is malformed (`on_bad_record`);
messages name it as `{file}: record {n}` (1-based).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import tensorflow as tf

from recflow.config.schema import Config
from recflow.data import records, sources
from recflow.data.sources import INT64, STRING
from recflow.errors import DataError

_NATURAL = {INT64: tf.int64, STRING: tf.string}  # other kinds: float32
_LIST_DTYPES = {"int64_list": tf.int64, "float_list": tf.float32, "bytes_list": tf.string}


def stored_dtypes(file: str) -> dict[str, tf.DType]:
    """Column -> dtype of its list in the first record of `file` (empty for an empty file).

    Reads the record framing in Python (no TensorFlow op), so this also works
    while a dataset function is being traced.
    """
    try:
        with open(file, "rb") as f:
            head = f.read(12)  # uint64 length, uint32 masked CRC of the length
            payload = f.read(struct.unpack("<Q", head[:8])[0]) if len(head) == 12 else b""
    except OSError as e:
        raise DataError(f"{file}: cannot read ({e.strerror})") from None
    if not payload:
        return {}
    try:
        example = tf.train.Example.FromString(payload)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError type depends on its version
        raise DataError(f"{file}: the first record is not a tf.train.Example") from None
    result = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind in _LIST_DTYPES:
            result[name] = _LIST_DTYPES[kind]
    return result


def first_truncated(files: Sequence[str]) -> str | None:
    """`{file}: record {n}` of the first record of `files` that ends before its framing says
    (what TensorFlow reports as a `truncated record` without naming the file), or None.
    Reads the length headers only."""
    for file in files:
        size, at, n = os.path.getsize(file), 0, 0
        with open(file, "rb") as f:
            while at < size:
                n += 1
                f.seek(at)
                head = f.read(12)  # uint64 length, uint32 masked CRC of the length
                at += 12 + (struct.unpack("<Q", head[:8])[0] + 4 if len(head) == 12 else 0)
                if len(head) < 12 or at > size:
                    return f"{file}: record {n}"
    return None


def _one_value_checks(parsed: dict, scalar: set[str]) -> list[records.Check]:
    """A column read as one value a row holds at most one in each record."""
    checks = []
    for column in sorted(scalar):
        lengths = parsed[column].row_lengths()
        checks.append((
            lengths <= 1,
            lambda i, column=column, lengths=lengths: tf.strings.join(
                [f"column '{column}': expected one value, got ", tf.strings.as_string(lengths[i])]
            ),
        ))  # fmt: skip
    return checks


def dataset(
    config: Config,
    files: Sequence[str],
    *,
    epochs: int | None,
    shuffle: bool,
    rows: tuple[int, int] | None = None,
    per_record: bool = False,
) -> tf.data.Dataset:
    """The TFRecord dataset of `files` (see `recflow.data.make_file_dataset`)."""
    uses = records.unique(sources.needs(config))
    stored = stored_dtypes(files[0])
    dtypes: dict[str, tf.DType] = {}
    scalar: set[str] = set()
    for use in uses:
        dtype = dtypes.setdefault(use.column, stored.get(use.column, _NATURAL.get(use.kind, tf.float32)))
        if use.separator is None:
            scalar.add(use.column)
        # Fail now, naming the file, when the stored type cannot serve this use.
        records.typed(tf.ragged.constant([[]], dtype=dtype), use, files[0])
    parse_spec = {column: tf.io.RaggedFeature(dtype) for column, dtype in dtypes.items()}

    examples = records.numbered(
        files, tf.data.TFRecordDataset, first=1, shuffle=shuffle, seed=config.data.seed, rows=rows
    )
    ds = records.batched(examples, config.data, shuffle=shuffle, epochs=epochs)

    def parse(keys, serialized, names):
        parsed = tf.io.parse_example(serialized, parse_spec)
        decoded = {use.key: records.typed(parsed[use.column], use, files[0]) for use in uses}
        present = tf.ones_like(keys, dtype=tf.bool)
        keep, bad, deps = records.screen(
            _one_value_checks(parsed, scalar) + records.label_checks(config, decoded)
            + records.id_list_checks(config, decoded),
            present,
            config.data.on_bad_record,
            records.locator(names, keys, "record"),
            fatal=records.fatal_checks(config, decoded),
        )
        return records.outputs(config, decoded, bad, keep, deps)

    key = records.parse_key(config, "tfrecord", repr(sorted(dtypes.items())), tuple(sorted(scalar)))
    return records.finish(ds, parse, files, key, per_record=per_record)
