"""Prefetched rows kept on their shards' devices between steps (`train.prefetch_embeddings`).

A step that prefetches looks up the next batch's rows while it computes, and the
next step trains on them. Under parameter servers those rows must stay on their
PS task: a tensor that leaves a function (a loop variable, a `tf.cond` branch's
output, a call's result) goes through the worker, which ran the prefetch at a
loss (the packed rows, optimizer slots included, crossed PS -> worker -> PS every
step: 5.2x the bytes of a step without prefetch). So a step writes the rows it
prefetched into a staging variable on each shard's device, and the next step
reads them there; only a scalar token, for the order, crosses.

A shard's part of a batch (`engine.ShardRows`: keys, counts, packed rows, seen) is
staged as one float32 matrix, the integer columns bit-cast: a remote variable
read of a 1-D integer variable of unknown shape came back with the wrong shape
(TF 2.17), one of a known-rank shape crashed the worker, a 2-D float32 matrix of
unknown shape reads back whole.

Each chunk in flight uses its own slot of staging variables (the runner gives a
wave's chunks distinct slots), so workers never read each other's rows. The
staging variables are not checkpointed: a chunk stages its first batch's rows
when it starts.
"""

from __future__ import annotations

import tensorflow as tf

from recflow.embedding.placement import Placement, variables_on

_INT_COLUMNS = 6  # key ([2] int64: 4 columns), count, seen (int32: 1 column each)


class Staging:
    """Per slot, physical table and shard: one batch's rows on the shard's device.

    Args:
        row_type: the per-shard structure staged, `(keys, counts, rows, seen)`.
        widths: the packed row width of each physical table.
        placement: the shards' devices.
        slots: chunks that may run at once (each stages into its own slot).
    """

    def __init__(self, row_type, widths: list[int], placement: Placement, slots: int):
        self.row_type = row_type
        self.widths = widths
        self.placement = placement
        self._variables = []  # [table][shard] -> one variable per slot
        for t, width in enumerate(widths):
            shards = []
            for i in range(placement.num_shards):
                with variables_on(placement.device(i)):
                    shards.append(
                        [
                            tf.Variable(
                                tf.zeros([0, _INT_COLUMNS + width]),
                                shape=tf.TensorShape(None),
                                trainable=False,
                                name=f"staged_{t}_{i}_{s}",
                            )
                            for s in range(slots)
                        ]
                    )
            self._variables.append(shards)

    def write(self, slot: tf.Tensor, fetched: list, after: tf.Tensor | None = None) -> tf.Tensor:
        """Stages `fetched` (a batch's `Fetched` per table) in `slot`, on each shard's
        device, once `after` is done; returns the token `read` waits for.

        The token (int32 scalar, the keys staged) is the staged matrices' row counts,
        taken after the writes: not a constant, which a graph rewrite could fold with
        its control dependencies.
        """
        staged = []
        with tf.control_dependencies([] if after is None else [after]):
            for table, f in zip(self._variables, fetched):
                for i, (variables, part) in enumerate(zip(table, f.shards)):
                    with tf.device(self.placement.device(i)):
                        packed = _pack(part)
                        write = tf.raw_ops.AssignVariableOp(
                            resource=_handle(variables, slot), value=packed
                        )
                        with tf.control_dependencies([write]):
                            staged.append(tf.shape(packed)[0])
        with tf.device(self.placement.device(0)):  # one scalar leaves the PS tasks
            return tf.add_n(staged)

    def read(self, slot: tf.Tensor, after: tf.Tensor) -> list[list]:
        """The rows staged in `slot`, per table and shard (`row_type`), read on each
        shard's device once `after` (the write's token) is done."""
        out = []
        with tf.control_dependencies([after]):
            for table, width in zip(self._variables, self.widths):
                shards = []
                for i, variables in enumerate(table):
                    with tf.device(self.placement.device(i)):
                        packed = _read(_handle(variables, slot), width)
                        shards.append(self.row_type(*_unpack(packed)))
                out.append(shards)
        return out


def _read(handle: tf.Tensor, width: int) -> tf.Tensor:
    """A staged matrix [U, 6 + width]. Its static shape comes from the reshape alone:
    graph rewrites took the remote read's own (unknown) shape for a scalar's."""
    value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
    return tf.reshape(value, [-1, _INT_COLUMNS + width])


def _pack(part) -> tf.Tensor:
    """(keys, counts, rows, seen) -> one float32 matrix [U, 6 + width], bits kept."""
    keys, counts, rows, seen = part
    as_float = lambda x: tf.bitcast(x, tf.float32)  # noqa: E731
    key_columns = tf.reshape(as_float(tf.bitcast(keys, tf.int32)), [-1, 4])  # [U, 2, 2] -> [U, 4]
    return tf.concat([key_columns, as_float(counts)[:, None], as_float(seen)[:, None], rows], 1)


def _unpack(packed: tf.Tensor) -> tuple:
    """The inverse of `_pack`: (keys, counts, rows, seen)."""
    as_int = lambda x: tf.bitcast(x, tf.int32)  # noqa: E731
    keys = tf.bitcast(tf.reshape(as_int(packed[:, :4]), [-1, 2, 2]), tf.int64)  # [U, 2]
    return keys, as_int(packed[:, 4]), packed[:, _INT_COLUMNS:], as_int(packed[:, 5])


def _handle(variables: list, slot: tf.Tensor) -> tf.Tensor:
    """The resource handle of `variables[slot]`, picked on the current device."""
    if len(variables) == 1:
        return variables[0].handle
    return tf.gather(tf.stack([v.handle for v in variables]), slot)
