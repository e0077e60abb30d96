"""Atomic writes: a crash never leaves a half-written file or directory.

Files are written to a temp name beside their destination, flushed to disk,
then renamed into place; a failure (a full disk included) removes the temp.
Temps of a killed process are removed at the next start of a writer
(`recflow.training.lock.remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile


def strict(value):
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: str, text: str) -> None:
    """Writes `text` to a temp file beside `path`, then renames it into place.

    The file gets the permissions of a plain `open` (0644 under umask 022), not
    the temp file's 0600: a server running as another user reads exports.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path: str, value) -> None:
    """Writes strict JSON (NaN and inf become null) atomically (see `write_text`)."""
    write_text(path, json.dumps(strict(value), indent=2, sort_keys=True, allow_nan=False) + "\n")


@contextlib.contextmanager
def staged_dir(final: str, replace: bool = False):
    """Yields a temp dir beside `final`; renames it to `final` when the block succeeds.

    The dir gets the permissions of a plain `mkdir` (0755 under umask 022), not 0700.
    A failure in the block removes the temp dir and leaves `final` as it was.
    `replace`: an existing `final` is replaced, once the new dir is complete (it is
    renamed aside, the new one renamed into place, then the old one removed; a crash
    between the two renames leaves no `final`, and both as temps that the next
    writer's start removes).
    Without it, an existing non-empty `final` is an error.
    """
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        if replace and os.path.isdir(final):
            old = tempfile.mkdtemp(prefix=".tmp-old-", dir=parent)
            os.replace(final, old)  # onto the empty dir just made
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
