"""`recflow data check`: one pass over CSV training data, no training, no TensorFlow.

Per feature: parse failures, empty rate, distinct values (exact up to
`EXACT_DISTINCT`, then a k-minimum-values estimate; of a multi_hot or sequence
column, the ids training keeps: a row's first `max_values` / `max_len`), min/max/mean of numbers,
non-finite numbers, multi_hot rows over `max_values`. Per label: value counts.
Then `problems`: what `recflow train` would refuse (bad-row fraction above
`data.max_bad_fraction`, a binary label other than 0/1, no rows), and `advice`:
`tables.<t>.expected_keys`, normalizers, ids beyond int64 (bad rows in training, counted
with the others).

Values are read as the training input reads them: the same number and integer
patterns (`recflow.data.sources`), fields stripped, quoted fields with
delimiters, blank lines ignored.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from recflow.config.schema import (
    AutoNormalizer,
    Config,
    IdentityNormalizer,
    MultiHotFeature,
    NumericFeature,
)
from recflow.data import sources
from recflow.data.fit import fit_normalizer
from recflow.errors import DataError

EXACT_DISTINCT = 100_000  # above this many distinct values, estimate (KMV sketch)
_KMV = 4096
_INT64 = re.compile(sources.INT64_TEXT)
_DIGITS = re.compile(sources.DIGITS)
_NUMBER = re.compile(sources.NUMBER_OR_SPECIAL)
_LABEL = re.compile(sources.NUMBER)


class Distinct:
    """Counts distinct values: exactly while few, then a k-minimum-values estimate."""

    def __init__(self) -> None:
        self.values: set[str] | None = set()
        self.hashes: set[int] = set()
        self.kth = 2**64

    def add(self, value: str) -> None:
        if self.values is not None:
            self.values.add(value)
            if len(self.values) <= EXACT_DISTINCT:
                return
            for v in self.values:
                self._hash(v)
            self.values = None
            return
        self._hash(value)

    def _hash(self, value: str) -> None:
        h = int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little")
        if h >= self.kth or h in self.hashes:
            return
        self.hashes.add(h)
        if len(self.hashes) > _KMV:
            self.hashes.remove(max(self.hashes))
            self.kth = max(self.hashes)

    def estimate(self) -> int:
        if self.values is not None:
            return len(self.values)
        return int((_KMV - 1) * 2**64 / (self.kth + 1))


@dataclass
class ColumnStats:
    who: str
    column: str
    kind: str
    rows: int = 0
    empty: int = 0
    failures: int = 0
    overflow: int = 0  # integers beyond int64
    nonfinite: int = 0
    over_max: int = 0  # multi_hot rows over max_values
    distinct: Distinct = field(default_factory=Distinct)
    numbers: list[float] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    first_failure: str | None = None


def _read(config: Config, files: list[str], limit: int | None):
    """Yields (file, line number, {column: stripped value}) or (file, line, reason) for bad rows."""
    options = config.data.csv
    read = 0
    for file in files:
        header = sources.read_header(file, options)
        with open(file, newline="", encoding="utf-8-sig") as f:
            reader = sources.csv_reader(f, options.delimiter)
            if options.header:
                next(reader, None)
            first = 2 if options.header else 1
            for line, row in enumerate(reader, start=first):
                if limit is not None and read >= limit:
                    return
                if not row or (len(row) == 1 and not sources.strip(row[0])):
                    continue
                read += 1
                if len(row) != len(header):
                    yield file, line, f"expected {len(header)} fields, got {len(row)}"
                    continue
                yield file, line, {name: sources.strip(value) for name, value in zip(header, row)}


def check(config: Config, rows: int | None = None) -> dict:
    """The data report of the configured training files (first `rows` rows when given).

    Raises:
        DataError: the format is not CSV, or the files cannot be read.
    """
    if config.data.format != "csv":
        raise DataError(f"data check: reads CSV files; data.format is {config.data.format!r}")
    files = sources.expand(config.data.train, "data.train")
    options = config.data.csv
    for file in files:
        header = sources.read_header(file, options)
        delimiter = options.delimiter if options.header else None
        sources.check_columns(file, header, sources.needs(config), delimiter)
    stats = [ColumnStats(need.who, need.column, need.kind) for need in sources.needs(config)]
    needs = sources.needs(config)
    by_feature = {f"feature '{f.name}'": f for f in config.features}
    read = bad = 0
    first_bad = None
    for file, line, values in _read(config, files, rows):
        read += 1
        if isinstance(values, str):
            bad += 1
            first_bad = first_bad or f"{file}: line {line}: {values}"
            continue
        row_ok = True
        for need, st in zip(needs, stats):
            reason = _observe(need, st, values[need.column], by_feature.get(need.who))
            if reason is not None:
                st.first_failure = st.first_failure or f"{file}: line {line}: {reason}"
                row_ok = False
        if not row_ok:
            bad += 1
            first_bad = first_bad or next(s.first_failure for s in stats if s.first_failure)
    return _report(config, files, read, bad, first_bad, stats)


def _float32(text: str) -> float:
    """A number's text as training reads it: a float32 (1e39 is inf), quietly."""
    with np.errstate(over="ignore"):
        return float(np.float32(float(text)))


