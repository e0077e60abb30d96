"""The served model and how it follows its model dir.

`ModelFollower` holds the `Served` model (one loaded export, plus the deltas
applied to it) and a thread that polls the model dir:

- a newer export version is loaded beside the served one, warmed up (`warm_up`)
  and swapped in with one reference assignment: a request that already holds the
  old one finishes on it; the old one is released (and its memory collected) on
  the follower's thread once no request is inside it, never on a request's;
- the next delta of the chain is read, checked (file hashes, structure
  fingerprint, shapes) and applied in place with the export's own `apply_delta`,
  under the write side of a readers-writer lock, so no prediction sees half a delta;
- the first delta applied to export k is the one with `since_step <= k < step`,
  then each next `sequence`; a gap (or a chain that restarted, as after a
  training resume) loads the newest export again and continues from it;
- a bad delta, an unreadable export or a vanished model dir is logged once and
  the last good state keeps serving.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from recflow.layout import Layout

logger = logging.getLogger(__name__)


RETIRE_SECONDS = 1.0  # a swapped-out export is released this long after the swap


class RWLock:
    """Many readers or one writer; a waiting writer blocks new readers (no starvation)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    def acquire_read(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self):
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_write(self):
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True

    def release_write(self):
        with self._cond:
            self._writer = False
            self._cond.notify_all()


class DeltaError(Exception):
    """A delta that cannot be applied (unreadable, corrupt, for another model)."""


DEFAULT_SIGNATURE = "serving_default"  # what TF Serving runs when a request names none


@dataclass
class Served:
    """One loaded export and the deltas applied to it since."""

    version: int  # the export's version (its step)
    path: str
    module: object  # what tf.saved_model.load returned
    signatures: dict  # its signatures by name (`serving_default`; a retrieval model's `query`, `candidate`)
    fingerprint: str  # sha256 of its structure.json (canonical JSON)
    step: int = 0  # the step it serves now (the last applied delta's)
    sequence: int | None = None  # the last applied delta's sequence number
    delta_written_at: float | None = None  # when the last applied delta was written
    lock: RWLock = field(default_factory=RWLock)

    @property
    def signature(self):
        """The `serving_default` signature."""
        return self.signatures[DEFAULT_SIGNATURE]

    def predict(self, feed: dict, name: str = DEFAULT_SIGNATURE) -> dict:
        """Runs signature `name` on `feed` (name -> tensor) under the read lock (numpy out)."""
        self.lock.acquire_read()
        try:
            out = self.signatures[name](**feed)
            return {k: v.numpy() for k, v in out.items()}
        finally:
            self.lock.release_read()


