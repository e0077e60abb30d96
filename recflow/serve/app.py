"""The REST app: TF Serving's predict / status / metadata API, health and metrics.

Each `:predict` request is parsed, checked and run in a worker thread, as one
call of the signature it names (`signature_name`, by default `serving_default`;
no micro-batching: see docs/serving.md for the measurement). Nothing here
changes the model.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from recflow.errors import op_reason
from recflow.serve.state import DEFAULT_SIGNATURE, ModelFollower

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a larger request gets 413 (100k CSV-like rows take ~10 MB)
_PATH = re.compile(r"^(?P<name>[^/:]+)(?:/versions/(?P<version>\d+))?(?P<verb>:predict|/metadata)?$")
_DTYPES = {"int64": "DT_INT64", "float32": "DT_FLOAT", "string": "DT_STRING"}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _column(values: list, name: str, dtype, where) -> np.ndarray:
    """One feature's values as a numpy column of the signature's dtype; 400 naming the
    first bad value (`where(i)` names its place in the request)."""
    kind = dtype.name
    if kind == "string":
        bad = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
        if bad is not None:
            raise BadRequest(f"{where(bad)}: expected a string, got {json.dumps(values[bad])}")
        return np.array(values, dtype=object)
    if kind == "int64":
        bad = next((i for i, v in enumerate(values)
                    if isinstance(v, bool) or not isinstance(v, int) or not -2**63 <= v < 2**63), None)
        if bad is not None:
            raise BadRequest(f"{where(bad)}: expected an integer, got {json.dumps(values[bad])}")
        return np.array(values, dtype=np.int64)
    # float32: numbers; null is a missing value (the feature's default).
    bad = next((i for i, v in enumerate(values)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))), None)
    if bad is not None:
        raise BadRequest(f"{where(bad)}: expected a number, got {json.dumps(values[bad])}")
    return np.array([math.nan if v is None else v for v in values], dtype=np.float32)


def parse_request(body: bytes, signatures: dict) -> tuple[str, dict, bool]:
    """(signature name, feed: feature name -> numpy column, row format?) from a predict
    request body; `signatures`: the served model's, by name."""
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"body: not JSON ({exc})") from None
    if not isinstance(request, dict) or ("instances" in request) == ("inputs" in request):
        raise BadRequest("body: expected an object with either `instances` or `inputs`")
    name = request.get("signature_name") or DEFAULT_SIGNATURE  # TF Serving: "" is the default
    if not isinstance(name, str) or name not in signatures:
        known = ", ".join(sorted(signatures))
        raise BadRequest(f"signature_name: no signature {json.dumps(name)} (this model has: {known})")
    return name, *_feed(request, signatures[name].structured_input_signature[1])


def _feed(request: dict, specs: dict) -> tuple[dict, bool]:
    """(feed, row format?) of a request's `instances` or `inputs` for a signature's specs."""
    if "instances" in request:
        rows = request["instances"]
        if not isinstance(rows, list):
            raise BadRequest("instances: expected a list of rows")
        if not rows:
            raise BadRequest("instances: empty batch")
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise BadRequest(f"instances[{bad}]: expected an object of feature values")
        feed = {}
        for name, spec in specs.items():
            missing = next((i for i, r in enumerate(rows) if name not in r), None)
            if missing is not None:
                raise BadRequest(f"instances[{missing}].{name}: missing feature")
            values = [r[name] for r in rows]
            feed[name] = _column(values, name, spec.dtype, lambda i, n=name: f"instances[{i}].{n}")
        return feed, True
    columns = request["inputs"]
    if not isinstance(columns, dict):
        raise BadRequest("inputs: expected an object of feature columns")
    feed, size = {}, None
    for name, spec in specs.items():
        if name not in columns:
            raise BadRequest(f"inputs.{name}: missing feature")
        values = columns[name]
        if not isinstance(values, list):
            raise BadRequest(f"inputs.{name}: expected a list of values")
        if not values:
            raise BadRequest(f"inputs.{name}: empty batch")
        if size is not None and len(values) != size:
            raise BadRequest(f"inputs.{name}: {len(values)} values, other features have {size}")
        size = len(values)
        feed[name] = _column(values, name, spec.dtype, lambda i, n=name: f"inputs.{n}[{i}]")
    return feed, False


def answer(body: bytes, served) -> str:
    """The JSON answer to a predict request body, run on `served` (a `state.Served`).

    Raises:
        BadRequest: the request is malformed, or holds a value the model's own parsing
            refuses (an `InvalidArgumentError` of the signature: its inputs are all it
            varies on, e.g. `"1|x"` in an int64 multi_hot), as TF Serving answers 400.
    """
    import tensorflow as tf

    name, feed, rows = parse_request(body, served.signatures)
    try:
        out = served.predict(feed, name)
    except tf.errors.InvalidArgumentError as exc:
        raise BadRequest(f"{name}: the model refused an input value: {op_reason(exc.message)}") from None
    return json.dumps(_response(out, rows))


def _response(out: dict, rows: bool) -> dict:
    if rows:
        if len(out) == 1:
            return {"predictions": next(iter(out.values())).tolist()}
        n = len(next(iter(out.values())))
        return {"predictions": [{k: v[i].tolist() for k, v in out.items()} for i in range(n)]}
    if len(out) == 1:
        return {"outputs": next(iter(out.values())).tolist()}
    return {"outputs": {k: v.tolist() for k, v in out.items()}}


