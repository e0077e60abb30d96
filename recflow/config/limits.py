"""What a config may ask of this machine: seed ranges and memory.

A value that sizes an allocation in this process (a table's `expected_keys` under
`distribute.strategy: local`, the synthetic rows, a DNN's layers) is refused when a
lower bound of what it allocates exceeds the machine's physical memory. Such a run
cannot succeed: without the check it ends in an out-of-memory traceback, or in the
kernel's OOM killer, after TensorFlow has started. A value under the bound is never
refused, so the check cannot turn away a run that could fit.
"""

from __future__ import annotations

import os

from recflow.errors import RecflowError

SEED_MAX = 2**32 - 1  # NumPy's seed range (`np.random.seed`, which Keras seeds)

# Synthetic rows are generated in memory, all at once. Peak resident bytes a row while
# generating 1M rows, measured: demo 547, criteo 516, sequence 1335; the bound uses the least.
SYNTHETIC_ROW_BYTES = 500


class MemoryLimitError(RecflowError, ValueError):
    """An allocation larger than this machine's memory: a user mistake (exit 2 in the CLI).

    A `ValueError` too, as Keras layers raise for bad arguments.
    """


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def size_text(nbytes: float) -> str:
    """`20.4 GB`: decimal units, three significant digits."""
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB"):
        if nbytes < 1000 or unit == "PB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.3g} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


def beyond_memory(nbytes: float) -> str | None:
    """None when `nbytes` fits in physical memory, else the end of an error message:
    `at least 400 TB, more than this machine's memory (23.6 GB)`."""
    memory = physical_memory()
    if memory is None or nbytes <= memory:
        return None
    return f"at least {size_text(nbytes)}, more than this machine's memory ({size_text(memory)})"
