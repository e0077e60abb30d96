"""Kafka topics -> batches of raw message values, for stream training (`data.format: kafka`).

A consumer thread reads every partition of `data.kafka.topics` with `assign()` at
explicit offsets (no group rebalancing), cuts the messages into whole batches of
`data.batch_size` values and puts them, with the position after each batch, into a
bounded queue. The dataset reads whole batches from that queue (one string tensor
per batch) and parses them in-graph with the CSV line parser (`csv.line_parser`):
no Python runs per row between the queue and the training step.

    consumer thread: consume() -> [value, ...] + {(topic, partition): next offset}
        -> queue (data.kafka.queue_batches batches)
    dataset: from_generator -> [batch] string -> parse (checks, on_bad_record) -> features

A batch is full, or partial when every partition is caught up and no message came
for `poll_timeout_ms`. JSON values (`format: json`) are objects column -> value,
rendered as CSV lines of the needed columns by the consumer thread; a value that is
not such an object reads as a malformed line (counted as bad, or `fail`).

The broker is checked at start-up (`connect_timeout_s`); while running, a broker
that stays unreachable (or a topic that disappears) for `connect_timeout_s` ends
the input with `KafkaSource.error` set.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import queue
import threading
import time

import numpy as np

from recflow.config.schema import Config
from recflow.data import sources
from recflow.errors import DataError

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # the longest a stopping run waits for the client to close (see `KafkaSource.close`)
MAX_PARTITIONS = 4096  # per topic: message keys pack (topic, partition) into one slot
_STRIDE = 2**40  # records.FILE_STRIDE: key = slot * _STRIDE + offset
_UNREADABLE = '"'  # a line the CSV parser always rejects (malformed quotes)

Offsets = dict  # {(topic, partition): next offset}


def columns(config: Config) -> list[str]:
    """The columns of a message: `data.csv.columns` (CSV; a message has no header
    line), or the needed columns in feature-then-label order (JSON)."""
    if config.data.kafka.format == "csv":
        return list(config.data.csv.columns)
    return list(dict.fromkeys(use.column for use in sources.needs(config)))


def partition_names(config: Config) -> list[str]:
    """The name of every message slot, for messages: `{topic} partition {p}`."""
    return [
        f"{topic} partition {p}" for topic in config.data.kafka.names for p in range(MAX_PARTITIONS)
    ]


def encode_offsets(offsets: Offsets) -> str:
    """{(topic, partition): offset} as JSON `{"topic": {"partition": offset}}`."""
    nested: dict = {}
    for (topic, partition), offset in sorted(offsets.items()):
        nested.setdefault(topic, {})[str(partition)] = int(offset)
    return json.dumps(nested, sort_keys=True)


def decode_offsets(text: str) -> Offsets:
    """The inverse of `encode_offsets`."""
    nested = json.loads(text or "{}")
    return {(t, int(p)): int(o) for t, parts in nested.items() for p, o in parts.items()}


class JsonLines:
    """JSON objects -> CSV lines of `columns` (delimiter `delimiter`).

    null or a missing key is an empty field; a list is joined with the column's
    separator (multi_hot / sequence); true/false are 1/0; anything else that is not
    a string or a number makes the value unreadable.
    """

    def __init__(self, config: Config):
        self.columns = columns(config)
        self.delimiter = config.data.csv.delimiter
        self.separator = {u.column: u.separator for u in sources.needs(config) if u.separator}

    def line(self, value: bytes) -> str | None:
        """The CSV line of a message value, or None when it is not a JSON object."""
        try:
            record = json.loads(value)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(record, dict):
            return None
        fields = []
        for column in self.columns:
            field = self._field(record.get(column), self.separator.get(column))
            if field is None:
                return None
            fields.append(field)
        return self.delimiter.join(fields)

    def _field(self, value, separator: str | None) -> str | None:
        if value is None:
            return ""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, (int, float)):
            return repr(value) if isinstance(value, float) and math.isfinite(value) else str(value)
        if isinstance(value, list) and separator is not None:
            parts = [self._field(v, None) for v in value]
            return None if None in parts else _quoted(separator.join(parts))
        if isinstance(value, str):
            return _quoted(value)
        return None


def _quoted(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


class KafkaSource:
    """The consumer thread and its queue of whole batches.

    Args:
        config: the run config (`data.kafka`, `data.batch_size`, `data.on_bad_record`).
        start: the next offset of each partition known to the checkpoint; a partition
            not in it (new, or added to the topic later) is read from its beginning.
    """

    def __init__(self, config: Config, start: Offsets):
        self.config = config
        self.options = config.data.kafka
        self.batch_size = config.data.batch_size
        self.error: DataError | None = None  # why the input ended early
        self.positions: collections.deque = collections.deque()  # after each yielded batch
        self._start = dict(start)
        self._queue: queue.Queue = queue.Queue(maxsize=self.options.queue_batches)
        self._stop = threading.Event()
        self._done = threading.Event()  # the thread ended: nothing more is queued
        self._ready = threading.Condition()
        self._produced = 0  # batches queued by the thread
        self.high: Offsets = {}  # each partition's high watermark, as last fetched (`lag`)
        self._commit: Offsets | None = None
        self._json = JsonLines(config) if self.options.format == "json" else None
        self._slots = {t: i * MAX_PARTITIONS for i, t in enumerate(self.options.names)}
        self._thread: threading.Thread | None = None
        self._consumer = None

    # ------------------------------------------------------------------ start, stop

    def start(self) -> None:
        """Connects, checks the topics, assigns every partition and starts the thread.

        Raises:
            DataError: no broker answers within `connect_timeout_s`, or a topic is missing.
        """
        self._consumer = self._connect()
        partitions = self._partitions(self.options.connect_timeout_s, at_start=True)
        self._assign(partitions)
        self._thread = threading.Thread(target=self._run, name="recflow-kafka", daemon=True)
        self._thread.start()

    def _connect(self):
        from confluent_kafka import Consumer

        opts = self.options
        settings = {
            **{k: v for k, v in opts.client.items()},
            "bootstrap.servers": opts.servers,
            "group.id": opts.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",  # never jump silently: an outage, then exit 2
        }
        settings.setdefault("log_level", 0)  # connection errors are handled here, not printed
        settings.setdefault("fetch.wait.max.ms", 100)
        settings.setdefault("error_cb", lambda err: logger.debug("kafka: %s", err))
        return Consumer(settings)

    def check(self) -> None:
        """Connects and checks the topics, then lets go (before a run builds its model).

        Raises:
            DataError: see `start`.
        """
        self._consumer = self._connect()
        try:
            self._partitions(self.options.connect_timeout_s, at_start=True)
        finally:
            self._consumer.close()
            self._consumer = None

    def close(self) -> None:
        """Stops the thread (the generator then ends) and closes the consumer.

        The close waits at most `CLOSE_TIMEOUT_S`: the client waits for requests still
        queued for a broker (an offset commit sent as the broker died), up to its socket
        timeout (60 s) and more, and a run that stops for an outage must exit with its
        checkpoint, not wait for them. A close that does not return in time is left to
        the process exit.
        """
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                self._drain()
                self._thread.join(0.1)
        if self._consumer is not None:
            if self.error is None:  # a commit to a broker that is down waits for its timeout
                self._flush_commit()
            closing = threading.Thread(target=self._consumer.close, name="recflow-kafka-close", daemon=True)
            closing.start()
            closing.join(CLOSE_TIMEOUT_S)
            if closing.is_alive():
                logger.warning("kafka: the client did not close within %g s; left to the exit", CLOSE_TIMEOUT_S)
            self._consumer = None

    def commit(self, offsets: Offsets) -> None:
        """Commits the trained offsets to the broker (monitoring only; async, by the thread)."""
        self._commit = dict(offsets)

    # ------------------------------------------------------------------ metadata

    def _partitions(self, timeout: float, at_start: bool = False) -> list[tuple[str, int]]:
        """Every partition of the topics, from the broker's metadata.

        Raises:
            DataError: at start-up, no broker within `timeout` or a missing topic;
                later, `_Unavailable` (retried by the thread).
        """
        from confluent_kafka import KafkaException

        opts = self.options
        try:
            metadata = self._consumer.list_topics(timeout=timeout)
        except KafkaException as e:
            if at_start:
                raise DataError(
                    f"data.kafka.servers: no Kafka broker answered at {opts.servers} within "
                    f"{opts.connect_timeout_s:g} s (data.kafka.connect_timeout_s) ({e.args[0].str()})"
                ) from None
            raise _Unavailable(f"no broker answered at {opts.servers}") from None
        found = []
        for topic in opts.names:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None or not info.partitions:
                if at_start:
                    known = sorted(t for t in metadata.topics if not t.startswith("__"))
                    raise DataError(
                        f"data.kafka.topic: no topic {topic!r} on {opts.servers} "
                        f"(topics: {', '.join(known) or 'none'})"
                    )
                raise _Unavailable(f"topic {topic!r} is gone from {opts.servers}")
            if len(info.partitions) > MAX_PARTITIONS:
                raise DataError(f"data.kafka.topic: {topic!r} has more than {MAX_PARTITIONS} partitions")
            found += [(topic, p) for p in sorted(info.partitions)]
        return found

    def _assign(self, partitions: list[tuple[str, int]]) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        self._assigned = list(partitions)
        self._eof: set = set()
        self._fetched = {
            tp: self._start.get(tp, OFFSET_BEGINNING) for tp in partitions
        }  # next offset to read (the position after the last queued message)
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in self._fetched.items()])

    def _add_partitions(self, partitions: list[tuple[str, int]]) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        new = [tp for tp in partitions if tp not in self._fetched]
        if not new:
            return
        logger.warning("kafka: new partitions %s, read from their beginning", new)
        for tp in new:
            self._fetched[tp] = self._start.get(tp, OFFSET_BEGINNING)
        self._assigned += new
        self._consumer.incremental_assign([TopicPartition(t, p, self._fetched[(t, p)]) for t, p in new])

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._read()
        except DataError as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - reported by the training loop
            self.error = DataError(f"data.kafka: the consumer failed: {type(e).__name__}: {e}")
            logger.exception("kafka consumer")
        finally:
            self._done.set()
            with self._ready:
                self._ready.notify_all()

    def _read(self) -> None:
        from confluent_kafka import KafkaError

        opts = self.options
        values: list = []
        keys: list = []
        positions: Offsets = {}
        idle_since = time.monotonic()
        checked = high_checked = time.monotonic()
        down_since: float | None = None
        backoff = 0.25
        while not self._stop.is_set():
            if down_since is None:  # a commit to a broker that is down would wait in its queue
                self._flush_commit()
            messages = self._consumer.consume(
                num_messages=max(1, self.batch_size - len(values)), timeout=0.1
            )
            now = time.monotonic()
            trouble = None
            for message in messages:
                error = message.error()
                tp = (message.topic(), message.partition())
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        self._eof.add(tp)
                    elif error.code() in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                        trouble = f"{tp[0]} partition {tp[1]}: offset {self._fetched.get(tp)} is out of range"
                    else:
                        trouble = error.str()
                    continue
                self._eof.discard(tp)
                offset = message.offset()
                value = message.value() or b""
                if self._json is not None:
                    line = self._json.line(value)
                    value = _UNREADABLE if line is None else line
                values.append(value)
                keys.append((self._slots[tp[0]] + tp[1]) * _STRIDE + offset)
                self._fetched[tp] = positions[tp] = offset + 1
            if messages:
                idle_since = now
            if now - high_checked >= 1.0:
                high_checked = now
                self._watermarks()
                trouble = trouble or self._past_the_end()
            caught_up = set(self._assigned) <= self._eof
            if len(values) >= self.batch_size or (
                values and caught_up and now - idle_since >= opts.poll_timeout_ms / 1000
            ):
                self._put(keys, values, positions)
                values, keys, positions = [], [], {}
            if trouble is None and now - checked < (1.0 if down_since else opts.metadata_interval_s):
                continue
            checked = now
            try:
                if trouble is not None:
                    raise _Unavailable(trouble)
                self._add_partitions(self._partitions(min(5.0, opts.connect_timeout_s)))
                if down_since is not None:
                    logger.warning("kafka: %s answers again", opts.servers)
                down_since, backoff = None, 0.25
            except _Unavailable as e:
                if down_since is None:
                    down_since = now
                    logger.warning("kafka: %s; retrying for %g s", e, opts.connect_timeout_s)
                if now - down_since >= opts.connect_timeout_s:
                    raise DataError(
                        f"data.kafka: {e} for {opts.connect_timeout_s:g} s "
                        "(data.kafka.connect_timeout_s); stopped with a checkpoint"
                    ) from None
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 4.0)
                self._reassign()

    def _watermarks(self) -> None:
        """Refreshes `high` from the client's cache (updated by each fetch; no request)."""
        from confluent_kafka import TopicPartition

        high = dict(self.high)
        for topic, partition in self._assigned:
            try:
                _, offset = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), cached=True
                )
            except Exception:  # noqa: BLE001 - not known yet; the next refresh tries again
                continue
            if offset >= 0:
                high[(topic, partition)] = offset
        self.high = high

    def _past_the_end(self) -> str | None:
        """A partition whose next offset lies past its high watermark: the broker lost
        messages it had served (a topic recreated, a memory broker restarted empty). Some
        brokers (Tansu) answer a fetch there with nothing rather than OFFSET_OUT_OF_RANGE:
        the run would wait, then skip every message up to that offset without a word."""
        for (topic, partition), position in self._fetched.items():
            high = self.high.get((topic, partition))
            if high is not None and position > high:
                return f"{topic} partition {partition}: offset {position} is past the partition's end ({high})"
        return None

    def lag(self, trained: Offsets) -> int | None:
        """Messages fetched-known but not trained: the sum over partitions of the high
        watermark minus the trained position; None before any watermark is known."""
        high = self.high
        if not high:
            return None
        return sum(max(0, offset - trained.get(tp, 0)) for tp, offset in high.items())

    def _reassign(self) -> None:
        """Seeks every partition back to the position after the last queued message
        (after an outage the client may have dropped or reset its fetch positions)."""
        from confluent_kafka import TopicPartition

        self._eof = set()
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in self._fetched.items()])

    def _put(self, keys: list, values: list, positions: Offsets) -> None:
        batch = (np.asarray(keys, np.int64), np.asarray(values, dtype=object), dict(positions))
        while not self._stop.is_set():
            try:
                self._queue.put(batch, timeout=0.1)
            except queue.Full:
                continue
            with self._ready:
                self._produced += 1
                self._ready.notify_all()
            return

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def _flush_commit(self) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        offsets, self._commit = self._commit, None
        if not offsets or self._consumer is None:
            return
        try:
            self._consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=True
            )
        except KafkaException as e:  # monitoring only: the checkpoint holds the offsets
            logger.debug("kafka: offset commit failed: %s", e)

    # ------------------------------------------------------------------ the consumer side

    def batches(self):
        """The generator of the dataset: (keys [B] int64, values [B] string) per batch;
        the position after each batch is appended to `positions`, in order."""
        while True:
            try:
                keys, values, positions = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._done.is_set() and self._queue.empty():
                    return
                continue
            self.positions.append(positions)
            yield keys, values

    def wait(self, taken: int, stop) -> bool:
        """Waits until a batch beyond the first `taken` is queued; False when none will
        come (the thread ended) or `stop()` is true. Returns regularly, so that signal
        handlers run in the waiting thread."""
        with self._ready:
            while self._produced <= taken:
                if self._done.is_set() or stop():
                    return False
                self._ready.wait(0.1)
        return True


class _Unavailable(Exception):
    """The broker or a topic is unreachable for now (retried)."""


def dataset(config: Config, source: KafkaSource):
    """The dataset of raw batches `(features, labels, bad)` read from `source`."""
    import tensorflow as tf

    from recflow.data import csv as csv_reader
    from recflow.data import records

    parse = csv_reader.line_parser(config, columns(config), "offset")
    ds = tf.data.Dataset.from_generator(
        source.batches,
        output_signature=(
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.string),
        ),
    )
    return records.finish(ds, parse, partition_names(config), records.parse_key(config, "kafka"))
