"""Online learning: `recflow train --follow` trains on files as they appear and grow.

`data.train` is watched as a stream. Each file is trained in segments: the whole
records it holds when it is looked at (CSV lines with their newline, TFRecord
frames; a Parquet file once complete), then the records appended to it later,
each once, files in name order. What was consumed of each file (its path, size,
records and a digest of the consumed bytes, see `recflow.data.consumed`) and the
segment in progress (with its input position) are saved in every checkpoint, so a
restart, even after kill -9, neither skips nor repeats a record.

A file whose consumed bytes changed (rewritten, or shorter than what was read)
gets one warning naming it, and its records are then trained again from the first,
as a new file's. Deltas and export versions are written on their schedules; a stop
request (SIGTERM, Ctrl-C) ends with a final checkpoint and export.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import tensorflow as tf

from recflow.data import sources
from recflow.data.consumed import Consumed, scan
from recflow.errors import DataError
from recflow.training.progress import StreamStatus
from recflow.training.runner import LocalRunner
from recflow.training.trainer import Trainer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """The records `start` to `after.records - 1` of a file.

    `after` is what is consumed of the file once the segment is trained; None for a
    whole file in progress in a checkpoint of an earlier recflow (which kept names only).
    """

    path: str
    start: int
    after: Consumed | None

    @property
    def rows(self) -> tuple[int, int] | None:
        return None if self.after is None else (self.start, self.after.records)

    def to_json(self) -> str:
        after = None if self.after is None else self.after.to_dict()
        return json.dumps({"path": self.path, "start": self.start, "after": after})

    @classmethod
    def from_json(cls, text: str) -> Segment | None:
        if not text:
            return None
        try:
            raw = json.loads(text)
        except ValueError:
            raw = None
        if not isinstance(raw, dict):  # an earlier recflow's file name: the whole file
            return cls(text, 0, None)
        return cls(raw["path"], raw["start"], Consumed.from_dict(raw["after"]))


class StreamState(tf.Module):
    """What was consumed of each file and the segment in progress, saved in each checkpoint.

    `consumed` is a JSON list of `Consumed` dicts in the order the files were first
    consumed (an earlier recflow's: of file names); `current` the JSON of the
    segment in progress, "" when none.
    """

    def __init__(self):
        super().__init__(name="stream")
        self.consumed = tf.Variable("[]", dtype=tf.string, trainable=False, name="consumed")
        self.current = tf.Variable("", dtype=tf.string, trainable=False, name="current")

    def files(self) -> dict[str, Consumed | None]:
        """File -> what was consumed of it (None: a whole file, by an earlier recflow)."""
        return consumed_files(self.consumed.numpy())

    def segment(self) -> Segment | None:
        return Segment.from_json(self.current.numpy().decode())

    def begin(self, segment: Segment) -> None:
        self.current.assign(segment.to_json())

    def record(self, path: str, consumed: Consumed | None) -> None:
        """Records what is consumed of a file (None: all of it, as an earlier recflow
        did); ends the segment in progress."""
        files = self.files()
        files[path] = consumed
        entries = [path if c is None else c.to_dict() for path, c in files.items()]
        self.consumed.assign(json.dumps(entries))
        self.current.assign("")


def consumed_files(text: bytes | None) -> dict[str, Consumed | None]:
    """The files of a saved `stream/consumed` value (see `StreamState.files`)."""
    files: dict[str, Consumed | None] = {}
    for entry in json.loads(text.decode()) if text else []:
        if isinstance(entry, str):  # an earlier recflow's: a file consumed whole
            files[entry] = None
        else:
            files[entry["path"]] = Consumed.from_dict(entry)
    return files


class Watcher:
    """Finds the next segment to train: new files, appended records, rewritten files.

    Args:
        config: the run config (`data.train`, `data.format`, `data.csv.header`).
        state: the stream state (restored).
    """

    def __init__(self, config, state: StreamState):
        self.config = config
        self.state = state
        self._idle: dict[str, tuple[int, int]] = {}  # file -> (size, mtime) found with nothing new
        self._warned: set[tuple[str, str]] = set()  # (file, consumed digest) warned about

    def scan(self, path: str, previous: Consumed | None):
        data = self.config.data
        return scan(path, data.format, data.csv.header, previous)

    def warn_rewritten(self, path: str, previous: Consumed | None, why: str) -> None:
        """One warning per file and consumed state."""
        key = (path, previous.digest if previous else "")
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "%s: rewritten since it was trained (%s); its records are trained again "
                "from the first, as a new file's",
                path,
                why,
            )

    def next_segment(self) -> Segment | None:
        """The first file, in name order, with whole records not consumed yet."""
        try:
            listed = sources.expand(self.config.data.train, "data.train")
        except DataError:  # no file yet is normal for a stream
            return None
        files = self.state.files()
        for path in listed:
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                continue
            if self._idle.get(path) == (stat.st_size, stat.st_mtime_ns):
                continue
            previous = files.get(path)
            if path in files and previous is None:  # consumed whole by an earlier recflow
                previous = self.scan(path, None).complete
                if previous is not None:
                    self.state.record(path, previous)
            found = self.scan(path, previous)
            if found.rewritten:
                self.warn_rewritten(path, previous, found.rewritten)
                previous, found = None, self.scan(path, None)
            start = previous.records if previous is not None else 0
            if found.complete is not None and found.complete.records > start:
                return Segment(path, start, found.complete)
            self._idle[path] = (stat.st_size, stat.st_mtime_ns)
        return None

    def lag(self) -> tuple[int, int]:
        """(files, bytes) of `data.train` not trained yet: each listed file's bytes past
        what was consumed of it (a file being trained counts until it is done)."""
        try:
            listed = sources.expand(self.config.data.train, "data.train")
        except DataError:
            return 0, 0
        files, behind = self.state.files(), [0, 0]
        for path in listed:
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            consumed = files.get(path)
            done = size if (path in files and consumed is None) else (consumed.size if consumed else 0)
            if size > done:
                behind[0] += 1
                behind[1] += size - done
        return behind[0], behind[1]

    def check_resumed(self, segment: Segment, previous: Consumed | None) -> bool:
        """Whether the file of a restored segment still holds what it did when the
        segment began; warns when not. `previous`: what was consumed of it before."""
        if segment.after is None:
            return True
        found = self.scan(segment.path, segment.after)
        if found.rewritten is None:
            return True
        self.warn_rewritten(segment.path, previous, found.rewritten)
        return False


def follow(
    trainer: Trainer,
    poll_seconds: float = 1.0,
    on_file: Callable[[str, int, int], None] | None = None,
    status_every: float | None = None,
) -> dict:
    """Trains on each new file of `data.train`, and on the records appended to the
    files, until `trainer.request_stop()`.

    Args:
        trainer: a Trainer on the run's model dir.
        poll_seconds: how often to look for new records when idle.
        on_file: called with (file, examples, global step) after each segment.
        status_every: print a live line (rate, files and bytes behind) at most this often
            while training.

    Returns:
        A summary: steps, examples, files consumed.
    """
    model_dir = trainer.model_dir
    model_dir.prepare()
    state = StreamState()
    watcher = Watcher(trainer.config, state)
    saved = model_dir.saved_value("stream/current")
    segment = Segment.from_json(saved.decode()) if saved is not None else None
    if segment is not None:
        before = consumed_files(model_dir.saved_value("stream/consumed"))
        if not watcher.check_resumed(segment, before.get(segment.path)):
            segment = None  # its file changed while stopped: trained again from the first
    iterator = _iterator(trainer, segment) if segment else None
    model_dir.open_checkpoint(iterator, stream=state)  # restores model, tables, stream state (and position)
    if segment is None:
        state.current.assign("")
    if status_every is not None:
        trainer.callbacks.append(StreamStatus(lambda: _behind(*watcher.lag()), status_every))
    steps = LocalRunner(trainer.config, trainer.model, trainer.epoch_dataset)  # the stream's step runner
    began, examples, start_step = time.perf_counter(), 0, int(trainer.model.global_step)
    trainer.callbacks.on_train_begin()
    while not trainer.stop_requested:
        if iterator is None:
            segment = watcher.next_segment()
            if segment is None:
                time.sleep(poll_seconds)
                continue
            iterator = _iterator(trainer, segment)
            model_dir.open_checkpoint(iterator, restore=False, stream=state)
            state.begin(segment)
        trained = trainer.train_on(steps.reports(iterator), files=[segment.path])
        examples += trained
        if trainer.stop_requested:
            break  # the segment stays in progress; its input position goes into the checkpoint
        state.record(segment.path, segment.after)
        model_dir.save_checkpoint()
        iterator = None
        if on_file is not None:
            on_file(segment.path, trained, int(trainer.model.global_step))
    summary = trainer.finish(examples, time.perf_counter() - began, start_step)
    summary["files_consumed"] = list(state.files())
    return summary


def _behind(files: int, size: int) -> str:
    return f"{files} file{'s' if files != 1 else ''}, {size / 1e6:,.1f} MB"


def _iterator(trainer: Trainer, segment: Segment):
    """The input of a segment (a Parquet file is read whole)."""
    rows = None if trainer.config.data.format == "parquet" else segment.rows
    return iter(trainer.dataset("train", epochs=1, files=[segment.path], rows=rows))
