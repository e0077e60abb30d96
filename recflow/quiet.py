"""Keeping TensorFlow's native log lines off the user's screen (DESIGN section 9).

TF 2.17 writes some lines straight to file descriptor 2 from C++, whatever
`TF_CPP_MIN_LOG_LEVEL` says: the cuFFT/cuDNN/cuBLAS factory lines at import, and
absl's `I0000 ... XLA service ... initialized` lines at the first XLA compile.
`native_stderr_silenced()` points fd 2 at /dev/null around such a call (Python's
own `sys.stderr` messages are not written during it). `RECFLOW_DEBUG=1` keeps
everything.
"""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def native_stderr_silenced():
    """Fd 2 goes to /dev/null inside the block (unless RECFLOW_DEBUG is set)."""
    if os.environ.get("RECFLOW_DEBUG"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
