"""Input splits for parameter-server training: each row read once per epoch, by one worker.

An epoch's input is cut into splits: one per training file, or for synthetic
data up to `SPLITS_PER_WORKER` row ranges per worker (whole batches each). The chief
hands out *chunks* of splits, `(split, first batch, batch count)`, as
`ClusterCoordinator` closures; a closure builds that chunk's dataset on the
worker that runs it and trains every batch of it there. So a row is read by one
worker, and the chief never reads the data itself.

`SplitState` (saved in every checkpoint, beside the model) records, per split,
how many batches are done, or that the split is finished. Checkpoints are taken
only when no closure is in flight, so a chief restarted from a checkpoint
continues with exactly the batches that checkpoint has not trained.

Reading a chunk from its `first` batch costs nothing for synthetic row ranges
(the batches are row indices until the chunk's rows are gathered); a file is
read from its start, so file chunks run to the end of the file (or to the
`train.steps` target) and are not cut at hook boundaries.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import tensorflow as tf

from recflow.config.schema import Config, DataConfig
from recflow.data import pipeline, records, sources, split_positions, synthetic
from recflow.data.split_positions import FINISHED

logger = logging.getLogger(__name__)

SPLITS_PER_WORKER = 4  # synthetic row ranges per worker at most: load balance vs per-chunk start-up
# Batches a synthetic split holds at least (unless that leaves a worker without one): a
# chunk's start costs the worker ~80 ms (its pipeline's functions are instantiated and
# optimized for each new iterator), ~15 steps of the demo at batch 512.
MIN_SPLIT_BATCHES = 256
UNLIMITED = 2**62  # a chunk's batch count: to the end of its split


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of an epoch.

    Args:
        index: its position in the epoch's list.
        file: the training file, or None for a synthetic row range.
        start, stop: the synthetic row range [start, stop) (0, 0 for a file).
    """

    index: int
    file: str | None = None
    start: int = 0
    stop: int = 0

    @property
    def seekable(self) -> bool:
        """A chunk may start at any batch at no cost (synthetic row ranges)."""
        return self.file is None

    def __str__(self) -> str:
        return self.file if self.file is not None else f"synthetic rows [{self.start}, {self.stop})"