def _observe(need: sources.Need, st: ColumnStats, text: str, feature) -> str | None:
    """Adds one value to the stats; returns why the row is bad, or None."""
    st.rows += 1
    if text == "":
        st.empty += 1
        if need.kind == sources.LABEL:
            st.failures += 1
            return f"label '{need.column}' is missing"
        return None
    if need.kind == sources.LABEL:
        if need.positive is not None:  # as training maps it: the text, or a number by value
            number = _LABEL.fullmatch(text) and len(text) <= sources.LONGEST_NUMBER
            by_value = number and float(text) in sources.positive_numbers(need.positive)
            value = 1.0 if text in need.positive or by_value else 0.0
        else:  # as training reads it: a float32 of at most LONGEST_NUMBER characters
            reason = None
            if not _LABEL.fullmatch(text):
                reason = "a number"
            elif len(sources.shortened(text)) > sources.LONGEST_NUMBER:
                reason = sources.TOO_LONG
            elif not math.isfinite(_float32(text)):
                reason = "a finite number"
            if reason is not None:
                st.failures += 1
                st.counts[text] += 1
                return f"label '{need.column}': expected {reason}, got '{text}'"
            value = float(text)
        st.counts[f"{value:g}"] += 1
        return None
    if need.separator is not None:  # multi_hot / sequence: count the ids training keeps
        values = sources.leading_values(text, need.separator, need.limit)
        if len(values) > need.limit and isinstance(feature, MultiHotFeature):
            st.over_max += 1
        for value in values[: need.limit]:
            st.distinct.add(value)
        if need.ints and not re.fullmatch(sources.int64_list(need.separator), text):
            st.failures += 1
            return f"column '{need.column}': {sources.int64_list_refusal(need.separator)}'{text}'"
    else:
        st.distinct.add(text)
    if need.kind == sources.INT64:
        if _INT64.fullmatch(text):
            return None
        st.failures += 1
        if _DIGITS.fullmatch(text):
            st.overflow += 1
            return f"column '{need.column}': '{text}' does not fit in int64"
        return f"column '{need.column}': expected an integer, got '{text}'"
    if need.kind == sources.FLOAT:
        if not _NUMBER.fullmatch(text):
            st.failures += 1
            return f"column '{need.column}': expected a number, got '{text}'"
        if len(sources.shortened(text)) > sources.LONGEST_NUMBER:
            st.failures += 1
            return f"column '{need.column}': expected {sources.TOO_LONG}, got '{text}'"
        value = _float32(text) if text.lower().lstrip("+-") != "nan" else math.nan
        if math.isfinite(value):
            st.numbers.append(value)
        else:
            st.nonfinite += 1
        return None
    return None


