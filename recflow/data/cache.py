"""Parse once across epochs: a file run's training rows, parsed once, read from memory.

A local run of several epochs over CSV or TFRecord files parses (and checks)
its training files once, before its first cached epoch, into a cache on disk
(`data.cache_dir`, default `MODEL_DIR/cache/`); the cache is loaded into memory
and every epoch from then on reads its batches from it. An epoch read from the
cache gives the batches that parsing the files again would give, bit for bit:

- order: the epoch's record keys come from the very shuffle the files would go
  through (`records.batched` over record numbers instead of lines: same seeds, same
  counts, same order), and a batch holds the records of its keys that parsing keeps,
  in order. The keys are made in numpy in that order and reach the shuffle a block at
  a time (`records.record_blocks`), not a record at a time;
- values: the ids of categorical and sequence features (integer ops only) are kept
  as transformed; every other feature keeps its parsed column and is transformed
  per batch, as when parsing (a float op such as log1p may round a value
  differently at another position of a batch: Eigen's vector and scalar paths);
- counts: each record's status (kept, bad, or an ignored blank line) and its
  non-finite values, so `bad_records`, `nonfinite_values` and `truncated_rows` match.

On disk, `DIR/train-<key>/` holds one `.npy` file per array and `manifest.json`,
written last into a temp dir that is then renamed into place. The key covers the
files' identity (path, size, mtime) and everything the parse and the kept
transforms depend on (data options, features, labels); the manifest holds each
array's dtype, shape and CRC-32, the files' contents' CRC-32s, and its own CRC-32,
all checked at every load. A cache that is partial (killed while written),
damaged, or built from other files or another config is never used: it is rebuilt.
In the model dir (no `data.cache_dir`), caches of other keys are removed when a new
one is written, and the whole `cache/` when the run ends.

The position inside an epoch read from the cache is the key pipeline's iterator
(range positions and the shuffle buffer of key blocks), checkpointed like the
parsing iterator. Beside it the checkpoint records the files' contents (CRC-32s):
a position resumes over the very same contents only (files moved or touched are
the same files; changed ones are refused before anything is parsed). Why not tf.data's own (TF 2.17.1, measured; docs/performance.md):

- `Dataset.cache(filename)`: used whatever files or config made it (keyed by its
  name only); a kill -9 while it is written leaves a lock file that fails the next
  run (AlreadyExistsError); a damaged file fails every run (DataLossError) until
  deleted by hand; and it replays whole elements, so a cache of epoch 1's batches
  is epoch 1's order again.
- `Dataset.snapshot(path)`: its key ignores shuffle seeds (`shuffle(seed=2)` reads
  the snapshot `shuffle(seed=1)` wrote), so every epoch would repeat epoch 1's order.
- `Dataset.save` / `load`: nothing marks a save complete: `load` of a killed save
  yields its first elements, then fails (DataLossError) mid-pass.

Streams (`--follow`, Kafka) and parameter-server runs do not use the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from recflow.config.schema import Config
from recflow.data import pipeline, records, sources
from recflow.features.kinds import Categorical, kind_of
from recflow.features.kinds import Sequence as SequenceKind

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
VARIABLE = "input_cache"  # the checkpoint's record of where its input position was read
ORDER = 2  # `position_record`'s `order`: record keys made in blocks (absent: a record at a time)
FROM_FILES = "files"  # its value for a position read from the files, before it named them
FORMATS = ("csv", "tfrecord")  # readers built on `records.numbered`
MEMORY_FRACTION = 0.25  # `auto` leaves out training files larger than this part of the memory
_NOT_KEPT, _BAD = -1, -2  # `record_rows` of a record that is not a row: ignored, bad


def first_epoch(config: Config, files: Sequence[str] | None) -> int | None:
    """The first epoch a local run reads from the cache, or None when it reads none.

    `data.cache: auto` caches runs of CSV or TFRecord files: from the first epoch
    when `train.epochs` is 2 or more, from the second when `train.steps` decides
    (a run of one epoch parses its files once anyway). Training files larger than
    a quarter of the machine's memory are left out (the cache is held in memory).
    """
    if config.data.cache != "auto" or not files or config.data.format not in FORMATS:
        return None
    epochs = config.train.total_epochs
    if epochs is not None and epochs < 2:
        return None
    size = sum(os.path.getsize(f) for f in files)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if size > MEMORY_FRACTION * memory:
        logger.info("data.train: %d MB of files, not cached in memory", size >> 20)
        return None
    return 0 if epochs is not None else 1


def for_run(config: Config, files: Sequence[str] | None, model_cache: str) -> InputCache | None:
    """The input cache of a local run over `files` (None for other formats), kept in
    `data.cache_dir` or else `model_cache` (the model dir's)."""
    if not files or config.data.format not in FORMATS:
        return None
    return InputCache(config, files, config.data.cache_dir or model_cache, first_epoch(config, files))


def parse_identity(config: Config) -> str:
    """What a cache's contents depend on besides the files: the data options that
    decide which records are kept and how columns are parsed, the features (their
    transforms) and the label uses; not the order, batching or any training option."""
    order = {"train", "eval", "seed", "shuffle", "shuffle_buffer", "batch_size", "cache",
             "cache_dir", "sample_rows", "max_bad_fraction"}  # fmt: skip
    data = {f.name: getattr(config.data, f.name) for f in dataclasses.fields(config.data)}
    data = {k: v for k, v in data.items() if k not in order}
    return repr((data, config.features, sources.needs(config)))


def contents(files: Sequence[str]) -> list[int]:
    """The CRC-32 of each file's bytes, in order."""
    out = []
    for file in files:
        crc = 0
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                crc = zlib.crc32(chunk, crc)
        out.append(crc)
    return out


def files_identity(files: Sequence[str]) -> list:
    """`[path, size, mtime_ns]` of each file, in order."""
    identity = []
    for file in files:
        stat = os.stat(file)
        identity.append([os.path.abspath(file), stat.st_size, stat.st_mtime_ns])
    return identity


class InputCache:
    """The parsed training rows of a run, on disk and (once loaded) in memory.

    Args:
        config: the run config.
        files: the training files, in the order the reader numbers them.
        directory: where the cache lives (`train-<key>/` inside it).
        first_epoch: the first epoch read from it (see `first_epoch`), or None.
    """

    def __init__(self, config: Config, files: Sequence[str], directory: str, first_epoch: int | None):
        self.config = config
        self.files = [str(f) for f in files]
        self.directory = directory
        self.first_epoch = first_epoch
        self._key: str | None = None
        self._arrays: dict | None = None  # name -> tf.Variable, once loaded
        self.records: list[int] = []  # records per file (lines after the header, blank ones too)
        self.first = 0  # the number of a file's first record (`records.numbered`)
        self.contents: list[int] = []  # CRC-32 of each file's bytes, as the cache was built

    # ------------------------------------------------------------------ identity

    @property
    def key(self) -> str:
        """sha256 of the files' identity and `parse_identity`."""
        if self._key is None:
            text = json.dumps(
                {"format": FORMAT, "files": files_identity(self.files), "parse": parse_identity(self.config)}
            )
            self._key = hashlib.sha256(text.encode()).hexdigest()
        return self._key

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"train-{self.key[:16]}")

    def position_record(self, by_record: bool = False) -> dict:
        """What the checkpoint saves beside a position read from this cache: the layout
        of records the position's keys index, and how the epoch's record keys were made
        (`order`, see `dataset`; a position only restores into its own pipeline)."""
        record = {"key": self.key, "records": self.records, "first": self.first, "contents": self.contents}
        return record if by_record else {**record, "order": ORDER}

    def holds_contents_of(self, record: dict) -> bool:
        """Whether the files hold the contents a position saved with `position_record`
        was read from (read before the cache is loaded: other files are refused before
        they are parsed). A record from before contents were recorded passes here;
        `fits` compares its layout."""
        return "contents" not in record or record["contents"] == contents(self.files)

    def fits(self, record: dict) -> bool:
        """Whether a position saved with `position_record` indexes this loaded cache's
        records (the same files: see `holds_contents_of`)."""
        same = record["records"] == self.records and record["first"] == self.first
        return same and record.get("contents", self.contents) == self.contents

    # ------------------------------------------------------------------ the epochs

    def dataset(self, config: Config, by_record: bool = False) -> tf.data.Dataset:
        """One epoch of transformed batches, in the order `config.data` (seeded for the
        epoch) gives the files' records; builds or loads the cache on first use.

        The epoch's record keys are made in numpy, in the order the files' pipeline reads
        them (`records.file_order`, `records.interleaved`), and go to the shuffle a block
        at a time (`records.record_blocks`). `by_record` makes them as the files' pipeline
        does instead, a record at a time, with record numbers for records: the pipeline a
        position saved without `order` was read in (versions before blocks).
        """
        self.load()
        data = config.data
        if by_record:
            names = tf.constant(self.files)
            counts = tf.constant(self.records, tf.int64)

            def numbers(name):  # a file's record numbers instead of its records
                index = tf.argmax(tf.cast(tf.equal(names, name), tf.int32))
                return tf.data.Dataset.range(tf.gather(counts, index))

            keys = records.numbered(self.files, numbers, first=self.first, shuffle=data.shuffle, seed=data.seed)
            ds = records.batched(keys, data, shuffle=data.shuffle, epochs=1)
        else:
            n = len(self.files)
            mixed = data.shuffle and n > 1  # files in a seeded order, read interleaved
            order = records.file_order(n, data.seed) if mixed else range(n)
            files, numbers = records.interleaved(order, self.records, min(n, records.INTERLEAVE) if mixed else 1)
            size = records.block_size(data) if data.shuffle else data.batch_size
            ds = records.record_blocks(files, numbers, self.first, size)
            if data.shuffle:
                ds = records.shuffled(ds, data, epochs=1)
        ds = ds.map(records.plain(self._batch), num_parallel_calls=records.AUTOTUNE, deterministic=True)
        options = records.options()
        # The map reads the cache's variables, which never change: their state is no
        # part of the position.
        options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
        return ds.prefetch(records.AUTOTUNE).with_options(options)

    def _batch(self, keys, _numbers):
        """The transformed batch of the records `keys`, as parsing would give it."""
        a = self._arrays
        offsets = tf.gather(a["offsets"], keys // records.FILE_STRIDE)
        rows = tf.gather(a["record_rows"], offsets + keys % records.FILE_STRIDE - self.first)
        kept = tf.boolean_mask(rows, rows >= 0)
        bad = tf.reduce_sum(tf.cast(tf.equal(rows, _BAD), tf.int64))
        features, raw = {}, {}
        for f in self.config.features:
            if _kept_transformed(f):
                features[f.name] = _gather(a, f"ids:{f.name}", kept)
            else:
                raw[f.name] = _gather(a, f"raw:{f.name}", kept)
        counts: dict = {}
        for f in self.config.features:
            if f.name in raw:
                features[f.name] = kind_of(f).transform(raw[f.name], counts)
        features[records.NONFINITE] = tf.reduce_sum(tf.gather(a["nonfinite"], kept))
        features[records.TRUNCATED] = tf.cast(counts.get("truncated", 0), tf.int64)
        labels = {label: _gather(a, f"label:{label}", kept) for label in self.config.labels}
        return features, labels, bad

    # ------------------------------------------------------------------ load / build

    def load(self) -> None:
        """Loads the cache into memory: the one on disk when it checks out, else a new
        one parsed from the files."""
        if self._arrays is not None:
            return
        arrays = self._read()
        if arrays is None:
            arrays = self._build()
        with tf.init_scope(), tf.device("/CPU:0"):
            self._arrays = {name: _variable(name, value) for name, value in arrays.items()}

    def close(self) -> None:
        """Releases the memory and removes the cache's files (the run is done with them):
        the model dir's whole `cache/` (this run's alone), or in a `data.cache_dir` of the
        user's own (which may hold others' caches) this cache's dir only."""
        self._arrays = None
        shutil.rmtree(self.path if self.config.data.cache_dir else self.directory, ignore_errors=True)

    def _read(self) -> dict | None:
        """The arrays of the cache on disk, or None (and a log line) when there is none
        for this key or it does not check out."""
        path = self.path
        if not os.path.isdir(path):
            return None
        try:
            with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
                manifest = json.load(f)
            if manifest.pop("crc32", None) != _crc(manifest):
                raise ValueError(f"{MANIFEST}: checksum mismatch")
            if manifest.get("format") != FORMAT or manifest.get("key") != self.key:
                raise ValueError("built from other files or another config")
            arrays = {}
            for name, entry in manifest["arrays"].items():
                value = np.load(os.path.join(path, entry["file"]), allow_pickle=False)
                if str(value.dtype) != entry["dtype"] or list(value.shape) != entry["shape"]:
                    raise ValueError(f"{entry['file']}: not the array the manifest describes")
                if zlib.crc32(memoryview(np.ascontiguousarray(value)).cast("B")) != entry["crc32"]:
                    raise ValueError(f"{entry['file']}: checksum mismatch")
                arrays[name] = value
            self.records, self.first = manifest["records"], manifest["first"]
            self.contents = manifest["contents"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("input cache %s is unusable (%s); parsing the files again", path, e)
            return None
        logger.info("input cache: %s", path)
        return arrays

    def _build(self) -> dict:
        """Parses the files once (file order) into the cache's arrays, writes them."""
        logger.info("input cache: parsing %d file(s) once into %s", len(self.files), self.path)
        self.contents = contents(self.files)
        columns = _parse(self.config, self.files)
        keys = columns.pop("keys")
        status = columns.pop("status")
        self.records, self.first = _layout(keys, len(self.files))
        record_rows = np.full(keys.shape, _NOT_KEPT, np.int64)
        kept = status == records.KEPT
        record_rows[kept] = np.arange(int(kept.sum()), dtype=np.int64)
        record_rows[status == records.BAD] = _BAD
        columns["record_rows"] = record_rows
        columns["offsets"] = np.concatenate([[0], np.cumsum(self.records)[:-1]]).astype(np.int64)
        self._write(columns)
        return columns

    def _write(self, arrays: dict) -> None:
        """Writes the arrays and then the manifest into a temp dir, renamed into place."""
        os.makedirs(self.directory, exist_ok=True)
        _remove_stale(self.directory, others=not self.config.data.cache_dir)
        shutil.rmtree(self.path, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=self.directory)
        try:
            entries = {}
            for i, (name, value) in enumerate(sorted(arrays.items())):
                file = f"{i:03d}.npy"
                value = np.ascontiguousarray(value)
                np.save(os.path.join(tmp, file), value, allow_pickle=False)
                entries[name] = {"file": file, "dtype": str(value.dtype), "shape": list(value.shape),
                                 "crc32": zlib.crc32(memoryview(value).cast("B"))}  # fmt: skip
            manifest = {"format": FORMAT, "key": self.key, "files": files_identity(self.files),
                        "contents": self.contents, "records": self.records, "first": self.first,
                        "arrays": entries}  # fmt: skip
            manifest["crc32"] = _crc(manifest)
            with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
            os.rename(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _kept_transformed(feature) -> bool:
    """Whether a feature is cached as its transform's ids (integer ops: the same at any
    position of a batch), else as its parsed column, transformed per batch."""
    return type(kind_of(feature)) in (Categorical, SequenceKind)


def _parse(config: Config, files: list[str]) -> dict:
    """One pass over `files` in order: numpy arrays of every record's key and status,
    and every kept row's columns (see `InputCache`)."""
    ds = pipeline.make_file_dataset(config, files, epochs=1, shuffle=False, per_record=True)

    def rows(raw, labels, _bad):
        out = {"keys": raw[records.RECORDS], "status": raw[records.STATUS],
               "nonfinite": raw[records.ROW_NONFINITE]}  # fmt: skip
        for f in config.features:
            if _kept_transformed(f):
                out.update(_split(f"ids:{f.name}", kind_of(f).transform(raw[f.name])))
            else:
                out.update(_split(f"raw:{f.name}", raw[f.name]))
        out.update({f"label:{label}": value for label, value in labels.items()})
        return out

    parts: dict[str, list] = {}
    ds = ds.map(records.plain(rows), num_parallel_calls=records.AUTOTUNE, deterministic=True)
    for batch in ds.prefetch(records.AUTOTUNE):
        for name, value in batch.items():
            parts.setdefault(name, []).append(value.numpy())
    arrays = {name: np.concatenate(values) for name, values in parts.items()}
    for name in [n for n in arrays if n.endswith(":lengths")]:  # ragged: lengths -> splits
        arrays[name[: -len(":lengths")] + ":splits"] = _splits(arrays.pop(name))
    for name in [n for n in arrays if arrays[n].dtype == object]:  # strings: bytes + offsets
        values = arrays.pop(name)
        arrays[f"{name}:bytes"] = np.frombuffer(b"".join(values), np.uint8)
        arrays[f"{name}:offsets"] = _splits(np.fromiter(map(len, values), np.int64, len(values)))
    return arrays


def _splits(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _split(name: str, value) -> dict:
    """A column as flat arrays: a ragged one as values and row lengths."""
    if isinstance(value, tf.RaggedTensor):
        if value.ragged_rank != 1:
            raise ValueError(f"{name}: a ragged rank of {value.ragged_rank} is not cached")
        return {f"{name}:values": value.values, f"{name}:lengths": value.row_lengths()}
    return {name: value}


def _layout(keys: np.ndarray, files: int) -> tuple[list[int], int]:
    """(records per file, the first record's number) from the keys of one pass in file
    order; checks that each file's records are numbered without a gap."""
    index, number = keys // records.FILE_STRIDE, keys % records.FILE_STRIDE
    counts = np.bincount(index, minlength=files).astype(np.int64)
    first = int(number[0]) if keys.size else 1
    expected = first + np.concatenate([np.arange(c) for c in counts]) if keys.size else number
    if np.any(np.diff(keys) <= 0) or not np.array_equal(number, expected):
        raise ValueError("the records of a pass in file order are not numbered in order")
    return [int(c) for c in counts], first


def _variable(name: str, value: np.ndarray) -> tf.Variable:
    """A cached array in memory; a string column's bytes as one scalar string."""
    if name.endswith(":bytes"):
        value = value.tobytes()
    return tf.Variable(value, trainable=False, name="input_cache")


def _gather(arrays: dict, name: str, rows: tf.Tensor):
    """Rows of a cached column: ragged when it has `:splits`, strings when `:bytes`."""
    if f"{name}:bytes" in arrays:
        offsets = arrays[f"{name}:offsets"]
        starts = tf.gather(offsets, rows)
        return tf.strings.substr(arrays[f"{name}:bytes"], starts, tf.gather(offsets, rows + 1) - starts)
    if f"{name}:splits" in arrays:
        splits = arrays[f"{name}:splits"]
        starts, limits = tf.gather(splits, rows), tf.gather(splits, rows + 1)
        index = tf.ragged.range(starts, limits)
        values = tf.gather(arrays[f"{name}:values"], index.flat_values)
        return tf.RaggedTensor.from_row_splits(values, index.row_splits, validate=False)
    return tf.gather(arrays[name], rows)


def _crc(manifest: dict) -> int:
    """The CRC-32 of a manifest's fields (its own `crc32` left out)."""
    return zlib.crc32(json.dumps(manifest, sort_keys=True).encode())


def _remove_stale(directory: str, others: bool) -> None:
    """Removes the temp dirs of writers that are no longer running, and with `others` the
    caches of other keys (the model dir's own `cache/`: its old caches, e.g. of files
    changed since)."""
    for name in os.listdir(directory):
        if others and name.startswith("train-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            continue
        if not name.startswith(".tmp-"):
            continue
        try:
            pid = int(name.split("-")[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


__all__ = ["InputCache", "first_epoch", "for_run"]
