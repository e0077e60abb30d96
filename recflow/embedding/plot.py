"""`recflow tables --plot`: keys and bytes per logical table over a model dir's checkpoints."""

from __future__ import annotations

import contextlib
import io
import os

from recflow.errors import RecflowError

LEGEND = 8  # tables named in the legend, the largest by bytes


def require_matplotlib() -> None:
    """Raises a one-line RecflowError when matplotlib (the `plot` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RecflowError(
            "tables --plot needs matplotlib: pip install 'recflow[plot]' (or matplotlib)"
        ) from None


def plot_history(history: list[tuple[int, dict]], out: str, title: str = "") -> None:
    """Draws keys (with waiting keys dashed) and bytes per table against the step into `out`.

    The `LEGEND` largest tables (by bytes at the last checkpoint) are named and
    coloured; the others are drawn in grey.

    Args:
        history: `(step, {table: {"keys", "waiting_keys", "bytes", ...}})`, oldest first,
            as `recflow.training.tables.table_history` returns.
        out: the image file (its extension picks the format: .png, .svg, .pdf).
        title: the figure's title (e.g. the model dir).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [step for step, _ in history]
    last = history[-1][1]
    # The largest tables get a colour and a legend entry; the others are drawn thin and grey.
    names = sorted(last, key=lambda n: (-last[n]["bytes"], n))
    named = names[:LEGEND]
    fig, (keys_ax, bytes_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(names):
        style = (  # named ones on top
            {"color": f"C{i}", "lw": 1.8, "label": name, "zorder": 3}
            if name in named
            else {"color": "0.75", "lw": 0.8, "zorder": 2}
        )
        keys = [stats.get(name, {}).get("keys", 0) for _, stats in history]
        waiting = [stats.get(name, {}).get("waiting_keys", 0) for _, stats in history]
        size = [stats.get(name, {}).get("bytes", 0) / 2**20 for _, stats in history]
        keys_ax.plot(steps, keys, "o-", ms=3, **style)
        if any(waiting):
            keys_ax.plot(steps, waiting, "o--", ms=3, **{**style, "label": None})
        bytes_ax.plot(steps, size, "o-", ms=3, **style)
    if len(names) > len(named):
        bytes_ax.plot([], [], color="0.75", lw=0.8, label=f"{len(names) - len(named)} smaller tables")
    keys_ax.set(title="keys with a row (dashed: waiting for admission)", xlabel="step", ylabel="keys")
    bytes_ax.set(title="bytes of rows", xlabel="step", ylabel="MiB")
    for ax in (keys_ax, bytes_ax):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    bytes_ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    fig.subplots_adjust(left=0.07, right=0.8, wspace=0.3, top=0.85 if title else 0.9)
    image = io.BytesIO()
    try:
        fig.savefig(image, format=os.path.splitext(out)[1][1:] or "png", dpi=110)
    except ValueError as e:  # an unknown extension
        raise RecflowError(f"tables --plot {out}: {e}") from None
    finally:
        plt.close(fig)
    _write(out, image.getvalue())


def _write(path: str, data: bytes) -> None:
    """Writes `data` beside `path`, then renames it into place (never half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise RecflowError(f"tables --plot {path}: {e.strerror}") from None
