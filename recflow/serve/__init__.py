"""`recflow serve`: TF Serving's REST API over a model dir's newest export, kept fresh
by applying its deltas in place (docs/serving.md)."""

from __future__ import annotations

import gc
import logging
import os

from recflow.errors import RecflowError


def run_server(model_dir: str, host: str = "127.0.0.1", port: int = 8501,
               model_name: str | None = None, poll_seconds: float = 0.2) -> None:
    """Serves `model_dir` until interrupted (SIGINT / SIGTERM end it cleanly).

    Raises:
        RecflowError: `model_dir` is not a directory.
    """
    if not os.path.isdir(model_dir):
        raise RecflowError(f"{model_dir}: no such model dir")
    import tensorflow  # noqa: F401 - imported before the freeze below
    import uvicorn

    from recflow.serve.app import build_app
    from recflow.serve.state import ModelFollower

    # The interpreter's, TF's and the web stack's long-lived objects leave the collector's
    # view: a full collection would otherwise scan ~300k of them (0.15 s here, stalling
    # every request) each time a swapped-out export is collected.
    gc.collect()
    gc.freeze()
    name = model_name or os.path.basename(os.path.abspath(model_dir).rstrip("/"))
    follower = ModelFollower(model_dir, poll_seconds)
    follower.poll()  # the newest export, before the port opens
    if follower.served is None:
        logging.getLogger(__name__).warning("%s: no export yet; waiting for one", model_dir)
    follower.start()
    try:
        uvicorn.run(build_app(follower, name), host=host, port=port, log_level="warning",
                    access_log=False)
    finally:
        follower.stop()
