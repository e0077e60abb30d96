"""CSV files -> batches, validated in-graph, one vectorized map per batch.

Lines are read with `TextLineDataset`, numbered (the header is line 1), shuffled
if asked, batched, and then checked as a whole batch:

    lines  ['3299, 235,"Ed Wood, 1994",4.5', '517,105,"Bridges",x']   [batch]
      -> one regex: the field count and the quoting  (a comma in quotes is no delimiter)
      -> tf.io.decode_csv of the needed columns, strip, check and convert each one
      -> ({"user_id": [3299], "title": ["Ed Wood, 1994"], ...}, labels, bad=1)

A malformed line (wrong field count, bad quoting, a number column that is not a
number, an int64 id that is not an integer or does not fit in int64, an empty,
non-numeric or non-finite label) is dropped and counted (`on_bad_record: skip`) or stops the input with
`recflow-bad-record: {file}: line {n}: {reason}` (`fail`). Blank lines are
ignored. A quoted field cannot span lines: such a record reads as two bad lines.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from recflow.config.schema import Config
from recflow.data import records, sources
from recflow.data.sources import DIGITS as _DIGITS
from recflow.data.sources import FLOAT, INT64, LABEL, STRING
from recflow.data.sources import INT64_TEXT as _INT64
from recflow.data.sources import NUMBER as _NUMBER
from recflow.data.sources import NUMBER_OR_SPECIAL as _NUMBER_OR_SPECIAL
from recflow.errors import DataError

_QUOTED = r'"(?:[^"]|"")*"'
_MAX_REPEAT = 1000  # RE2's largest {n}


def _char_re(char: str) -> str:
    return "".join(f"\\x{{{ord(c):x}}}" for c in char)


def dataset(
    config: Config,
    files: Sequence[str],
    *,
    epochs: int | None,
    shuffle: bool,
    rows: tuple[int, int] | None = None,
    per_record: bool = False,
) -> tf.data.Dataset:
    """The CSV dataset of `files` (see `recflow.data.make_file_dataset`).

    Raises:
        DataError: the files' header lines differ, or a needed column is missing.
    """
    options = config.data.csv
    header = sources.read_header(files[0], options)
    for file in files[1:]:
        if sources.read_header(file, options) != header:
            raise DataError(f"{file}: the header differs from that of {files[0]}")
    uses = records.unique(sources.needs(config))
    sources.check_columns(files[0], header, uses, options.delimiter if options.header else None)
    skip = 1 if options.header else 0

    lines = records.numbered(
        files,
        lambda name: tf.data.TextLineDataset(name).skip(skip),
        first=skip + 1,
        shuffle=shuffle,
        seed=config.data.seed,
        rows=rows,
    )
    ds = records.batched(lines, config.data, shuffle=shuffle, epochs=epochs)
    parse = line_parser(config, header, "line")
    key = records.parse_key(config, "csv", tuple(header))
    return records.finish(ds, parse, files, key, per_record=per_record)


def line_parser(config: Config, header: Sequence[str], unit: str):
    """`parse(keys, lines, names) -> (features, labels, bad)`: a batch of CSV lines with
    the columns `header`, checked and converted in-graph (see the module docstring).

    `keys` and `names` locate a line for messages (`records.locator`): `{name}: {unit}
    {number}`, e.g. `train.csv: line 7` or `clicks partition 0: offset 7`.
    """
    position: dict[str, int] = {}
    for i, name in enumerate(header):
        position.setdefault(name, i)
    uses = records.unique(sources.needs(config))
    selected = sorted({position[u.column] for u in uses})
    slot = {index: k for k, index in enumerate(selected)}
    delimiter = config.data.csv.delimiter
    width = len(header)
    structure = _structure_check(delimiter, width)

    def parse(keys, lines, names):
        present = tf.strings.length(tf.strings.strip(lines)) > 0
        well_formed = structure(lines)

        def why(i):
            unquoted = tf.strings.regex_replace(lines[i], _QUOTED, "")
            count = tf.size(tf.strings.split(unquoted, sep=delimiter))
            wrong = tf.strings.join([f"expected {width} fields, got ", tf.strings.as_string(count)])
            return tf.where(tf.equal(count, width), "malformed quotes", wrong)

        checks = [(well_formed, why)]
        safe = tf.where(well_formed, lines, delimiter * (width - 1))
        fields = tf.io.decode_csv(
            safe,
            record_defaults=[""] * len(selected),
            field_delim=delimiter,
            use_quote_delim=True,
            select_cols=selected,
        )
        decoded = {}
        nonfinite = []
        for use in uses:
            value, check, infinite = _convert(fields[slot[position[use.column]]], use)
            decoded[use.key] = value
            if check is not None:
                checks.append(check)
            if infinite is not None:
                nonfinite.append(tf.cast(infinite, tf.int64))
        checks += records.id_list_checks(config, decoded)
        keep, bad, deps = records.screen(
            checks,
            present,
            config.data.on_bad_record,
            records.locator(names, keys, unit),
            fatal=records.fatal_checks(config, decoded),
        )
        counts = tf.add_n(nonfinite) if nonfinite else None
        return records.outputs(config, decoded, bad, keep, deps, nonfinite=counts, present=present)

    return parse


def _structure_check(delimiter: str, width: int):
    """Lines -> [batch] bool: `width` fields, each unquoted or properly quoted."""
    d = _char_re(delimiter)
    field = rf'(?:{_QUOTED}|[^"{d}]*)'
    if width - 1 <= _MAX_REPEAT:  # one regex pass checks the quoting and the field count
        pattern = field if width == 1 else rf"{field}(?:{d}{field}){{{width - 1}}}"
        return lambda lines: tf.strings.regex_full_match(lines, pattern)
    pattern = rf"{field}(?:{d}{field})*"

    def check(lines):
        unquoted = tf.strings.regex_replace(lines, _QUOTED, "")
        count = tf.strings.split(unquoted, sep=delimiter).row_lengths()
        return tf.strings.regex_full_match(lines, pattern) & tf.equal(count, width)

    return check


def _convert(
    raw: tf.Tensor, use: sources.Need
) -> tuple[tf.Tensor, records.Check | None, tf.Tensor | None]:
    """Strips and converts one column.

    Returns:
        (value, its validity check or None, [batch] bool of the non-finite values
        of a numeric feature ("nan", "inf", overflow; they read as missing) or None).
    """
    text = tf.strings.strip(raw)
    if use.kind == STRING:
        if use.separator is not None and use.limit:
            text = records.first_values(text, use.separator, use.limit)
        return text, None, None
    empty = tf.equal(text, "")
    if use.kind == INT64:
        valid = empty | tf.strings.regex_full_match(text, _INT64)
        value = tf.strings.to_number(tf.where(valid & ~empty, text, "-1"), tf.int64)
        too_big = tf.strings.regex_full_match(text, _DIGITS)

        def why(i):
            return tf.where(
                too_big[i],
                tf.strings.join(
                    [
                        f"column '{use.column}': '",
                        text[i],
                        f"' does not fit in int64; use dtype: string for {use.who}",
                    ]
                ),
                _reason(use, "an integer", text)(i),
            )

        return value, (valid, why), None
    if use.kind == LABEL and use.positive is not None:
        hit = tf.reduce_any(tf.equal(text[:, None], tf.constant(list(use.positive))), axis=1)
        numbers = sorted(sources.positive_numbers(use.positive))
        if numbers:  # a number matches by value, as in a typed column: "4.0" is 4
            number = tf.strings.regex_full_match(text, _NUMBER) & (tf.strings.length(text) <= sources.LONGEST_NUMBER)
            value = tf.strings.to_number(tf.where(number, text, "nan"), tf.float64)
            hit |= tf.reduce_any(tf.equal(value[:, None], tf.constant(numbers, tf.float64)), axis=1)
        return tf.cast(hit, tf.float32), (~empty, _reason(use, "a value", text)), None
    pattern = _NUMBER_OR_SPECIAL if use.kind == FLOAT else _NUMBER
    short = tf.cond(  # a batch without a long value (the usual one) costs one length
        tf.reduce_any(tf.strings.length(text) > sources.LONGEST_NUMBER),
        lambda: _shortened(text),
        lambda: tf.identity(text),
    )
    fits = tf.strings.length(short) <= sources.LONGEST_NUMBER
    number = tf.strings.regex_full_match(text, pattern)
    valid = number & fits
    long = _reason(use, sources.TOO_LONG, text)
    if use.kind == LABEL:
        value = tf.strings.to_number(tf.where(valid, short, "0"), tf.float32)
        other, finite = _reason(use, "a number", text), _reason(use, "a finite number", text)
        hint = " (data.positive maps raw label values to 1)"

        def why(i):
            text_hint = tf.where(empty[i], "", hint)
            wrong = tf.where(number[i], long(i), tf.strings.join([other(i), text_hint]))
            return tf.where(valid[i], finite(i), wrong)

        return value, (valid & tf.math.is_finite(value), why), None
    value = tf.strings.to_number(tf.where(valid, short, "nan"), tf.float32)

    def why(i):
        return tf.where(number[i], long(i), _reason(use, "a number", text)(i))

    return value, (valid | empty, why), valid & ~tf.math.is_finite(value)


def _shortened(text: tf.Tensor) -> tf.Tensor:
    """`sources.shortened` of each value."""
    for pattern, rewrite in sources.SHORTENED:
        text = tf.strings.regex_replace(text, pattern, rewrite)
    return text


def _reason(use: sources.Need, expected: str, text: tf.Tensor):
    prefix = "label" if use.kind == LABEL else "column"
    return lambda i: tf.strings.join(
        [f"{prefix} '{use.column}': expected {expected}, got '", text[i], "'"]
    )
