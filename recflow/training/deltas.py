"""The delta chain of a model dir: what the next `deltas/<step>/` starts from.

A delta holds the rows updated and the ids evicted since the previous delta
(layout in `recflow.embedding.lifecycle`), and its number in the chain
(`sequence`: 1, 2, ... consecutive). The chain's state is saved in every
checkpoint (top-level `delta_step`, `delta_sequence`, `pending_evicted`), so a
run resumed from a checkpoint writes the same deltas as one never stopped:

- `DeltaChain`: that state, and the delta it writes next;
- `set_aside_stale_deltas(deltas_dir, step)`: deltas newer than the restored
  checkpoint move to `deltas/.stale-<step>/`; the replayed steps rewrite them.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import tensorflow as tf

from recflow.embedding import lifecycle
from recflow.embedding.engine import EmbeddingEngine

logger = logging.getLogger(__name__)


class DeltaChain:
    """The checkpointed state of a model dir's delta chain.

    Attributes:
        step: the step of the last delta written (0: none yet).
        sequence: the last delta's sequence number.
        pending: the raw ids evicted since the last delta (`lifecycle.ids_to_bytes`):
            a restart between an eviction and the next delta still tells the
            servers to forget them.
    """

    def __init__(self):
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="delta_step")
        self.sequence = tf.Variable(0, dtype=tf.int64, trainable=False, name="delta_sequence")
        self.pending = tf.Variable(b"", dtype=tf.string, trainable=False, name="pending_evicted")

    def checkpointed(self) -> dict:
        """The objects a checkpoint saves, by their (top-level) names."""
        return {"delta_step": self.step, "delta_sequence": self.sequence, "pending_evicted": self.pending}

    def started(self, scheduled: bool) -> bool:
        """Whether there is a chain to continue: deltas are `scheduled`, or one was written
        (`recflow export --delta`)."""
        return scheduled or int(self.step) > 0

    def forget(self, gone: dict[str, np.ndarray]) -> None:
        """Adds evicted raw ids (per logical table) to what the next delta tells to forget."""
        if gone:
            pending = lifecycle.ids_from_bytes(self.pending.numpy())
            self.pending.assign(lifecycle.ids_to_bytes(lifecycle.merge_ids(pending, gone)))

    def write(
        self,
        engine: EmbeddingEngine,
        directory: str,
        step: int,
        *,
        structure_sha256: str,
        dense: list[tuple[str, np.ndarray]],
        extra: dict | None = None,
    ) -> None:
        """Writes the delta of `step` into `directory` (see `lifecycle.write_delta`); the
        chain moves on to it with `advance` once the directory is in place."""
        lifecycle.write_delta(
            engine, directory, int(self.step), step,
            sequence=int(self.sequence) + 1,
            structure_sha256=structure_sha256,
            dense=dense,
            evicted=lifecycle.ids_from_bytes(self.pending.numpy()),
            extra=extra,
        )  # fmt: skip

    def advance(self, step: int) -> None:
        """The delta of `step` is written: the next one starts from it."""
        self.step.assign(step)
        self.sequence.assign_add(1)
        self.pending.assign(b"")

    def adopt(self, deltas_dir: str, step: int) -> bool:
        """Takes the delta of `step` (the restored checkpoint's) into the chain when it
        continues it but the checkpoint does not record it: `recflow export --delta` writes
        one from a checkpoint without saving another. Without this, the next delta started
        again from the checkpoint's: a second delta of the same sequence number. Returns
        whether it was adopted."""
        if step <= int(self.step):
            return False
        try:
            with open(os.path.join(deltas_dir, str(step), "manifest.json"), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return False  # none, or unreadable: a delta of this step is written again
        if (manifest.get("step"), manifest.get("since_step"), manifest.get("sequence")) != (
            step, int(self.step), int(self.sequence) + 1
        ):
            return False
        self.advance(step)
        logger.info("delta chain: deltas/%d (sequence %d) continues it", step, int(self.sequence))
        return True


def delta_steps(deltas_dir: str) -> list[int]:
    """The steps of the deltas in `deltas_dir`, oldest first."""
    if not os.path.isdir(deltas_dir):
        return []
    return sorted(int(d) for d in os.listdir(deltas_dir) if d.isdigit())


def set_aside_stale_deltas(deltas_dir: str, step: int) -> str | None:
    """Moves `deltas/<n>` with n > `step` to `deltas/.stale-<step>/`; returns that dir.

    They were written by a run killed after its last checkpoint; the resumed
    run replays those steps and writes them again.
    """
    stale = [n for n in delta_steps(deltas_dir) if n > step]
    if not stale:
        return None
    aside = os.path.join(deltas_dir, f".stale-{step}")
    suffix = 1
    while os.path.exists(aside):
        suffix += 1
        aside = os.path.join(deltas_dir, f".stale-{step}.{suffix}")
    os.makedirs(aside)
    for n in stale:
        os.replace(os.path.join(deltas_dir, str(n)), os.path.join(aside, str(n)))
    logger.warning(
        "%s: %d delta(s) newer than the restored checkpoint (step %d) moved to %s; "
        "the replayed steps write them again", deltas_dir, len(stale), step, aside,
    )
    return aside