def make_splits(config: Config, num_workers: int) -> list[Split]:
    """The splits of the training data: one per file, or synthetic row ranges: up to
    `SPLITS_PER_WORKER` per worker, each of `MIN_SPLIT_BATCHES` batches or more, but
    one per worker at least (and never more than the batches).

    Synthetic ranges hold whole batches (the last one the rest), so a split's
    batches are the batches a single pass would make. (A chief restarted with
    another worker count finds other ranges in the split state: they start over,
    see `SplitState`.)
    """
    data = config.data
    if data.format != "synthetic":
        files = sources.expand(data.train, "data.train")
        return [Split(i, file=f) for i, f in enumerate(files)]
    rows, batch = data.synthetic.rows, data.batch_size
    batches = -(-rows // batch)
    by_size = min(SPLITS_PER_WORKER * num_workers, batches // MIN_SPLIT_BATCHES)
    count = max(1, min(batches, max(num_workers, by_size)))
    bounds = [min(rows, (batches * i // count) * batch) for i in range(count + 1)]
    return [Split(i, start=bounds[i], stop=bounds[i + 1]) for i in range(count)]


def epoch_order(config: Config, splits: list[Split], epoch: int) -> list[int]:
    """The order in which an epoch hands out its splits: shuffled per epoch
    (`data.seed + epoch`) when `data.shuffle`, else the file/row order."""
    order = list(range(len(splits)))
    if config.data.shuffle:
        np.random.default_rng(config.data.seed + epoch).shuffle(order)
    return order


class SyntheticChunks:
    """Datasets of synthetic row-range chunks; one traced function serves every split.

    Args:
        config: the run config (`data.synthetic`, batch size, shuffle).
    """

    def __init__(self, config: Config):
        self.config = config
        columns, _ = synthetic.generate(config.data.synthetic, "train")
        self.uses = records.unique(sources.needs(config))
        self.data = {u.column: np.asarray(columns[u.column]) for u in self.uses}

    @tf.autograph.experimental.do_not_convert
    def dataset(self, start, stop, seed, first, count) -> tf.data.Dataset:
        """Batches `first .. first + count` of rows [start, stop), shuffled with `seed`."""
        config = self.config
        ds = tf.data.Dataset.range(start, stop)
        if config.data.shuffle:  # a fixed seed: a chunk sees the same order every time
            ds = ds.shuffle(config.data.shuffle_buffer, seed=seed, reshuffle_each_iteration=False)
        ds = ds.batch(config.data.batch_size).skip(first).take(count)
        data = {c: tf.constant(v) for c, v in self.data.items()}
        where = f"synthetic schema '{config.data.synthetic.schema}'"

        def convert(index):
            decoded = {u.key: records.typed(tf.gather(data[u.column], index), u, where) for u in self.uses}
            return records.outputs(config, decoded, tf.constant(0, tf.int64))

        return records.finish(ds, convert)


@tf.autograph.experimental.do_not_convert
def file_chunk_dataset(config: Config, file: str, epoch: int, first, count) -> tf.data.Dataset:
    """Batches `first .. first + count` of one file (records shuffled with `data.seed + epoch`)."""
    data = dataclasses.replace(config.data, seed=config.data.seed + epoch)
    ds = pipeline.make_file_dataset(dataclasses.replace(config, data=data), [file], epochs=1)
    return ds.skip(first).take(count)


class SplitState(tf.Module):
    """Per split of the current epoch: batches trained, or `FINISHED`; saved in checkpoints
    with the splits' names (a file's path, a synthetic row range) and what a position
    counts in (the batch size, and the record order: `data.shuffle`, `seed`,
    `shuffle_buffer`).

    A restored state is matched to this run's splits by name: a split found there goes
    on from its saved position, any other starts at its beginning. So files added to
    `data.train` between runs are read in the resumed epoch and a position never moves
    to another file; synthetic ranges cut for another worker count start over. A split
    read in batches of another size goes on from the batch holding its first unread
    record (at most a batch of rows is read again); one read in another record order
    starts over (its rows read again, none lost).

    Args:
        splits: the epoch's splits.
        data: the run's data config.
    """

    def __init__(self, splits: list[Split], data: DataConfig):
        super().__init__(name="splits")
        self.names = [str(s) for s in splits]
        self.batch_size = data.batch_size
        self.order = [data.shuffle, data.seed, data.shuffle_buffer]
        self.positions = tf.Variable(self._record([0] * len(splits)), trainable=False, name="positions")

    def read(self) -> list[int]:
        """The positions of this run's splits (see the class)."""
        saved = split_positions.decode(self.positions.numpy())
        if saved["splits"] is None:  # written before the state named its splits
            if len(saved["positions"]) == len(self.names):
                return saved["positions"]
            saved = {"splits": [], "positions": []}
        positions = saved["positions"]
        started = [p for p in positions if p not in (0, FINISHED)]
        if started and saved.get("order", self.order) != self.order:
            logger.warning(
                "data.shuffle, seed or shuffle_buffer changed since the checkpoint: the %d input "
                "splits read part way start over (their rows are read again)", len(started),
            )
            positions = [p if p == FINISHED else 0 for p in positions]
        elif started and saved.get("batch_size", self.batch_size) != self.batch_size:
            old = saved["batch_size"]
            logger.warning(
                "data.batch_size changed since the checkpoint (%d -> %d): the input splits read "
                "part way go on from the batch that holds their first unread row", old, self.batch_size,
            )
            positions = [p if p == FINISHED else p * old // self.batch_size for p in positions]
        by_name = dict(zip(saved["splits"], positions))
        if set(by_name) != set(self.names):
            logger.warning(
                "the checkpoint's input splits are not this run's: %d of %d go on from their "
                "position, the others start at their beginning",
                sum(name in by_name for name in self.names), len(self.names),
            )
        return [by_name.get(name, 0) for name in self.names]

    def write(self, positions: list[int]) -> None:
        self.positions.assign(self._record(positions))

    def reset(self) -> None:
        """A new epoch: every split untouched."""
        self.write([0] * len(self.names))

    def _record(self, positions: list[int]) -> str:
        return split_positions.encode(self.names, positions, self.batch_size, self.order)
