"""What a stream consumed of a file, and what the file holds now beyond it.

`recflow train --follow` trains the records of a file as they are appended. What
it consumed of a file is a `Consumed`: the file's first `size` bytes (ending with
a whole record), the records in them and a BLAKE2b digest of those bytes. `scan`
compares the file on disk with it:

    consumed   [header r0 ... r299]                     size 9012, digest d
    appended   [header r0 ... r299][r300 ... r799][r80   records 300-799 are new;
                                                         r800 has no newline yet
    rewritten  [header x0 ... ]                          its first 9012 bytes differ
                                                         (or it is shorter)

A record is a whole line of a CSV file (a last line without its newline is not
one yet; a header line is not counted) or a whole TFRecord frame; a Parquet file
is one record, complete once its footer is written, and is never appended to (any
change is a rewrite). Nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from dataclasses import dataclass

from recflow.errors import DataError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Consumed:
    """A file's first `size` bytes, holding `records` whole records.

    Args:
        path: the file.
        size: bytes; they end with a whole record.
        records: the records in them (CSV: lines after the header).
        digest: BLAKE2b-128 of those bytes, hex.
        mtime_ns: the file's modification time when it was scanned: while its size
            and time stay the same, the file is not read again.
    """

    path: str
    size: int
    records: int
    digest: str
    mtime_ns: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> Consumed:
        return cls(**raw)


@dataclass(frozen=True)
class Scan:
    """A file on disk against what was consumed of it.

    Args:
        complete: the file's whole records now, or None when it has none yet.
        rewritten: why the consumed bytes are no longer the file's first bytes
            (it shrank, they changed), or None.
    """

    complete: Consumed | None
    rewritten: str | None = None


def scan(path: str, fmt: str, header: bool, previous: Consumed | None) -> Scan:
    """Reads what `path` holds beyond `previous` (all of it when None).

    Only the consumed bytes (to check them) and the new ones are read, and nothing
    when the file's size and modification time are those of `previous`.

    Args:
        path: the file.
        fmt: `csv`, `tfrecord` or `parquet`.
        header: a CSV file's first line is a header.
        previous: what was consumed of the file, or None.

    Raises:
        DataError: the file cannot be read.
    """
    try:
        stat = os.stat(path)
        if previous is not None and (stat.st_size, stat.st_mtime_ns) == (
            previous.size,
            previous.mtime_ns,
        ):
            return Scan(previous)
        with open(path, "rb") as f:
            return _scan(f, path, fmt, header, previous, stat)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _scan(f, path: str, fmt: str, header: bool, previous: Consumed | None, stat) -> Scan:
    hasher = hashlib.blake2b(digest_size=16)
    start, records = 0, 0
    if previous is not None:
        if stat.st_size < previous.size:
            return Scan(None, f"it shrank from {previous.size} to {stat.st_size} bytes")
        _hash(f, hasher, previous.size)
        if hasher.hexdigest() != previous.digest:
            return Scan(None, f"its first {previous.size} bytes changed")
        if fmt == "parquet" and stat.st_size != previous.size:
            return Scan(None, "a Parquet file changed")
        start, records = previous.size, previous.records
    if fmt == "csv":
        end, lines = _whole_lines(f, hasher, start)
        if start == 0 and header:
            lines -= min(lines, 1)  # the header line is no record
        records += lines
    else:
        end, count = (_whole_frames if fmt == "tfrecord" else _whole_parquet)(f, start, stat.st_size)
        _hash(f, hasher, end - start, at=start)
        records += count
    if end == 0:
        return Scan(None)
    return Scan(Consumed(path, end, records, hasher.hexdigest(), stat.st_mtime_ns))


def _hash(f, hasher, size: int, at: int = 0) -> None:
    """Adds `size` bytes of `f` from offset `at` to `hasher`."""
    f.seek(at)
    while size > 0:
        chunk = f.read(min(size, _CHUNK))
        if not chunk:
            raise DataError(f"{f.name}: shorter than {size} bytes while being read")
        hasher.update(chunk)
        size -= len(chunk)


def _whole_lines(f, hasher, start: int) -> tuple[int, int]:
    """(the offset after the last newline, the newlines) from `start`, hashing the
    whole lines."""
    f.seek(start)
    end, lines, pending = start, 0, b""
    while chunk := f.read(_CHUNK):
        last = chunk.rfind(b"\n")
        if last < 0:
            pending += chunk
            continue
        whole = pending + chunk[: last + 1]
        hasher.update(whole)
        lines += whole.count(b"\n")
        end += len(whole)
        pending = chunk[last + 1 :]
    return end, lines


def _whole_frames(f, start: int, size: int) -> tuple[int, int]:
    """(the offset after the last whole TFRecord frame, the frames) from `start`.

    A frame is a uint64 length, a uint32 CRC, the data and its uint32 CRC."""
    offset, frames = start, 0
    while offset + 12 <= size:
        f.seek(offset)
        (length,) = struct.unpack("<Q", f.read(8))
        if offset + 16 + length > size:
            break
        offset += 16 + length
        frames += 1
    return offset, frames


def _whole_parquet(f, start: int, size: int) -> tuple[int, int]:
    """(size, 1) for a Parquet file whose footer is written, else (0, 0)."""
    if start or size < 12:
        return start, 0
    f.seek(0)
    head = f.read(4)
    f.seek(size - 4)
    return (size, 1) if head == f.read(4) == b"PAR1" else (0, 0)
