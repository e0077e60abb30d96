"""The parts every reader builds its pipeline from: record numbering, batching
and block shuffle, the parse step's checks (`screen`), its outputs, and the
options and function reuse that keep epochs cheap.

A reader (`csv`, `tfrecord`, `parquet`, `kafka`) turns its records into
`(key, record)` pairs with `numbered`, batches them with `batched`, decodes
columns with `typed`, drops or fails malformed rows with `screen`, and returns
`finish(ds, parse, ...)`. `pipeline` picks the reader for a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Callable

import numpy as np
import tensorflow as tf

from recflow.config.schema import Config, DataConfig
from recflow.data import sources
from recflow.data.sources import INT64, LABEL, STRING, Need
from recflow.errors import DataError

AUTOTUNE = tf.data.AUTOTUNE
NONFINITE = "/nonfinite"  # features key: count of non-finite numeric values in the batch
TRUNCATED = "/truncated"  # transformed features key: multi_hot rows cut to max_values
# Per-record features keys of a pipeline built with `per_record=True` (`recflow.data.cache`):
RECORDS = "/records"  # [batch] int64: the key of every record of the batch, kept or not
STATUS = "/status"  # [batch] int8: KEPT, BAD (dropped and counted) or IGNORED (a blank line)
ROW_NONFINITE = "/row_nonfinite"  # [kept] int64: each kept row's non-finite numeric values
IGNORED, KEPT, BAD = 0, 1, 2
_PER_RECORD = (RECORDS, STATUS, ROW_NONFINITE)
FILE_STRIDE = 2**40  # record keys: file index * FILE_STRIDE + record number
SHUFFLE_BLOCK = 256  # records shuffled as one block (see `batched`)
INTERLEAVE = 4  # shuffled files are read this many at a time, a record from each in turn
LONG_ROW = 4096  # bytes: a multi-valued value this long is cut before it is split (`first_values`)
# A validity check of a batch: (ok [batch] bool, row index -> scalar reason string).
Check = tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]


def unique(uses: Sequence[Need]) -> list[Need]:
    """The uses with distinct keys, in first-use order."""
    seen: dict = {}
    for use in uses:
        seen.setdefault(use.key, use)
    return list(seen.values())


def numbered(
    files: Sequence[str],
    reader: Callable[[tf.Tensor], tf.data.Dataset],
    *,
    first: int,
    shuffle: bool,
    seed: int,
    rows: tuple[int, int] | None = None,
) -> tf.data.Dataset:
    """Records of all files as `(key, record)`, key = file index * FILE_STRIDE + number.

    Packing the file index into the record number keeps the element small (no
    per-record zip or map); `locator` unpacks it for messages.

    Args:
        files: file names.
        reader: file name tensor -> dataset of records.
        first: the number of the first record of a file (e.g. 2 after a header line).
        shuffle: shuffle the file order (each epoch) and read 4 files interleaved;
            otherwise read the files one after the other.
        seed: the shuffle seed.
        rows: `(start, stop)`: only records `start` to `stop - 1` of the one file.
    """
    if rows is not None:
        start, stop = rows
        records = reader(tf.constant(files[0])).skip(start).take(stop - start)
        return records.enumerate(start=first + start)
    if len(files) == 1:
        return reader(tf.constant(files[0])).enumerate(start=first)
    ds = tf.data.Dataset.from_tensor_slices(
        (tf.range(len(files), dtype=tf.int64), tf.constant(list(files)))
    )
    if shuffle:
        ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)

    def one_file(index, name):
        return reader(name).enumerate(start=index * FILE_STRIDE + first)

    return ds.interleave(plain(one_file), cycle_length=min(len(files), INTERLEAVE) if shuffle else 1)


def batched(
    ds: tf.data.Dataset, data: DataConfig, *, shuffle: bool, epochs: int | None
) -> tf.data.Dataset:
    """Shuffles records (seeded), repeats, batches.

    The shuffle works on blocks of up to `SHUFFLE_BLOCK` consecutive records, so
    no op runs per record: each block's records are permuted (stateless, seeded by
    `data.seed` and the block's number) and the blocks are shuffled in a window of
    `data.shuffle_buffer` records (at least 8 blocks); then the blocks are cut into
    batches of `data.batch_size` records.
    """
    if not shuffle:
        if epochs is None or epochs != 1:
            ds = ds.repeat(epochs)
        return ds.batch(data.batch_size)
    return shuffled(ds.batch(block_size(data)), data, epochs=epochs)


def block_size(data: DataConfig) -> int:
    """Records per shuffle block (`batched`)."""
    return max(1, min(SHUFFLE_BLOCK, data.shuffle_buffer // 8))


def shuffled(blocks: tf.data.Dataset, data: DataConfig, *, epochs: int | None) -> tf.data.Dataset:
    """`batched`'s shuffle of blocks of `block_size(data)` records, then its batches."""
    block, seed = block_size(data), data.seed

    def permute(number, records):
        n = tf.shape(tf.nest.flatten(records)[0])[:1]
        order = tf.random.experimental.stateless_shuffle(
            tf.range(n[0]), seed=tf.stack([tf.constant(seed, tf.int64), number])
        )
        return tf.nest.map_structure(lambda t: tf.gather(t, order), records)

    ds = blocks.enumerate().map(plain(permute))
    ds = ds.shuffle(-(-data.shuffle_buffer // block), seed=seed, reshuffle_each_iteration=True)
    if epochs is None or epochs != 1:
        ds = ds.repeat(epochs)
    return ds.rebatch(data.batch_size)


def file_order(files: int, seed: int) -> list[int]:
    """The order `numbered` reads `files` shuffled files in (its seeded shuffle's first pass)."""
    ds = tf.data.Dataset.range(files).shuffle(files, seed=seed, reshuffle_each_iteration=True)
    return [int(i) for i in ds]


def interleaved(order: Sequence[int], counts: Sequence[int], cycle: int) -> tuple[np.ndarray, np.ndarray]:
    """(file index, record number) of each record, in the order that tf.data's
    `interleave(cycle_length=cycle)` (one record at a time) reads files of `counts`
    records, opened in `order`: a record from each open file in turn; a file that ends
    frees its slot, which the next file in `order` takes when the turn comes back to it.

    Whole rounds over the open files are made at once, so the work is per file, not
    per record.
    """
    slots: list[list[int] | None] = [None] * cycle  # [file, next record number]
    pending = list(order)[::-1]
    files, numbers = [], []
    position = 0
    while pending or any(slots):
        ready = [s for s in slots if s is not None]
        if (not pending or len(ready) == cycle) and ready and all(s[1] < counts[s[0]] for s in ready):
            rounds = min(counts[s[0]] - s[1] for s in ready)
            turn = [slots[(position + j) % cycle] for j in range(cycle)]
            turn = [s for s in turn if s is not None]
            files.append(np.repeat([[s[0] for s in turn]], rounds, axis=0).reshape(-1))
            numbers.append((np.array([s[1] for s in turn])[None, :] + np.arange(rounds)[:, None]).reshape(-1))
            for s in turn:
                s[1] += rounds
            continue
        slot = slots[position]
        if slot is None:
            if pending:
                slots[position] = [pending.pop(), 0]
                continue
        elif slot[1] < counts[slot[0]]:
            files.append(np.array([slot[0]]))
            numbers.append(np.array([slot[1]]))
            slot[1] += 1
        else:
            slots[position] = None
        position = (position + 1) % cycle
    if not files:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(files).astype(np.int64), np.concatenate(numbers).astype(np.int64)


def record_blocks(files: np.ndarray, numbers: np.ndarray, first: int, size: int) -> tf.data.Dataset:
    """What `numbered(...).batch(size)` gives when it reads the records (file index
    `files[i]`, record number `numbers[i]`) in this order, for a reader that yields each
    record's number (`recflow.data.cache`): (keys, numbers) of each `size` records, a
    block per element, sliced from variables, where the per-record pipeline passes every
    record through elements of its own (measured on 2 cores, 4,096-row batches: the keys'
    pipeline alone took 5.3 ms of CPU a batch; the whole cache pipeline went from 9.9-10.2
    to 8.5-9.2 ms)."""
    with tf.init_scope(), tf.device("/CPU:0"):
        keys = tf.Variable(files * FILE_STRIDE + first + numbers, trainable=False, name="record_keys")
        numbers = tf.Variable(numbers, trainable=False, name="record_numbers")
    total = int(files.size)

    def block(index):
        start = index * size
        stop = tf.minimum(start + size, total)
        return keys[start:stop], numbers[start:stop]

    return tf.data.Dataset.range(-(-total // size)).map(plain(block))


def finish(
    ds: tf.data.Dataset,
    fn: Callable,
    files: Sequence[str] | None = None,
    key: tuple | None = None,
    per_record: bool = False,
) -> tf.data.Dataset:
    """The vectorized per-batch map (parallel, order kept) and prefetch.

    `fn` is plain tensor code: it is traced as written, without AutoGraph (converting
    the parse functions cost seconds per pipeline).

    A file reader passes `files` and a `key` (see `parse_key`): then `fn(keys, records,
    names)` gets the files' names as a tensor (for messages, see `locator`), and is
    traced once per key (see `reused`), so a run's epochs and its evaluation trace
    their parsing once (a parse function is ~2,000 ops).

    The per-record keys that `outputs` adds (`STATUS`, `ROW_NONFINITE`) are dropped
    unless `per_record`; then `RECORDS` (the batch's record keys) is added too.
    """
    if key is None:
        whole = fn if per_record else (lambda *x: _without_per_record(fn(*x)))
        ds = ds.map(plain(whole), num_parallel_calls=AUTOTUNE, deterministic=True)
        return ds.prefetch(AUTOTUNE).with_options(options())
    parse = reused(fn, (*key, repr(ds.element_spec)))
    listed = list(files)

    def mapped(keys, records):
        # Any number of files: the shared trace must not depend on how many.
        names = tf.raw_ops.PlaceholderWithDefault(input=tf.constant(listed), shape=[None])
        features, labels, bad = parse(keys, records, names)
        if per_record:
            features = dict(features, **{RECORDS: keys})
        return features, labels, bad

    return finish(ds, mapped, per_record=per_record)


def _without_per_record(element: tuple) -> tuple:
    """`(features, labels, bad)` without the per-record keys of `outputs`."""
    features, labels, bad = element
    return {k: v for k, v in features.items() if k not in _PER_RECORD}, labels, bad


def options() -> tf.data.Options:
    """recflow's pipeline options: no model-based autotuning.

    Its optimizer thread made the end of an iterator wait for it: about a second, in
    roughly half of the runs, at the end of each training pass and of each evaluation
    (measured on 2 cores), the step time being the same without it. `AUTOTUNE` maps
    then run up to one call per core, and `AUTOTUNE` prefetch buffers still grow while
    their consumer waits. (tf.data's static graph rewrites stay on here: a checkpoint's
    input position names the rewritten graph's nodes, so turning them off would make
    the checkpoints of earlier versions unreadable; see `without_rewrites`.)
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def without_rewrites(ds: tf.data.Dataset) -> tf.data.Dataset:
    """`ds` without tf.data's static graph rewrites, for pipelines that are never
    checkpointed (a parameter-server chunk's: its split state is).

    The default rewrites (map fusion and parallelization, injected prefetch, ...) find
    nothing to do in recflow's pipelines, which already batch first, map in parallel
    and prefetch, yet each iterator start pays for them: the dataset graph (with a
    synthetic set's captured columns) is serialized, rewritten and rebuilt, 107 -> 72
    ms per iterator on the demo chunk, which a PS worker pays at every chunk.
    """
    no_rewrites = tf.data.Options()
    no_rewrites.experimental_optimization.apply_default_optimizations = False
    return ds.with_options(no_rewrites)


_TRACED: dict = {}  # key -> (graph_def, input names, output names, output structure) or _CAPTURES
_CAPTURES = object()  # a function that captures tensors: not reusable
_MAX_TRACED = 16


def reused(fn: Callable, key: tuple) -> Callable:
    """`fn` traced once per `key`: later calls import the traced ops into the caller's graph.

    Importing a traced graph is several times faster than tracing it again, and it
    leaves plain ops in a map function: a function-call op there would be stateful
    (the checks' assertions) and make the iterator impossible to checkpoint. A
    function that captures tensors from outside (resources, eager constants) is
    traced each time instead. `key` must name everything `fn`'s graph depends on,
    its arguments' specs included.
    """

    def call(*args):
        flat = tf.nest.flatten(args, expand_composites=True)
        entry = _TRACED.pop(key, None)
        if entry is None:
            specs = tf.nest.map_structure(tf.type_spec_from_value, args)
            traced = tf.function(plain(fn), autograph=False).get_concrete_function(*specs)
            entry = _CAPTURES  # it captures something: traced in place each time
            if len(traced.inputs) == len(flat):
                entry = (
                    traced.graph.as_graph_def(),
                    [t.name for t in traced.inputs],
                    [t.name for t in traced.outputs],
                    traced.structured_outputs,
                )
        _TRACED[key] = entry  # most recently used last
        while len(_TRACED) > _MAX_TRACED:
            _TRACED.pop(next(iter(_TRACED)))
        if entry is _CAPTURES:
            return plain(fn)(*args)
        graph_def, inputs, outputs, structure = entry
        results = tf.graph_util.import_graph_def(
            graph_def, input_map=dict(zip(inputs, flat)), return_elements=outputs, name="reused"
        )
        return tf.nest.pack_sequence_as(structure, results, expand_composites=True)

    return plain(call)


def parse_key(config: Config, reader: str, *parts) -> tuple:
    """What a reader's parse function depends on: its name, `parts` (e.g. the CSV
    header), and the sections of the config a parse reads (data, features, task: the
    columns and how to read them) less the fields that only choose, order and batch
    the records (file patterns, seed, shuffling, batch size; a parse function sees a
    batch of any size). Runs that differ in anything else share their parse traces."""
    data = dataclasses.replace(
        config.data, train=None, eval=None, seed=0, shuffle=False, shuffle_buffer=0, batch_size=0
    )
    return (reader, repr(data), repr(config.features), repr(config.task), *parts)


def plain(fn: Callable) -> Callable:
    """`fn` marked for tracing without AutoGraph (in `Dataset.map` and `tf.function`)."""
    return tf.autograph.experimental.do_not_convert(fn)


def number_text(x: tf.Tensor) -> tf.Tensor:
    """A typed column's numbers as the text a CSV of the same rows holds, for a string
    feature: an integral float as its digits (pandas stores an id column with missing
    values as float64: 1005.0 is the id "1005", not `as_string`'s "1005.000000"), other
    floats at their shortest ("0.5"), NaN as "" (missing); integers and bools as
    `tf.strings.as_string` writes them."""
    if not x.dtype.is_floating:
        return tf.strings.as_string(x)
    x = tf.cast(x, tf.float64)
    integral = tf.logical_and(tf.equal(x, tf.round(x)), tf.abs(x) < 2.0**53)
    digits = tf.strings.as_string(tf.cast(tf.where(integral, x, 0.0), tf.int64))
    text = tf.where(integral, digits, tf.strings.as_string(x, shortest=True))
    return tf.where(tf.math.is_nan(x), "", text)


def typed(x: tf.Tensor, use: Need, where: str) -> tf.Tensor:
    """Converts a typed column ([batch], or ragged [batch, None]) to its raw form.

    A ragged column (a TFRecord list) gives its first value, or the default when
    empty; for a multi_hot/sequence feature its values are joined instead, and cut
    to the feature's first `limit + 1` values (`first_values`).

    Raises:
        DataError: the stored type cannot give the needed one (strings for a number).
    """
    ragged = isinstance(x, tf.RaggedTensor)
    dtype = x.dtype
    if use.positive is not None:  # a mapped label: 1 for the positive raw values, else 0
        if dtype.is_floating or dtype.is_integer:  # by value: 4.0 is `4` (as_string says "4.000000")
            x = tf.cast(x, tf.float64)
            x = _first(x, float("nan")) if ragged else x
            numbers = list(sources.positive_numbers(use.positive)) or [float("nan")]  # NaN matches nothing
            hit = tf.reduce_any(tf.equal(x[:, None], tf.constant(numbers, tf.float64)), axis=1)
            return tf.where(tf.math.is_nan(x), float("nan"), tf.cast(hit, tf.float32))
        text = tf.strings.strip(x if dtype == tf.string else tf.strings.as_string(x))
        text = _first(text, "") if ragged else text
        hit = tf.reduce_any(tf.equal(text[:, None], tf.constant(list(use.positive))), axis=1)
        return tf.where(tf.equal(text, ""), float("nan"), tf.cast(hit, tf.float32))
    if use.kind == STRING:
        if dtype != tf.string:
            x = tf.ragged.map_flat_values(number_text, x) if ragged else number_text(x)
        if use.separator is None:
            return _first(x, "") if ragged else x
        if ragged:
            x = tf.strings.reduce_join(x, axis=1, separator=use.separator)
        return first_values(x, use.separator, use.limit) if use.limit else x
    if dtype == tf.string or not (dtype.is_integer or dtype.is_floating or dtype == tf.bool):
        expected = "int64" if use.kind == INT64 else "numbers"
        raise DataError(
            f"{where}: column '{use.column}' holds {dtype.name} values, but {use.who} expects {expected}"
        )
    if use.kind == INT64:
        if not dtype.is_integer:
            raise DataError(
                f"{where}: column '{use.column}' holds {dtype.name} values, but {use.who} expects int64"
            )
        x = tf.cast(x, tf.int64)
        return _first(x, -1) if ragged else x
    x = tf.cast(x, tf.float32)
    return _first(x, float("nan")) if ragged else x


def first_values(
    text: tf.Tensor, separator: str, limit: int, longer_than: int = LONG_ROW
) -> tf.Tensor:
    """[batch] separator-joined values, each row cut to its first `limit + 1` non-empty
    values (joined by `separator`) without splitting the whole row; a value of spaces
    only is empty, as the transform strips each value.

    The transform splits a multi_hot or sequence row, drops empty values and keeps
    the first `max_values` / `max_len`; splitting a row of millions of values costs
    memory per value, so the reader cuts first. Only rows of at least `longer_than`
    bytes that can hold more than `limit + 1` values are touched (a shorter row costs
    the transform little to split): in them, runs of separators become one (a
    value never holds the separator), a split stops after `limit + 2` pieces (the
    rest of the row stays one piece, dropped), and the first `limit + 1` non-empty
    pieces are joined again. One more value than kept is left, so the transform
    still sees, and counts, a row it cuts.

        "a||b|c|d|e"  limit 2, longer_than 0  ->  "a|b|c"

    Args:
        text: [batch] string.
        separator: the feature's separator.
        limit: the values the feature keeps.
        longer_than: bytes; shorter rows are left as they are.
    """
    width = len(separator.encode("utf-8"))
    shortest = max((limit + 2) * (1 + width) - width, longer_than)  # limit + 2 one-byte values
    sep = "".join(f"\\x{{{ord(c):x}}}" for c in separator)
    run = f"{sep}(?:{sources.blanks(separator)}{sep})+"  # a blank value between separators is none

    def cut():
        long_rows = tf.where(tf.strings.length(text) >= shortest)
        rows = tf.gather_nd(text, long_rows)
        single = tf.strings.regex_replace(rows, run, separator.replace("\\", "\\\\"))
        pieces = tf.strings.split(single, sep=separator, maxsplit=limit + 2)[:, : limit + 2]
        values = tf.ragged.boolean_mask(pieces, tf.strings.length(tf.strings.strip(pieces)) > 0)[:, : limit + 1]
        joined = tf.strings.reduce_join(values, axis=1, separator=separator)
        return tf.tensor_scatter_nd_update(text, long_rows, joined)

    # A batch without a long row (the usual one) costs one length and one branch.
    any_long = tf.reduce_any(tf.strings.length(text) >= shortest)
    return tf.cond(any_long, cut, lambda: tf.identity(text))


def _first(x: tf.RaggedTensor, default) -> tf.Tensor:
    return x[:, :1].to_tensor(default_value=default, shape=[None, 1])[:, 0]


def label_key(config: Config, label: str) -> tuple:
    """The `decoded` key of a label column."""
    return sources.label_need(config, label).key


def label_checks(config: Config, decoded: dict) -> list[Check]:
    """Checks that each label of a typed batch is a finite number (NaN: missing)."""
    checks = []
    for label in config.labels:
        value = decoded[label_key(config, label)]
        checks.append(
            (
                tf.math.is_finite(value),
                lambda i, label=label, value=value: tf.where(
                    tf.math.is_nan(value[i]),
                    f"label '{label}' is missing",
                    tf.strings.join(
                        [f"label '{label}': expected a finite number, got ", tf.strings.as_string(value[i])]
                    ),
                ),
            )
        )
    return checks


def id_list_checks(config: Config, decoded: dict) -> list[Check]:
    """Checks that every value of a multi_hot or sequence column of int64 ids is one (the
    transform's integer parse would fail the whole input on `7|x`)."""
    checks = []
    for use in sources.needs(config):
        if not use.ints:
            continue
        text = decoded[use.key]
        checks.append(
            (
                tf.strings.regex_full_match(text, sources.int64_list(use.separator)),
                lambda i, use=use, text=text: tf.strings.join(
                    [f"column '{use.column}': {sources.int64_list_refusal(use.separator)}'", text[i], "'"]
                ),
            )
        )
    return checks


def fatal_checks(config: Config, decoded: dict) -> list[Check]:
    """Checks whose failure stops the input whatever `data.on_bad_record` says:
    a label of a binary head is 0 or 1 (a 3 means the config maps the wrong column)."""
    checks = []
    for use in sources.needs(config):
        if use.kind != LABEL or not use.binary or use.positive is not None:
            continue
        value = decoded[use.key]
        checks.append(
            (
                tf.equal(value, 0.0) | tf.equal(value, 1.0) | ~tf.math.is_finite(value),
                lambda i, use=use, value=value: tf.strings.join(
                    [
                        f"label '{use.column}': a binary task needs 0 or 1, got ",
                        tf.strings.as_string(value[i], shortest=True),  # the one row named
                        f" (map raw values to 1 with data.positive: {{{use.column}: [...]}},"
                        " or use task.type: regression)",
                    ]
                ),
            )
        )
    return checks


def infinite_values(config: Config, decoded: dict) -> tf.Tensor | None:
    """[batch] int64: infinite numeric feature values per row, or None without numeric
    features (typed readers: NaN there is a missing value)."""
    counts = [
        tf.cast(tf.math.is_inf(decoded[use.key]), tf.int64)
        for use in unique(sources.needs(config))
        if use.kind == sources.FLOAT
    ]
    return tf.add_n(counts) if counts else None


def screen(
    checks: Sequence[Check],
    present: tf.Tensor,
    on_bad: str,
    locate: Callable[[tf.Tensor], tf.Tensor],
    fatal: Sequence[Check] = (),
) -> tuple[tf.Tensor, tf.Tensor, list]:
    """Applies the validity checks of a batch.

    Args:
        checks: (ok, reason) pairs; a record is malformed when one ok is False.
        present: [batch] bool, False for records that are silently ignored (blank lines).
        on_bad: "skip" (drop and count malformed records) or "fail".
        locate: row index -> scalar string like `file: line 7`.
        fatal: (ok, reason) pairs checked on the well-formed records; one False
            stops the input whatever `on_bad` says.

    Returns:
        (keep [batch] bool, number of dropped malformed records, control deps).
        A control dep is an assertion whose message is
        `recflow-bad-record: {file}: line {n}: {reason}` for the first failing
        record (of `checks` with "fail", of `fatal` always).
    """
    ok = (
        tf.reduce_all(tf.stack([c for c, _ in checks]), axis=0) if checks else tf.ones_like(present)
    )
    deps = []
    if on_bad == "skip":
        keep = present & ok
        bad = tf.reduce_sum(tf.cast(present & ~ok, tf.int64))
    else:
        keep, bad = present, tf.constant(0, tf.int64)
        deps.append(_assertion(checks, ok | ~present, locate))
    if fatal:
        fine = tf.reduce_all(tf.stack([c for c, _ in fatal]), axis=0) | ~(present & ok)
        deps.append(_assertion(fatal, fine, locate))
    return keep, bad, deps


def _assertion(checks: Sequence[Check], fine: tf.Tensor, locate: Callable) -> tf.Operation:
    """Asserts `fine` everywhere; the message names the first row that is not and why."""
    first = tf.argmin(tf.cast(fine, tf.int32), output_type=tf.int32)
    reason = tf.constant("")
    for valid, why in reversed(checks):
        reason = tf.where(valid[first], reason, why(first))
    message = tf.strings.join([sources.BAD_RECORD_TAG, locate(first), ": ", reason])
    return tf.debugging.Assert(tf.reduce_all(fine), [message], summarize=1)


def outputs(
    config: Config,
    decoded: dict,
    bad: tf.Tensor,
    keep: tf.Tensor | None = None,
    deps=(),
    nonfinite: tf.Tensor | None = None,
    present: tf.Tensor | None = None,
) -> tuple:
    """Builds `(features, labels, bad)` from decoded columns keyed by `Need.key`.

    Rows where `keep` is False are dropped (no copy when every row is kept); the
    outputs wait for `deps` (the bad-record assertions). `nonfinite` ([batch]
    int64, default: the infinite values) is summed over the kept rows into
    `features[NONFINITE]`. `present` ([batch] bool, default all): False for the
    records ignored without being counted bad (blank lines); with `keep` it gives
    each record's `STATUS` (which `finish` drops unless asked for).
    """
    keys = list(decoded)
    if nonfinite is None:
        nonfinite = infinite_values(config, decoded)
    with tf.control_dependencies(list(deps)):
        values = [tf.identity(decoded[k]) for k in keys]
        if keep is not None:

            def dropped():
                kept = tf.reshape(tf.where(keep), [-1])  # one mask for every column
                return [tf.gather(v, kept) for v in values]

            values = tf.cond(
                tf.reduce_all(keep), lambda: [tf.identity(v) for v in values], dropped
            )
        bad = tf.identity(bad)
    column = dict(zip(keys, values))
    uses = sources.needs(config)
    features = {f.name: column[use.key] for f, use in zip(config.features, uses)}
    if nonfinite is None:
        features[NONFINITE] = tf.constant(0, tf.int64)
    else:
        kept = nonfinite if keep is None else tf.where(keep, nonfinite, tf.zeros_like(nonfinite))
        features[NONFINITE] = tf.reduce_sum(kept)
    # Per record (dropped by `finish` unless asked for): no op of the batch path uses them.
    if keep is None:  # every record kept
        keep = tf.ones(tf.shape(decoded[keys[0]])[:1], tf.bool)
    dropped_as = tf.constant(BAD, tf.int8)
    if present is not None:
        dropped_as = tf.where(present, dropped_as, tf.constant(IGNORED, tf.int8))
    features[STATUS] = tf.where(keep, tf.constant(KEPT, tf.int8), dropped_as)
    if nonfinite is None:
        nonfinite = tf.zeros_like(keep, tf.int64)
    features[ROW_NONFINITE] = tf.gather(nonfinite, tf.reshape(tf.where(keep), [-1]))
    labels = {label: column[label_key(config, label)] for label in config.labels}
    return features, labels, bad


def locator(names: tf.Tensor, keys: tf.Tensor, unit: str) -> Callable:
    """Row -> `{file}: {unit} {number}` for messages, from `numbered` keys and the
    files' names ([files] string)."""

    def locate(i):
        name = tf.gather(names, keys[i] // FILE_STRIDE)
        return tf.strings.join([name, f": {unit} ", tf.strings.as_string(keys[i] % FILE_STRIDE)])

    return locate