def fingerprint_of(structure: dict) -> str:
    """The structure fingerprint a delta manifest records (`lifecycle.structure_fingerprint`)."""
    text = json.dumps(structure, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def load_export(path: str) -> Served:
    import tensorflow as tf

    with open(os.path.join(path, "assets.extra", "structure.json"), encoding="utf-8") as f:
        fingerprint = fingerprint_of(json.load(f))
    module = tf.saved_model.load(path)
    if not hasattr(module, "apply_delta"):
        logger.warning("%s has no apply_delta (exported by an older recflow): deltas are not applied", path)
    version = int(os.path.basename(path.rstrip("/")))
    return Served(version, path, module, dict(module.signatures), fingerprint,
                  step=int(module.global_step.numpy()))


def warm_up(served: Served) -> None:
    """Calls a loaded export's signatures and `apply_delta` once each before it is
    served, changing nothing.

    The first call of a loaded function instantiates (optimizes) its graph: ~0.1 s
    each here, which would stall the first requests after a swap and hold the write
    lock of the first delta applied to it. `serving_default` gets rows of empty raw
    values (the ones an export feeds a feature a signature leaves out); `apply_delta`
    an empty delta, which its own size check of `dense` refuses before any write
    (or, for a model without dense weights, a delta that changes nothing).

    Raises:
        RuntimeError: the warm-up changed the model's step (it never should).
    """
    import tensorflow as tf

    empty = {tf.int64: -1, tf.string: "", tf.float32: float("nan")}
    for signature in served.signatures.values():
        specs = signature.structured_input_signature[1]
        for rows in (1, 256):
            signature(**{k: tf.fill([rows], tf.constant(empty[s.dtype], s.dtype)) for k, s in specs.items()})
    if not hasattr(served.module, "apply_delta"):
        return
    spec = served.module.apply_delta.structured_input_signature[0][0]
    delta = {k: tf.zeros([0, *s.shape.as_list()[1:]], s.dtype) for k, s in spec.items() if k != "step"}
    try:
        served.module.apply_delta({**delta, "step": tf.constant(served.step, tf.int64)})
    except tf.errors.InvalidArgumentError:
        pass  # refused by the size check, as intended
    if int(served.module.global_step.numpy()) != served.step:
        raise RuntimeError("the warm-up of apply_delta changed the model")


def _numbered(folder: str) -> list[int]:
    return sorted(int(d) for d in os.listdir(folder) if re.fullmatch(r"\d+", d))


def read_delta(folder: str, served: Served) -> tuple[dict, dict]:
    """(manifest, feed for apply_delta) of one delta dir, checked against `served`.

    Raises:
        DeltaError: a missing or corrupt file, another model's delta, wrong shapes.
    """
    import tensorflow as tf

    try:
        with open(os.path.join(folder, "manifest.json"), "rb") as f:
            manifest = json.loads(f.read())
        if manifest.get("structure_sha256") != served.fingerprint:
            raise DeltaError("written for another model (structure fingerprint differs)")
        spec = served.module.apply_delta.structured_input_signature[0][0]
        feed = {"step": tf.constant(int(manifest["step"]), tf.int64)}
        arrays = {}
        for name, digest in manifest["files"].items():
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != digest:
                raise DeltaError(f"{name}: contents do not match the manifest's hash")
            if name.endswith(".npy"):
                arrays[name] = np.load(io.BytesIO(data))
                continue
            with np.load(io.BytesIO(data)) as npz:
                arrays[name] = {k: npz[k] for k in npz.files}
        feed["dense"] = tf.constant(arrays["dense.npy"], tf.float32)
        for key, tensor_spec in spec.items():
            if key in ("step", "dense"):
                continue
            table, _, part = key.rpartition("/")
            data = arrays.get(f"{table}.npz")
            if data is None:
                raise DeltaError(f"{table}.npz: missing")
            value = data["keys" if part == "ids" else part]
            if not tensor_spec.shape.is_compatible_with(value.shape):
                raise DeltaError(f"{table}.npz: {part} has shape {value.shape}, expected {tensor_spec.shape}")
            feed[key] = tf.constant(value, tensor_spec.dtype)
        if int(feed["dense"].shape[0]) != int(manifest["dense"]["size"]):
            raise DeltaError("dense.npz: wrong size")
        return manifest, feed
    except DeltaError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:  # zip errors are ValueErrors
        raise DeltaError(f"unreadable: {type(exc).__name__}: {exc}") from exc


class ModelFollower:
    """Serves the newest export of `model_dir` and applies its deltas as they appear.

    Args:
        model_dir: a recflow model dir (`export/<version>/`, `deltas/<step>/`).
        poll_seconds: how often the model dir is scanned.
    """

    def __init__(self, model_dir: str, poll_seconds: float = 0.2):
        self.model_dir = model_dir
        self.poll_seconds = poll_seconds
        self.served: Served | None = None
        self.retired: list[tuple[float, Served]] = []  # (when swapped out, the export)
        self.observe: Callable[[str, float], None] = lambda what, seconds: None  # "load", "apply"
        self.loads = 0
        self.deltas_applied = 0
        self.delta_failures = 0
        self._bad: dict[str, float] = {}  # delta dir -> mtime of its manifest when it failed
        self._manifests: dict[str, tuple[float, dict]] = {}
        self._said: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ scanning

    def _once(self, message: str, *args) -> None:
        text = message % args
        if text not in self._said:
            self._said.add(text)
            logger.error(text)

    def poll(self) -> None:
        """One scan: load a newer export, then apply every delta that is ready."""
        try:
            exports = _numbered(Layout(self.model_dir).export_dir)
        except OSError as exc:
            self._once("%s: cannot read its exports (%s); serving the last good state", self.model_dir, exc)
            return
        served = self.served
        if exports and (served is None or exports[-1] > served.version):
            self._load(exports[-1])
        while self.served is not None and self._apply_next(exports):
            pass
        self._release_retired()

    def _load(self, version: int) -> bool:
        path = Layout(self.model_dir).export(version)
        start = time.perf_counter()
        try:
            served = load_export(path)
            warm_up(served)
        except Exception as exc:  # noqa: BLE001 - any unreadable export keeps the old one
            self._once("%s: cannot load (%s); serving the last good state", path, exc)
            return False
        self.observe("load", time.perf_counter() - start)
        if self.served is not None:
            self.retired.append((time.monotonic(), self.served))
        self.served = served  # the swap: requests holding the old one finish on it
        self.loads += 1
        logger.info("serving %s (step %d)", path, served.step)
        return True

    def _release_retired(self) -> None:
        """Drops exports swapped out a second ago or more, once no request is inside
        them (the write lock waits for the last one), and collects them here: a loaded
        SavedModel is cyclic garbage, and a collection on a request's thread stalls it."""
        now = time.monotonic()
        due = [old for swapped, old in self.retired if now - swapped >= RETIRE_SECONDS]
        if not due:
            return
        self.retired = [(t, old) for t, old in self.retired if now - t < RETIRE_SECONDS]
        for old in due:
            old.lock.acquire_write()
            old.lock.release_write()
        del due, old
        gc.collect()

    def _manifest(self, folder: str) -> dict | None:
        path = os.path.join(folder, "manifest.json")
        try:
            mtime = os.stat(path).st_mtime
            cached = self._manifests.get(folder)
            if cached and cached[0] == mtime:
                return cached[1]
            with open(path, encoding="utf-8") as f:
                manifest = json.load(f)
            int(manifest["step"]), int(manifest["since_step"]), int(manifest.get("sequence", -1))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._manifests[folder] = (mtime, manifest)
        return manifest

    def _apply_next(self, exports: list[int]) -> bool:
        """Applies the next delta of the chain if it is there; True when one was applied."""
        served = self.served
        deltas_dir = Layout(self.model_dir).deltas_dir
        try:
            steps = [s for s in _numbered(deltas_dir) if s > served.step]
        except OSError:
            return False  # no deltas (yet), or the model dir is gone: nothing to apply
        if not steps or not hasattr(served.module, "apply_delta"):
            return False
        chain = []
        for step in steps:
            manifest = self._manifest(os.path.join(deltas_dir, str(step)))
            if manifest is not None:
                chain.append((step, manifest))
        if served.sequence is None:
            fits = [(s, m) for s, m in chain if m["since_step"] <= served.step]
        else:
            fits = [(s, m) for s, m in chain
                    if m.get("sequence") == served.sequence + 1 and m["since_step"] == served.step]
        if not fits:
            if chain and (served.sequence is not None or (exports and exports[-1] > served.version)):
                # A gap, or a chain that restarted: start again from the newest export.
                logger.warning("%s: no delta follows step %d; loading the newest export",
                               deltas_dir, served.step)
                return self._load(exports[-1]) if exports else False
            return False
        step, manifest = fits[0]
        folder = os.path.join(deltas_dir, str(step))
        if folder in self._bad and self._bad[folder] == self._manifests[folder][0]:
            return False
        try:
            manifest, feed = read_delta(folder, served)  # outside the lock: files, hashes, tensors
            served.lock.acquire_write()
            start = time.perf_counter()
            try:
                served.module.apply_delta(feed)
            finally:
                served.lock.release_write()
                self.observe("apply", time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - a bad delta never stops serving
            self._bad[folder] = self._manifests[folder][0]
            self.delta_failures += 1
            logger.error("%s: not applied (%s); serving step %d", folder, exc, served.step)
            return False
        served.step = int(manifest["step"])
        served.sequence = manifest.get("sequence")
        served.delta_written_at = manifest.get("written_at")
        self.deltas_applied += 1
        return True

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        def loop():
            while not self._stop.is_set():
                try:
                    self.poll()
                except Exception:  # noqa: BLE001 - the follower must outlive any surprise
                    logger.exception("%s: scan failed", self.model_dir)
                self._stop.wait(self.poll_seconds)

        self._thread = threading.Thread(target=loop, name="recflow-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
