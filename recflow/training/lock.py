"""The model dir's writer lock: one writer at a time, and no stale temp files.

- `writer(model_dir, command)`: holds the lock for a block, after removing what
  killed writers left. Train, export and evaluate run inside it; only train
  creates a model dir (export and evaluate refuse one without a checkpoint
  before writing anything, the lock file included).
- `writer_lock(model_dir, command)`: an advisory `fcntl.flock` on
  `MODEL_DIR/.lock`, holding the writer's PID. A second writer gets a one-line
  error naming the holder. The kernel drops the lock when the holder dies,
  `kill -9` included.
- `remove_stale_temps(model_dir)`: what killed writes leave behind
  (`checkpoints/ckpt-N_temp*`, `export/.tmp-*`, `deltas/.tmp-*`, `*.tmp-PID`).
  Only safe under the lock: then no other writer is staging anything.

No TensorFlow here: a second writer is refused before TensorFlow is imported.
The state under the lock is the `recflow.training.model_dir.ModelDir`'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import shutil
from collections.abc import Iterator

from recflow.errors import RecflowError
from recflow.layout import Layout

logger = logging.getLogger(__name__)

@contextlib.contextmanager
def writer(model_dir: str, command: str) -> Iterator[None]:
    """Holds the writer lock of `model_dir` for the block (`command` names the holder
    to a second writer), after removing the temps of killed writers.

    Only `train` creates the model dir. Export and evaluate read its checkpoint: where
    there is none and no writer ever locked the dir (no `.lock`; a model dir that does
    not exist included), they are refused before anything is written, the lock file
    included. Where a `.lock` is, the lock comes first: a training run that has not
    written its first checkpoint yet is named as the holder.

    Raises:
        RecflowError: another process holds it, `model_dir` cannot be a model dir, or
            (not `train`) it has neither a lock file nor a checkpoint.
    """
    if command != "train" and not os.path.exists(Layout(model_dir).lock_path):
        require_checkpoint(model_dir)
    with writer_lock(model_dir, command):
        remove_stale_temps(model_dir)
        yield


def require_checkpoint(model_dir: str) -> None:
    """Refuses, in one line and creating nothing, a model dir with no checkpoint files to read."""
    _refuse_files(model_dir)
    checkpoint_dir = Layout(model_dir).checkpoint_dir
    if not glob.glob(os.path.join(glob.escape(checkpoint_dir), "ckpt-*.index")):
        raise RecflowError(f"{checkpoint_dir}: no checkpoint to read (train first)")


def _refuse_files(model_dir: str) -> None:
    """One-line errors for a model dir, or a directory of its layout, that is a file."""
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise RecflowError(f"{model_dir}: model dir is an existing file, not a directory")
    layout = Layout(model_dir)
    for path in (layout.checkpoint_dir, layout.export_dir, layout.deltas_dir, layout.logs_dir):
        if os.path.exists(path) and not os.path.isdir(path):
            raise RecflowError(
                f"{path}: an existing file where a model dir keeps a directory; not a recflow "
                "model dir? use another --model-dir, or move the file away"
            )


def ensure_dir(model_dir: str) -> None:
    """Creates the model dir; one-line errors when the path (or a directory of its layout,
    such as `checkpoints`) is a file, or it cannot be made."""
    _refuse_files(model_dir)
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
    path = Layout(model_dir).lock_path
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        raise RecflowError(
            f"{model_dir}: not writable (permission denied on {os.path.basename(path)}); train, "
            "evaluate and export write the model dir: use one you can write, or copy it"
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
