"""The packed row: `[embedding | optimizer slots | count | last_step]`.

One lookup and one insert per step move a key's whole state, so embedding and
optimizer state can never disagree after a restore. The two metadata columns
hold int32 values bit-cast into float32 (exact at any step count).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

META_COLUMNS = 2  # count of sightings, last step seen
KEY_BYTES = 16  # a table key: (slot, mixed id), two int64s


@dataclass(frozen=True)
class RowLayout:
    dim: int
    num_slots: int

    @property
    def slots_width(self) -> int:
        return self.dim * self.num_slots

    @property
    def width(self) -> int:
        return self.dim + self.slots_width + META_COLUMNS

    def split(self, rows: tf.Tensor):
        """rows [n, width] -> (emb [n, dim], slots [n, k*dim], count [n], last_step [n])."""
        # One op each (eager slices cost about 100 us apiece).
        emb, slots, meta = tf.split(rows, [self.dim, self.slots_width, META_COLUMNS], axis=1)
        count, last_step = tf.unstack(tf.bitcast(meta, tf.int32), num=META_COLUMNS, axis=1)
        return emb, slots, count, last_step

    def pack(self, emb, slots, count, last_step) -> tf.Tensor:
        meta = tf.bitcast(tf.stack([count, last_step], axis=1), tf.float32)
        return tf.concat([emb, slots, meta], axis=1)

    def split_numpy(self, rows: np.ndarray):
        """The numpy twin of `split`, for checkpoints read without a model."""
        rows = np.asarray(rows, np.float32).reshape(-1, self.width)
        meta = rows[:, self.dim + self.slots_width :].copy().view(np.int32)
        return rows[:, : self.dim], rows[:, self.dim : self.dim + self.slots_width], meta[:, 0], meta[:, 1]
