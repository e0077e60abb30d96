"""Parquet files -> batches, read with `tensorflow_io.IODataset.from_parquet`.

Limitations (tensorflow-io 0.37.1, measured):
- NULLs are mis-read: the values after a null shift (a null in a string column
  aborts the process). Write missing numbers as a float NaN value and missing
  strings as "" (`recflow.data.writer` does), never as nulls: a file with a null
  in a column the config reads is refused up front (`sources.check_parquet_nulls`).
- `from_parquet` opens the file when the dataset is built, so the files must be
  readable from the process that builds the pipeline; building it in graph mode
  (inside `tf.function`) needs pyarrow for the column types.
- Iterator checkpoints rely on tensorflow-io's dataset ops saving their state;
  with 0.37.1 a restored iterator continued at the right row (checked by hand,
  not in the tests, as opening Parquet is slow), other versions may not.
- Throughput is modest (~10k rows/s for 40 columns on one core): IODataset
  yields one row at a time per column.
- With shuffle on, the file order is shuffled once (seeded), not every epoch;
  the record shuffle buffer mixes rows as for the other formats.
A record with a NaN label is malformed (`on_bad_record`); messages name it as
`{file}: row {n}` (1-based).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from recflow.config.schema import Config
from recflow.data import records, sources
from recflow.errors import DataError


def _specs(file: str, columns: list[str]) -> dict[str, tf.TensorSpec] | list[str]:
    """Column specs from the Parquet schema (read with pyarrow when installed).

    tensorflow-io needs them to build the dataset in graph mode (a dataset
    function traced by `tf.function`); without pyarrow the plain list of names
    works eagerly only.
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return columns
    schema = pq.read_schema(file)
    specs = {}
    for column in columns:
        arrow = schema.field(column).type
        if (
            pa.types.is_string(arrow)
            or pa.types.is_large_string(arrow)
            or pa.types.is_binary(arrow)
        ):
            dtype = tf.string
        elif (
            pa.types.is_integer(arrow) or pa.types.is_floating(arrow) or pa.types.is_boolean(arrow)
        ):
            dtype = tf.as_dtype(arrow.to_pandas_dtype())
        else:
            raise DataError(f"{file}: column '{column}' has the unsupported Parquet type {arrow}")
        specs[column] = tf.TensorSpec([], dtype)
    return specs


def _open(file: str, columns: list[str]) -> tf.data.Dataset:
    import tensorflow_io as tfio

    try:
        ds = tfio.IODataset.from_parquet(file, columns=_specs(file, columns))
    except (tf.errors.OpError, OSError, ValueError) as e:
        raise DataError(f"{file}: cannot read Parquet ({str(e).splitlines()[0]})") from None
    if all(c in ds.element_spec for c in columns):
        return ds
    # Some tensorflow-io builds key the element by bytes column names.
    return ds.map(records.plain(lambda row: {c: row[c.encode()] for c in columns}))


def _caster(dtypes: dict[str, tf.DType]):
    return lambda row: {c: tf.cast(row[c], dtype) for c, dtype in dtypes.items()}


def dataset(
    config: Config, files: Sequence[str], *, epochs: int | None, shuffle: bool
) -> tf.data.Dataset:
    """The Parquet dataset of `files` (see `recflow.data.make_file_dataset`)."""
    uses = records.unique(sources.needs(config))
    columns = sorted({u.column for u in uses})
    order = list(range(len(files)))
    if shuffle:
        order = [int(i) for i in np.random.default_rng(config.data.seed).permutation(len(files))]
    combined = None
    dtypes = None
    for i in order:
        ds = _open(files[i], columns)
        spec = {c: ds.element_spec[c].dtype for c in columns}
        if dtypes is None:
            dtypes = spec
            for use in uses:  # fail now, naming the file, when a stored type cannot serve
                records.typed(tf.zeros([0], dtype=dtypes[use.column]), use, files[i])
        elif spec != dtypes:
            ds = ds.map(records.plain(_caster(dtypes)))
        ds = ds.enumerate(start=i * records.FILE_STRIDE + 1)
        combined = ds if combined is None else combined.concatenate(ds)
    ds = records.batched(combined, config.data, shuffle=shuffle, epochs=epochs)

    def parse(keys, row, names):
        decoded = {use.key: records.typed(row[use.column], use, files[0]) for use in uses}
        keep, bad, deps = records.screen(
            records.label_checks(config, decoded) + records.id_list_checks(config, decoded),
            tf.ones_like(keys, dtype=tf.bool),
            config.data.on_bad_record,
            records.locator(names, keys, "row"),
            fatal=records.fatal_checks(config, decoded),
        )
        return records.outputs(config, decoded, bad, keep, deps)

    return records.finish(ds, parse, files, records.parse_key(config, "parquet", repr(sorted(dtypes.items()))))
