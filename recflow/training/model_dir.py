"""The model dir as a shared resource: one writer, no stale temp files, and
checkpoints that are verified before they are trusted.

- `writer_lock(model_dir, command)`: an advisory `fcntl.flock` on
  `MODEL_DIR/.lock`, holding the writer's PID. Train, export and evaluate take
  it; a second writer gets a one-line error naming the holder. The kernel drops
  the lock when the holder dies, `kill -9` included.
- `remove_stale_temps(model_dir)`: what killed writes leave behind
  (`checkpoints/ckpt-N_temp*`, `export/.tmp-*`, `deltas/.tmp-*`, `*.tmp-PID`).
  Only safe under the lock: then no other writer is staging anything.
- `readable_checkpoint(checkpoint_dir)`: the newest `ckpt-N` whose index and
  data read back whole (TF checks each tensor's CRC32C), falling back past
  damaged ones with one warning naming their files.
- `repair_checkpoints(checkpoint_dir, good)`: moves damaged checkpoints newer
  than `good` to `checkpoints/.damaged/` and rebuilds the `checkpoint` index
  file from the `ckpt-*` files present when it does not parse or disagrees.
- `set_aside_stale_deltas(deltas_dir, step)`: deltas newer than the restored
  checkpoint move to `deltas/.stale-<step>/`; the replayed steps rewrite them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import re
import shutil
from collections.abc import Iterator

from recflow.atomic import write_text
from recflow.errors import RecflowError

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
DAMAGED_DIR = ".damaged"
_CKPT_INDEX = re.compile(r"ckpt-(\d+)\.index")


# ---------------------------------------------------------------------- lock


def ensure_dir(model_dir: str) -> None:
    """Creates the model dir; one-line errors when the path is a file or cannot be made."""
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise RecflowError(f"{model_dir}: model dir is an existing file, not a directory")
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as e:
        raise RecflowError(f"{model_dir}: cannot create the model dir ({e.strerror})") from None


@contextlib.contextmanager
def writer_lock(model_dir: str, command: str) -> Iterator[None]:
    """Holds the model dir's writer lock for the block.

    Raises:
        RecflowError: another process holds it (names its PID and command).
    """
    ensure_dir(model_dir)
    path = os.path.join(model_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        raise RecflowError(
            f"{model_dir}: not writable (permission denied on {LOCK_FILE}); train, evaluate and "
            "export write the model dir: use one you can write, or copy it"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
            who = f"pid {holder[0]}" if holder else "another process"
            what = f" (`recflow {' '.join(holder[1:])}`)" if len(holder) > 1 else ""
            raise RecflowError(
                f"{model_dir}: in use by {who}{what}; one writer per model dir "
                "(wait for it to finish, or use another --model-dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


# ---------------------------------------------------------------------- stale temps


def remove_stale_temps(model_dir: str) -> list[str]:
    """Removes temp files and dirs left by killed writers; returns them (relative paths).

    Call only while holding `writer_lock`.
    """
    patterns = [
        "checkpoints/ckpt-*_temp*",  # tf.train.CheckpointManager's staging
        "checkpoints/.tmp*",
        "export/.tmp-*",
        "deltas/.tmp-*",
        ".tmp-*",  # atomic.write_json
        "*.tmp-*",  # config.yaml.tmp-PID
    ]
    removed = []
    for pattern in patterns:
        for path in glob.glob(os.path.join(model_dir, pattern)):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)
            removed.append(os.path.relpath(path, model_dir))
    if removed:
        logger.warning("%s: removed %d stale temp file(s) of killed runs: %s",
                       model_dir, len(removed), ", ".join(sorted(removed)))
    return sorted(removed)


# ---------------------------------------------------------------------- checkpoints


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


# ---------------------------------------------------------------------- deltas


def delta_steps(deltas_dir: str) -> list[int]:
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
