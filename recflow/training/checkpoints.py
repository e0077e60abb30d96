"""The checkpoint files of a model dir: which ones read back whole, and repairs.

- `readable_checkpoint(checkpoint_dir)`: the newest `ckpt-N` whose index and
  data read back whole (TF checks each tensor's CRC32C), falling back past
  damaged ones with one warning naming their files.
- `repair_checkpoints(checkpoint_dir, good)`: moves damaged checkpoints newer
  than `good` to `checkpoints/.damaged/` and rebuilds the `checkpoint` index
  file from the `ckpt-*` files present when it does not parse or disagrees.
- `discard_failed_save(checkpoint_dir, step)`: removes what a save that raised staged.
- `saved_value(checkpoint_dir, name)`: a variable of the newest readable
  checkpoint, read without building a model.

The model dir's owner, `recflow.training.model_dir.ModelDir`, is their caller;
`recflow tables` reads with them too.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil

from recflow.atomic import write_text
from recflow.errors import RecflowError

logger = logging.getLogger(__name__)

DAMAGED_DIR = ".damaged"
_CKPT_INDEX = re.compile(r"ckpt-(\d+)\.index")


def checkpoint_steps(checkpoint_dir: str) -> list[int]:
    """The N of every `ckpt-N.index` present, newest first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    steps = [int(m.group(1)) for m in map(_CKPT_INDEX.fullmatch, os.listdir(checkpoint_dir)) if m]
    return sorted(steps, reverse=True)


def checkpoint_files(prefix: str) -> list[str]:
    """The files of checkpoint `prefix` (its index and data shards)."""
    return sorted(glob.glob(glob.escape(prefix) + ".index") + glob.glob(glob.escape(prefix) + ".data-*"))


_verified: dict[tuple, str | None] = {}
_warned: set[tuple] = set()


def _fingerprint(prefix: str) -> tuple:
    stats = []
    for path in checkpoint_files(prefix):
        st = os.stat(path)
        stats.append((path, st.st_size, st.st_mtime_ns))
    return (prefix, tuple(stats))


def verify_checkpoint(prefix: str) -> str | None:
    """None when checkpoint `prefix` reads back whole, else why not (one line).

    Reads every tensor: TF checks each one's length and CRC32C, so a truncated
    data file, flipped bytes or an empty index are all caught.
    """
    import tensorflow as tf

    key = _fingerprint(prefix)
    if key in _verified:
        return _verified[key]
    index = prefix + ".index"
    problem = None
    if not os.path.exists(index) or os.path.getsize(index) == 0:
        problem = f"{os.path.basename(index)} is empty"
    else:
        try:
            reader = tf.train.load_checkpoint(prefix)
            with tf.device("/cpu:0"):
                for name, dtype in reader.get_variable_to_dtype_map().items():
                    # RestoreV2 reads any dtype (the input position is a variant).
                    tf.raw_ops.RestoreV2(
                        prefix=prefix, tensor_names=[name], shape_and_slices=[""], dtypes=[dtype]
                    )
        except Exception as e:  # noqa: BLE001 - TF raises OpError, IndexError, ValueError...
            text = getattr(e, "message", None) or str(e)
            text = re.sub(r"\{\{.*?\}\}", "", text)  # {{function_node ...}}
            text = re.sub(r"\s*\[Op:\w+\]", "", text)
            problem = " ".join(text.split())[:200]
    _verified[key] = problem
    return problem


