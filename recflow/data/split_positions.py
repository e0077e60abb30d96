"""The record of a parameter-server run's input position that a checkpoint holds.

Parameter servers read an epoch as splits (`recflow.distribute.splits`); the
checkpoint's `splits/positions` string records, per split, the batches trained or
`FINISHED`, with what a position counts in:

    {"splits": ["train.csv", ...], "positions": [12, -1, 0],
     "batch_size": 64, "order": [true, 7, 10000]}

Checkpoints written before the record named its splits hold the bare list of
positions. `SplitState` writes and reads the record; a local run reads it only to
tell whether the checkpoint stopped part way through an epoch (`started`).
"""

from __future__ import annotations

import json

CHECKPOINT_KEY = "splits"  # the `SplitState` in a checkpoint, beside the model
VARIABLE = f"{CHECKPOINT_KEY}/positions"  # the record in a checkpoint (`SplitState.positions`)
FINISHED = -1  # the position of a split whose every batch is trained


def encode(names: list[str], positions: list[int], batch_size: int, order: list) -> str:
    """The record of `positions` of the splits `names`."""
    return json.dumps({
        "splits": names, "positions": [int(p) for p in positions],
        "batch_size": batch_size, "order": order,
    })


def decode(record: bytes | str) -> dict:
    """The record as a dict; an older bare list has `splits` None (and no batch size or order)."""
    saved = json.loads(record.decode() if isinstance(record, bytes) else record)
    if isinstance(saved, list):
        return {"splits": None, "positions": saved}
    return saved


def started(record: bytes | str) -> bool:
    """Whether any split of the record was read (finished ones included): the epoch is
    under way."""
    return any(decode(record)["positions"])