def _report(config, files, read, bad, first_bad, stats) -> dict:
    report: dict = {"files": len(files), "rows_read": read, "bad_rows": bad, "first_bad": first_bad}
    features, labels, problems, advice = [], [], [], []
    limit = config.data.max_bad_fraction
    if read == 0:
        problems.append("no rows: the run would stop")
    elif bad > limit * read:
        problems.append(
            f"{bad} of {read} rows are bad ({bad / read:.1%}, above data.max_bad_fraction {limit:g}); "
            f"first: {first_bad}"
        )
    binary = config.binary_labels
    for st in stats:
        if st.kind == sources.LABEL:
            counts = dict(st.counts.most_common(10))
            labels.append({"label": st.column, "rows": st.rows, "missing": st.empty, "values": counts})
            odd = [v for v in st.counts if v not in ("0", "1")]
            if st.column in binary and odd:
                problems.append(
                    f"label '{st.column}': a binary task needs 0 or 1, got {', '.join(odd[:5])} "
                    f"(map raw values to 1 with data.positive: {{{st.column}: [...]}})"
                )
            continue
        entry = {
            "feature": st.who.split("'")[1],
            "column": st.column,
            "kind": st.kind,
            "parse_failures": st.failures,
            "empty_rate": round(st.empty / st.rows, 4) if st.rows else 0.0,
            "distinct": st.distinct.estimate(),
        }
        feature = config.feature(entry["feature"])
        if st.kind == sources.FLOAT:
            x = np.asarray(st.numbers, np.float64)
            entry.update(
                min=float(x.min()) if x.size else None,
                max=float(x.max()) if x.size else None,
                mean=float(x.mean()) if x.size else None,
                nonfinite=st.nonfinite,
            )
            if isinstance(feature, NumericFeature) and (
                feature.normalizer is None
                or isinstance(feature.normalizer, (IdentityNormalizer, AutoNormalizer))
            ):
                norm = fit_normalizer(x)
                spelled = f"{{type: standard, mean: {norm.mean:.6g}, std: {norm.std:.6g}"
                spelled += ", log1p: true}" if norm.log1p else "}"
                entry["normalizer"] = spelled
                if feature.normalizer is None and x.size and np.abs(x).max() > 1e3:
                    advice.append(
                        f"feature '{feature.name}': values up to {np.abs(x).max():g} and no "
                        f"normalizer; use normalizer: {{type: auto}} (here: {spelled})"
                    )
        if st.overflow:  # bad rows, judged with the others by max_bad_fraction
            advice.append(
                f"feature '{entry['feature']}': {st.overflow} values do not fit in int64 (bad rows "
                "in training); use dtype: string"
            )
        if st.over_max:
            entry["rows_over_max_values"] = st.over_max
        features.append(entry)
    tables: dict[str, int] = {}
    for entry in features:
        feature = config.feature(entry["feature"])
        if feature.is_sparse:
            tables[feature.table_name] = tables.get(feature.table_name, 0) + entry["distinct"]
    if tables:
        sizes = ", ".join(f"{table} {keys}" for table, keys in tables.items())
        advice.append(f"tables.<table>.expected_keys, from the distinct ids seen: {sizes}")
    report["expected_keys"] = tables
    report.update(features=features, labels=labels, problems=problems, advice=advice)
    return report


def format_report(report: dict) -> str:
    """The report as a readable table."""
    lines = [
        f"{report['rows_read']} rows read from {report['files']} file(s), "
        f"{report['bad_rows']} bad" + (f" (first: {report['first_bad']})" if report["first_bad"] else ""),
        "",
        f"{'feature':<20} {'kind':<7} {'fails':>6} {'empty':>7} {'distinct':>9}  numbers",
    ]
    for f in report["features"]:
        numbers = ""
        if f["kind"] == sources.FLOAT and f["min"] is not None:
            numbers = f"min {f['min']:.4g}  max {f['max']:.4g}  mean {f['mean']:.4g}"
            if f["nonfinite"]:
                numbers += f"  non-finite {f['nonfinite']}"
        if f.get("normalizer"):
            numbers += f"  -> {f['normalizer']}"
        if f.get("rows_over_max_values"):
            numbers += f"rows over max_values {f['rows_over_max_values']}"
        lines.append(
            f"{f['feature']:<20} {f['kind']:<7} {f['parse_failures']:>6} "
            f"{f['empty_rate']:>7.1%} {f['distinct']:>9}  {numbers}".rstrip()
        )
    lines.append("")
    for label in report["labels"]:
        values = ", ".join(f"{k}: {v}" for k, v in label["values"].items())
        lines.append(f"label {label['label']}: {values}" + (f"  (missing {label['missing']})" if label["missing"] else ""))
    for title, key in (("would stop the run", "problems"), ("advice", "advice")):
        if report[key]:
            lines += ["", f"{title}:"] + [f"  - {item}" for item in report[key]]
    return "\n".join(lines)
