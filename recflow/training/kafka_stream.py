"""Online learning from Kafka: `recflow train` with `data.format: kafka`.

Exact offsets: the checkpoint holds each partition's next offset (`KafkaState`),
advanced by the batches actually trained up to its step. A restart (after a signal,
a crash or kill -9) restores the model and those offsets together and reads on from
them, so no message is trained twice relative to the restored model, and none is
skipped. The trained offsets are committed to the broker (`data.kafka.group_id`)
after each checkpoint that holds them: for monitoring only.

The run ends at `train.steps` (when set) or on SIGTERM / Ctrl-C, the normal end of
a stream: a final delta (when deltas are scheduled), a final checkpoint, the export
and metrics. A broker that stays unreachable ends it with a checkpoint and a
`DataError` (exit 2).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable

import tensorflow as tf
import tf_keras as keras

from recflow.data import kafka
from recflow.training.model_dir import ModelDir
from recflow.training.progress import StreamStatus
from recflow.training.runner import LocalRunner
from recflow.training.trainer import Trainer

logger = logging.getLogger(__name__)


class KafkaState(tf.Module):
    """Saved in each checkpoint: the next offset of each partition and the offsets at
    the last delta (the deltas' sequence number is the model dir's)."""

    def __init__(self):
        super().__init__(name="kafka")
        self.offsets = tf.Variable("{}", dtype=tf.string, trainable=False, name="offsets")
        self.delta_offsets = tf.Variable("{}", dtype=tf.string, trainable=False, name="delta_offsets")
        self._cache: kafka.Offsets | None = None

    def read(self) -> kafka.Offsets:
        if self._cache is None:
            self._cache = kafka.decode_offsets(self.offsets.numpy().decode())
        return dict(self._cache)

    def advance(self, positions: kafka.Offsets) -> None:
        """Records a trained batch: the position after it, per partition it touched."""
        if not positions:
            return
        current = self.read()
        current.update(positions)
        self._cache = current
        self.offsets.assign(kafka.encode_offsets(current))

    def delta_info(self) -> dict:
        """The next delta's manifest field `kafka_offsets`: the offsets it covers
        (`{topic: {partition: [from, to]}}`, `to` exclusive)."""
        now = self.read()
        before = kafka.decode_offsets(self.delta_offsets.numpy().decode())
        self.delta_offsets.assign(kafka.encode_offsets(now))
        covered: dict = {}
        for (topic, partition), offset in sorted(now.items()):
            covered.setdefault(topic, {})[str(partition)] = [before.get((topic, partition), 0), offset]
        return {"kafka_offsets": covered}


class StreamIterator:
    """The dataset iterator of a stream, advancing `KafkaState` by each batch taken.

    Batches leave the pipeline in the order the source queued them (tf.data keeps the
    order of a deterministic map), so the n-th batch taken is the n-th position queued.
    `next` waits in Python (signal handlers run) and ends the stream when `stopped()`
    says a stop is requested, or the source ended.
    """

    def __init__(self, iterator, source: kafka.KafkaSource, state: KafkaState, stopped: Callable[[], bool]):
        self.iterator, self.source, self.state, self.stopped = iterator, source, state, stopped
        self.element_spec = iterator.element_spec
        self.taken = 0

    def __iter__(self):
        return self

    def __next__(self):
        if not self.source.wait(self.taken, self.stopped):
            raise StopIteration
        batch = next(self.iterator)
        self.taken += 1
        self.state.advance(self.source.positions.popleft())
        return batch


class CommitOffsets(keras.callbacks.Callback):
    """Commits the trained offsets to the broker after each checkpoint (monitoring)."""

    def __init__(self, model_dir: ModelDir, source: kafka.KafkaSource, state: KafkaState):
        super().__init__()
        self.model_dir, self.source, self.state = model_dir, source, state

    def on_train_batch_end(self, batch, logs=None):
        if self.model_dir.saved_step == batch:
            self.source.commit(self.state.read())


def stream(trainer: Trainer, status_every: float | None = None) -> dict:
    """Trains on `data.kafka` until `train.steps`, a stop request, or a broker outage.

    `status_every`: print a live line (rate, messages behind) at most this often.

    Returns:
        A summary: steps, examples, `stopped` (the signal name) when a signal ended it,
        `kafka_offsets` (the trained offsets).

    Raises:
        DataError: the broker is unreachable at start-up or stays so mid-run (after a
            checkpoint), a topic is missing, or too many bad rows.
    """
    config, model_dir = trainer.config, trainer.model_dir
    model_dir.prepare()
    state = KafkaState()
    model_dir.open_checkpoint(kafka=state)  # the model, tables and offsets, together
    model_dir.delta_info = state.delta_info
    start_step, target = int(trainer.model.global_step), config.train.steps
    if target is not None and start_step >= target:
        return trainer.already_done(0)
    source = kafka.KafkaSource(config, state.read())
    source.start()
    trainer.callbacks.append(CommitOffsets(model_dir, source, state))
    if status_every is not None:
        def lag():
            behind = source.lag(state.read())
            return None if behind is None else f"{behind:,} messages"

        trainer.callbacks.append(StreamStatus(lag, status_every))
    try:
        ds = trainer.transformed(kafka.dataset(config, source))
        model = trainer.model
        iterator = StreamIterator(iter(ds), source, state, lambda: bool(model.stop_training))
        began = time.perf_counter()
        trainer.callbacks.on_train_begin()
        steps = LocalRunner(config, trainer.model, trainer.epoch_dataset)
        examples = trainer.train_on(steps.reports(iterator, target), target=target)
        elapsed = time.perf_counter() - began
        if config.export.delta_every_steps or config.export.delta_every_seconds:
            if int(trainer.model.global_step) > start_step:
                model_dir.write_delta()  # the final delta, before the final checkpoint
        summary = trainer.finish(examples, elapsed, start_step)
        source.commit(state.read())
    finally:
        source.close()
    if source.error is not None:
        raise source.error
    if trainer.interrupted is not None:
        summary["stopped"] = signal.Signals(trainer.interrupted).name
    summary["kafka_offsets"] = {f"{t}:{p}": o for (t, p), o in sorted(state.read().items())}
    return summary