def readable_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest checkpoint that reads back whole (its path prefix), or None if there is none.

    Damaged newer ones are skipped with one warning naming their files.

    Raises:
        RecflowError: checkpoints exist but none is readable (names the files).
    """
    damaged = []
    for step in checkpoint_steps(checkpoint_dir):
        prefix = os.path.join(checkpoint_dir, f"ckpt-{step}")
        problem = verify_checkpoint(prefix)
        if problem is None:
            if damaged and (checkpoint_dir, tuple(damaged)) not in _warned:
                _warned.add((checkpoint_dir, tuple(damaged)))
                logger.warning(
                    "%s: damaged checkpoint(s) skipped, restoring %s instead: %s",
                    checkpoint_dir, os.path.basename(prefix), "; ".join(damaged),
                )
            return prefix
        files = ", ".join(os.path.basename(f) for f in checkpoint_files(prefix))
        damaged.append(f"{files} ({problem})")
    if damaged:
        raise RecflowError(f"{checkpoint_dir}: no readable checkpoint; damaged: {'; '.join(damaged)}")
    return None


def repair_checkpoints(checkpoint_dir: str, good: str | None) -> None:
    """Makes the dir agree with `good` (from `readable_checkpoint`): damaged newer
    checkpoints move to `.damaged/`, and the `checkpoint` index file is rebuilt
    from the `ckpt-*` files present when it does not parse or disagrees.

    Call only while holding `writer_lock` (or in a process that owns the dir).
    """
    import tensorflow as tf

    if good is None:
        return
    good_step = int(os.path.basename(good).rpartition("-")[2])
    for step in checkpoint_steps(checkpoint_dir):
        if step <= good_step:
            break
        aside = os.path.join(checkpoint_dir, DAMAGED_DIR)
        os.makedirs(aside, exist_ok=True)
        for path in checkpoint_files(os.path.join(checkpoint_dir, f"ckpt-{step}")):
            os.replace(path, os.path.join(aside, os.path.basename(path)))
    present = [os.path.join(checkpoint_dir, f"ckpt-{s}") for s in reversed(checkpoint_steps(checkpoint_dir))]
    index = os.path.join(checkpoint_dir, "checkpoint")
    state = None
    if os.path.exists(index):
        try:
            state = tf.train.get_checkpoint_state(checkpoint_dir)
        except (tf.errors.OpError, ValueError):
            state = None
    listed = []
    if state is not None:
        listed = [os.path.join(checkpoint_dir, os.path.basename(p)) for p in state.all_model_checkpoint_paths]
        current = os.path.join(checkpoint_dir, os.path.basename(state.model_checkpoint_path))
    if state is None or current != good or listed != present:
        if os.path.exists(index) and state is None:
            logger.warning("%s: unreadable; rebuilt from %s", index,
                           ", ".join(os.path.basename(p) for p in present))
        # The CheckpointState text proto, relative paths (what CheckpointManager writes).
        lines = [f'model_checkpoint_path: "{os.path.basename(good)}"']
        lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in present]
        write_text(index, "\n".join(lines) + "\n")


def discard_failed_save(checkpoint_dir: str, step: int) -> None:
    """Removes the staging of a checkpoint save that raised (e.g. a full disk)."""
    for path in glob.glob(os.path.join(checkpoint_dir, f"ckpt-{step}_temp*")):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


def variable_key(name: str) -> str:
    """The checkpoint key of a top-level variable `name` (tf.train.Checkpoint's layout)."""
    return f"{name}/.ATTRIBUTES/VARIABLE_VALUE"


def recorded_structure(reader) -> dict | None:
    """The model identity a checkpoint records (`reader`: `tf.train.load_checkpoint`'s), or
    None: written by an older recflow (see `recflow.models.identity`)."""
    from recflow.models.identity import VARIABLE

    key = variable_key(VARIABLE)
    return json.loads(reader.get_tensor(key).decode()) if reader.has_tensor(key) else None


def saved_value(checkpoint_dir: str, name: str):
    """A top-level variable of the newest readable checkpoint (None: no checkpoint, or
    none records `name`), read without building a model."""
    import tensorflow as tf

    latest = readable_checkpoint(checkpoint_dir)
    if latest is None:
        return None
    reader = tf.train.load_checkpoint(latest)
    key = variable_key(name)
    return reader.get_tensor(key) if key in reader.get_variable_to_shape_map() else None