def _tensor_info(spec, name: str) -> dict:
    dims = [{"size": str(-1 if d is None else d), "name": ""} for d in spec.shape.as_list()]
    return {"dtype": _DTYPES.get(spec.dtype.name, spec.dtype.name),
            "tensor_shape": {"dim": dims, "unknown_rank": False}, "name": name}


def build_app(follower: ModelFollower, model_name: str) -> Starlette:
    """The Starlette app serving `follower`'s model under `model_name`."""
    registry = CollectorRegistry()
    requests = Counter("recflow_serve_requests", "HTTP requests", ["endpoint", "code"], registry=registry)
    latency = Histogram("recflow_serve_request_seconds", "predict latency", registry=registry,
                        buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
    Gauge("recflow_serve_model_step", "the step the served model is at", registry=registry).set_function(
        lambda: follower.served.step if follower.served else -1)
    Gauge("recflow_serve_model_version", "the served export version", registry=registry).set_function(
        lambda: follower.served.version if follower.served else -1)
    Gauge("recflow_serve_delta_lag_seconds", "now minus the newest applied delta's write time",
          registry=registry).set_function(_lag(follower))
    Gauge("recflow_serve_deltas_applied", "deltas applied in place", registry=registry).set_function(
        lambda: follower.deltas_applied)
    Gauge("recflow_serve_delta_failures", "deltas refused (corrupt, another model)",
          registry=registry).set_function(lambda: follower.delta_failures)
    Gauge("recflow_serve_model_loads", "exports loaded", registry=registry).set_function(
        lambda: follower.loads)
    timings = {
        "apply": Histogram("recflow_serve_delta_apply_seconds", "write-lock hold of one delta's apply_delta",
                           registry=registry, buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2)),
        "load": Histogram("recflow_serve_export_load_seconds", "loading and warming up an export before its swap",
                          registry=registry, buckets=(.1, .2, .5, 1, 2, 5, 10, 30)),
    }
    follower.observe = lambda what, seconds: timings[what].observe(seconds)

    def error(status: int, message: str, endpoint: str) -> JSONResponse:
        requests.labels(endpoint, str(status)).inc()
        return JSONResponse({"error": message}, status_code=status)

    def resolve(path: str, endpoint: str):
        match = _PATH.match(path)
        if not match or match["name"] != model_name:
            return None, error(404, f"no model at /v1/models/{path}; this server serves `{model_name}`", endpoint)
        served = follower.served
        if served is None:
            return None, error(503, f"model `{model_name}` has no export loaded yet", endpoint)
        if match["version"] is not None and int(match["version"]) != served.version:
            return None, error(404, f"version {match['version']} is not served; version {served.version} is", endpoint)
        return (match, served), None

    async def models(request: Request):
        path = request.path_params["path"]
        match = _PATH.match(path)
        if request.method == "POST":
            if match is None or match["verb"] != ":predict":
                return error(404, f"POST /v1/models/{path}: only `:predict` takes a POST", "predict")
            return await predict(request, path)
        found, failure = resolve(path, "status")
        if failure:
            return failure
        match, served = found
        if match["verb"] == "/metadata":
            requests.labels("metadata", "200").inc()
            return JSONResponse({
                "model_spec": {"name": model_name, "signature_name": "", "version": str(served.version)},
                "metadata": {"signature_def": {"signature_def": {
                    name: {
                        "inputs": {k: _tensor_info(s, k) for k, s in fn.structured_input_signature[1].items()},
                        "outputs": {k: _tensor_info(s, k) for k, s in fn.structured_outputs.items()},
                        "method_name": "tensorflow/serving/predict",
                    }
                    for name, fn in sorted(served.signatures.items())
                }}},
                "recflow": {"step": served.step, "delta_sequence": served.sequence},
            })
        if match["verb"] is not None:
            return error(404, f"GET /v1/models/{path}: use POST for :predict", "status")
        requests.labels("status", "200").inc()
        return JSONResponse({"model_version_status": [{
            "version": str(served.version), "state": "AVAILABLE",
            "status": {"error_code": "OK", "error_message": ""},
        }]})

    async def predict(request: Request, path: str):
        start = time.perf_counter()
        found, failure = resolve(path, "predict")
        if failure:
            return failure
        _, served = found
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return error(413, f"body: {length} bytes, more than {MAX_BODY_BYTES}", "predict")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return error(413, f"body: more than {MAX_BODY_BYTES} bytes", "predict")

        try:
            text = await run_in_threadpool(answer, body, served)
        except BadRequest as exc:
            return error(exc.status, str(exc), "predict")
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the server
            logger.exception("predict failed")
            return error(500, f"{type(exc).__name__}: {exc}", "predict")
        latency.observe(time.perf_counter() - start)
        requests.labels("predict", "200").inc()
        return Response(text, media_type="application/json")

    async def healthz(request: Request):
        served = follower.served
        if served is None:
            return JSONResponse({"status": "waiting for an export"}, status_code=503)
        return JSONResponse({"status": "ok", "version": served.version, "step": served.step,
                             "delta_sequence": served.sequence})

    async def metrics(request: Request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[
        Route("/v1/models/{path:path}", models, methods=["GET", "POST"]),
        Route("/healthz", healthz),
        Route("/metrics", metrics),
    ])


def _lag(follower: ModelFollower):
    def lag() -> float:
        served = follower.served
        if served is None or served.delta_written_at is None:
            return math.nan
        return time.time() - served.delta_written_at

    return lag
