"""Serving that stays fresh: deltas (evicted ids, dense weights, sequence), `apply_delta`
in plain TensorFlow, and the `recflow serve` REST server as a real process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import procs
import pytest
import yaml
from conftest import fingerprint_ids

from recflow.cli import main
from recflow.data.writer import write_columns

BATCH, STEPS, TTL = 8, 12, 3
EVERY = 2  # checkpoint (eviction), delta and export every 2 steps


def raw_rows():
    """Step s (1-based) sees items i{2s}..i{2s+3}: new ids every step, old ones go stale."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    step = np.arange(n) // BATCH + 1
    return {
        "click": rng.integers(0, 2, n),
        "user": rng.integers(0, 12, n).astype(np.int64),
        "item": np.array([f"i{2 * s + k}" for s, k in zip(step, rng.integers(0, 4, n))], dtype=object),
        "price": rng.random(n).astype(np.float32) * 10,
    }


def write_config(tmp, model_dir, steps=STEPS):
    config = {
        "version": 1,
        "data": {"format": "csv", "train": str(tmp / "train.csv"), "label": "click",
                 "batch_size": BATCH, "shuffle": False},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "table": "u"},
            {"name": "item", "kind": "categorical", "dtype": "string", "table": "i"},
            {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        ],
        "tables": {"u": {"dim": 4}, "i": {"dim": 4, "eviction": {"ttl_steps": TTL}}},
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [8]}}},
        "train": {"model_dir": str(model_dir), "steps": steps, "checkpoint_every_steps": EVERY, "evaluate": False,
                  "optimizer": {"type": "adam", "learning_rate": 0.05}},
        "export": {"delta_every_steps": EVERY, "every_steps": EVERY},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def string_ids(values):
    """The ids recflow gives strings: their 64-bit fingerprints (worked out without recflow)."""
    return set(fingerprint_ids(sorted(set(values))))


def evicted_by_hand(rows):
    """{checkpoint step: items evicted there}: ttl eviction at every checkpoint (DESIGN 7)."""
    step = np.arange(len(rows["item"])) // BATCH + 1
    last, out = {}, {}
    for s in range(1, STEPS + 1):
        for item in rows["item"][step == s]:
            last[item] = s
        if s % EVERY == 0:
            out[s] = {k for k, v in last.items() if v <= s - TTL}
            last = {k: v for k, v in last.items() if v > s - TTL}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    rows = raw_rows()
    write_columns(str(tmp / "train.csv"), rows, "csv", labels=["click"])
    model_dir = tmp / "run"
    assert main(["train", write_config(tmp, model_dir), "--quiet"]) == 0
    return tmp, rows, model_dir


def manifest(model_dir, step):
    return json.loads((model_dir / "deltas" / str(step) / "manifest.json").read_text())


def test_deltas_carry_evictions_dense_weights_and_a_sequence(trained):
    _, rows, model_dir = trained
    steps = sorted(int(d) for d in os.listdir(model_dir / "deltas"))
    assert steps == list(range(EVERY, STEPS + 1, EVERY))
    structure = json.loads((model_dir / "export" / str(STEPS) / "assets.extra" / "structure.json").read_text())
    import hashlib

    fingerprint = hashlib.sha256(
        json.dumps(structure, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    evicted = evicted_by_hand(rows)
    for n, step in enumerate(steps, start=1):
        m = manifest(model_dir, step)
        assert (m["sequence"], m["step"], m["since_step"]) == (n, step, step - EVERY)
        assert m["structure_sha256"] == fingerprint
        with np.load(model_dir / "deltas" / str(step) / "i.npz") as data:
            assert set(data["evicted"].tolist()) == string_ids(evicted[step])
            assert not set(data["evicted"].tolist()) & set(data["keys"].tolist())
        with np.load(model_dir / "deltas" / str(step) / "u.npz") as data:
            assert data["evicted"].size == 0
        assert np.load(model_dir / "deltas" / str(step) / "dense.npy").size == m["dense"]["size"]
        assert m["dense"]["size"] == sum(int(np.prod(s)) for _, s in m["dense"]["variables"])
    assert any(evicted[s] for s in steps[2:])  # the check above saw evictions


def test_evicted_ids_survive_a_restart_before_the_next_delta(trained, tmp_path):
    base, rows, _ = trained
    # Eviction at every checkpoint (2, 4, 6, 8), deltas every 4: stop at 6, resume to 8.
    cut = tmp_path / "cut"
    config = write_config(tmp_path, cut, steps=6)
    (tmp_path / "train.csv").write_bytes((base / "train.csv").read_bytes())
    sets = ["--set", "export.delta_every_steps=4", "--set", "export.every_steps=null"]
    assert main(["train", config, "--quiet", *sets]) == 0
    assert sorted(os.listdir(cut / "deltas")) == ["4"]
    assert main(["train", config, "--quiet", *sets, "--set", "train.steps=8"]) == 0
    evicted = evicted_by_hand(rows)
    assert evicted[6] and evicted[6] != evicted[8]  # evicted before the restart
    for step, expected in ((4, evicted[2] | evicted[4]), (8, evicted[6] | evicted[8])):
        with np.load(cut / "deltas" / str(step) / "i.npz") as data:
            assert sorted(data["evicted"].tolist()) == sorted(string_ids(expected))
        assert manifest(cut, step)["sequence"] == step // 4


# Applies deltas with plain TensorFlow and numpy, as any serving runtime would.
APPLY_WITHOUT_RECFLOW = Path(__file__).parent / "scripts" / "apply_deltas_without_recflow.py"


def held_out_rows(rows):
    """Every user and item of training (so ids first seen late and ids evicted), unseen ones."""
    rng = np.random.default_rng(1)
    items = sorted(set(rows["item"])) + ["never-seen", "i999"]
    users = list(range(14))  # 12, 13 never seen
    n = 3 * len(items)
    return {
        "user": np.array([users[k % len(users)] for k in range(n)], np.int64),
        "item": np.array([items[k % len(items)] for k in rng.permutation(n)], dtype=object),
        "price": rng.random(n).astype(np.float32) * 10,
    }


@pytest.mark.parametrize("start", [4, 8])
def test_deltas_applied_to_an_export_match_the_full_export(trained, tmp_path, start):
    _, rows, model_dir = trained
    held = held_out_rows(rows)
    np.savez(tmp_path / "rows.npz", **held)
    subprocess.run([sys.executable, str(APPLY_WITHOUT_RECFLOW), str(model_dir), str(start),
                    str(tmp_path / "rows.npz"), str(tmp_path / "out.npz")], check=True)
    out = np.load(tmp_path / "out.npz")
    assert int(out["step"]) == STEPS
    assert np.max(np.abs(out["applied"] - out["full"])) <= 1e-6
    assert np.max(np.abs(out["before"] - out["full"])) > 1e-4  # the deltas changed something
    # Items trained after `start` and items evicted after it are among the held-out rows.
    step = np.arange(len(rows["item"])) // BATCH + 1
    assert set(rows["item"][step > start]) - set(rows["item"][step <= start]) <= set(held["item"])
    evicted = set().union(*(v for s, v in evicted_by_hand(rows).items() if s > start))
    assert evicted and evicted <= set(held["item"])


def test_the_last_steps_delta_and_export_hold_the_same_rows(trained, tmp_path):
    """The run ends at step 12, a delta step but no checkpoint step: the final checkpoint
    must not evict after the delta (the chain to 12 held the rows evicted there, the
    export at 12 did not)."""
    base, rows, _ = trained
    (tmp_path / "train.csv").write_bytes((base / "train.csv").read_bytes())
    model_dir = tmp_path / "run"
    sets = ["--set", "train.checkpoint_every_steps=5", "--set", "export.every_steps=5"]
    assert main(["train", write_config(tmp_path, model_dir), "--quiet", *sets]) == 0
    assert sorted(os.listdir(model_dir / "export"), key=int) == ["5", "10", "12"] and (model_dir / "deltas" / "12").is_dir()
    # Items last seen at step 9 are stale (ttl 3) at 12: the final checkpoint would evict them.
    step = np.arange(len(rows["item"])) // BATCH + 1
    stale = {i for i in set(rows["item"]) if step[rows["item"] == i].max() <= STEPS - TTL}
    assert stale - {i for i in set(rows["item"]) if step[rows["item"] == i].max() <= 10 - TTL}
    held = held_out_rows(rows)
    np.savez(tmp_path / "rows.npz", **held)
    subprocess.run([sys.executable, str(APPLY_WITHOUT_RECFLOW), str(model_dir), "10",
                    str(tmp_path / "rows.npz"), str(tmp_path / "out.npz")], check=True)
    out = np.load(tmp_path / "out.npz")
    assert int(out["step"]) == STEPS
    assert np.max(np.abs(out["applied"] - out["full"])) <= 1e-6


@pytest.mark.parametrize("every", [None, 4])
def test_a_delta_written_by_hand_continues_the_chain(trained, tmp_path, every):
    """`recflow export --delta` writes a delta from a checkpoint without saving another:
    the resumed run's next delta started again from the checkpoint's (two deltas of one
    sequence number; without a schedule each was a full dump since step 0)."""
    base, _, _ = trained
    (tmp_path / "train.csv").write_bytes((base / "train.csv").read_bytes())
    model_dir = tmp_path / "run"
    config = write_config(tmp_path, model_dir, steps=6)
    sets = ["--set", f"export.delta_every_steps={'null' if every is None else every}",
            "--set", "export.every_steps=null", "--set", "train.checkpoint_every_steps=null"]
    assert main(["train", config, "--quiet", *sets]) == 0
    assert main(["export", config, "--delta", *sets]) == 0
    assert main(["train", config, "--quiet", *sets, "--set", "train.steps=12"]) == 0
    assert main(["export", config, "--delta", *sets]) == 0
    chain = [(m["step"], m["since_step"], m["sequence"])
             for m in (manifest(model_dir, s) for s in sorted(int(d) for d in os.listdir(model_dir / "deltas")))]
    if every is None:
        assert chain == [(6, 0, 1), (12, 6, 2)]
    else:
        assert chain == [(4, 0, 1), (6, 4, 2), (8, 6, 3), (12, 8, 4)]


def test_a_malformed_delta_is_refused_and_changes_nothing(trained):
    """`apply_delta` checks every table's lengths before its first write: a delta whose
    values and ids differ in length for one table fails naming it, and the export's
    rows, weights and step stay as they were."""
    import tensorflow as tf

    _, rows, model_dir = trained
    model = tf.saved_model.load(str(model_dir / "export" / "4"))
    serve = model.signatures["serving_default"]
    held = held_out_rows(rows)
    feed = {"user": tf.constant(held["user"]), "item": tf.constant(held["item"].tolist()),
            "price": tf.constant(held["price"])}  # fmt: skip
    before = serve(**feed)["probability"].numpy()
    folder = model_dir / "deltas" / "6"
    delta = {"step": tf.constant(6, tf.int64), "dense": tf.constant(np.load(folder / "dense.npy"))}
    for table in manifest(model_dir, 6)["tables"]:
        with np.load(folder / f"{table}.npz") as data:
            values = data["values"][:-1] if table == "i" else data["values"]  # one row short
            delta.update({f"{table}/ids": tf.constant(data["keys"]), f"{table}/values": tf.constant(values),
                          f"{table}/evicted": tf.constant(data["evicted"])})  # fmt: skip
    assert len(np.load(folder / "i.npz")["keys"]) > 0
    with pytest.raises(tf.errors.InvalidArgumentError, match="i: values and ids differ in length"):
        model.apply_delta(delta)
    assert int(model.global_step) == 4
    np.testing.assert_array_equal(serve(**feed)["probability"].numpy(), before)


def test_a_request_runs_the_signature_it_names(tmp_path):
    """A retrieval export's `candidate` signature takes the candidate side's columns only:
    `signature_name` picks it (every request ran `serving_default`, the query side)."""
    import tensorflow as tf

    from recflow.serve.app import BadRequest, answer, parse_request
    from recflow.serve.state import Served

    query = tf.function(lambda user: {"embedding": tf.cast(user[:, None], tf.float32) * [1.0, 0.0]},
                        input_signature=[tf.TensorSpec([None], tf.int64, name="user")]).get_concrete_function()
    candidate = tf.function(lambda item: {"embedding": tf.strings.to_number(item)[:, None] * [0.0, 1.0]},
                            input_signature=[tf.TensorSpec([None], tf.string, name="item")]).get_concrete_function()
    signatures = {"serving_default": query, "query": query, "candidate": candidate}
    tf.saved_model.save(tf.Module(), str(tmp_path / "export"), signatures=signatures)
    loaded = tf.saved_model.load(str(tmp_path / "export"))  # signatures take keyword inputs
    served = Served(7, "", loaded, dict(loaded.signatures), "")
    name, feed, rows = parse_request(json.dumps({"signature_name": "candidate", "instances": [{"item": "2"}]}).encode(),
                                     served.signatures)
    assert (name, rows) == ("candidate", True)
    np.testing.assert_array_equal(served.predict(feed, name)["embedding"], [[0.0, 2.0]])
    name, feed, _ = parse_request(json.dumps({"inputs": {"user": [3]}}).encode(), served.signatures)
    np.testing.assert_array_equal(served.predict(feed, name)["embedding"], [[3.0, 0.0]])
    with pytest.raises(BadRequest, match=r"instances\[0\]\.user: missing feature"):
        parse_request(json.dumps({"signature_name": "query", "instances": [{"item": "2"}]}).encode(), served.signatures)
    with pytest.raises(BadRequest, match='no signature "nope" \\(this model has: candidate, query, serving_default\\)'):
        parse_request(json.dumps({"signature_name": "nope", "instances": [{"item": "2"}]}).encode(), served.signatures)
    # A value the signature's own parsing refuses is the request's fault: 400 naming it, not 500.
    body = json.dumps({"signature_name": "candidate", "instances": [{"item": "2"}, {"item": "x7"}]}).encode()
    with pytest.raises(BadRequest) as refused:
        answer(body, served)
    assert str(refused.value) == ("candidate: the model refused an input value: "
                                  "StringToNumberOp could not correctly convert string: x7")
    assert json.loads(answer(body.replace(b"x7", b"5"), served)) == {"predictions": [[0.0, 2.0], [0.0, 5.0]]}


# ----------------------------------------------------------------------------- the server

def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port, path, body=None):
    """(status, parsed JSON or text) of one request to the server."""
    import urllib.error
    import urllib.request

    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def wait_for(port, condition, what, seconds=90, path="/healthz"):
    """Polls `path` until `condition(body)`; fails (no hang) after `seconds`."""
    import time

    end = time.monotonic() + seconds
    body = None
    while time.monotonic() < end:
        try:
            status, body = http(port, path)
            if status == 200 and condition(body):
                return body
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"server never reached: {what} (last {path}: {body})")


def start_server(model_dir, port, log):
    return procs.Popen(
        [sys.executable, "-m", "recflow.cli", "serve", str(model_dir), "--port", str(port),
         "--model-name", "m"],
        stdout=log, stderr=subprocess.STDOUT,
    )


def export_predictions(export_dir, rows):
    import tensorflow as tf

    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    out = serve(user=tf.constant(rows["user"]), item=tf.constant(rows["item"].tolist()),
                price=tf.constant(rows["price"]))
    return out["probability"].numpy().reshape(-1)


def instances(rows):
    return [{"user": int(u), "item": str(i), "price": float(p)}
            for u, i, p in zip(rows["user"], rows["item"], rows["price"])]


def served_predictions(port, rows):
    status, out = http(port, "/v1/models/m:predict", {"instances": instances(rows)})
    assert status == 200, out
    return np.array(out["predictions"]).reshape(-1)


class Watcher:
    """A client asking for `rows`' predictions in a loop on its own thread until `stop()`,
    which returns every answer (all must be 200)."""

    def __init__(self, port, rows):
        import threading

        self.answers, self.failures = [], []
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                status, out = http(port, "/v1/models/m:predict", {"instances": instances(rows)})
                if status == 200:
                    self.answers.append(np.array(out["predictions"]).reshape(-1))
                else:
                    self.failures.append((status, out))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        assert not self.failures, self.failures[:3]
        return self.answers


def copy_delta(src, dst, step=None, since=None, sequence=None, **manifest_changes):
    """Copies a delta dir, optionally renumbered (written to a temp dir, then renamed)."""
    import shutil

    tmp = dst.parent / f".tmp-{dst.name}"
    shutil.copytree(src, tmp)
    m = json.loads((tmp / "manifest.json").read_text())
    for key, value in (("step", step), ("since_step", since), ("sequence", sequence)):
        if value is not None:
            m[key] = value
    m.update(manifest_changes)
    (tmp / "manifest.json").write_text(json.dumps(m))
    os.replace(tmp, dst)


def test_server_follows_exports_and_deltas_and_survives_kill_9(trained, tmp_path):
    import shutil
    import signal

    _, rows, source = trained
    held = held_out_rows(rows)
    served = tmp_path / "shop"
    shutil.copytree(source / "export" / "4", served / "export" / "4")
    (served / "deltas").mkdir()
    port, log = free_port(), open(tmp_path / "server.log", "w")
    server = start_server(served, port, log)
    try:
        wait_for(port, lambda h: h["step"] == 4, "export 4 loaded")
        expected4 = export_predictions(source / "export" / "4", held)
        np.testing.assert_allclose(served_predictions(port, held), expected4, rtol=0, atol=1e-6)
        # TF Serving's status, metadata and columnar format; a pinned version.
        status, body = http(port, "/v1/models/m")
        assert status == 200 and body["model_version_status"][0]["version"] == "4"
        status, body = http(port, "/v1/models/m/metadata")
        inputs = body["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]
        assert status == 200 and inputs["user"]["dtype"] == "DT_INT64" and inputs["item"]["dtype"] == "DT_STRING"
        columns = {"user": held["user"].tolist(), "item": held["item"].tolist(), "price": held["price"].tolist()}
        status, body = http(port, "/v1/models/m/versions/4:predict", {"inputs": columns})
        assert status == 200
        np.testing.assert_allclose(np.array(body["outputs"]).reshape(-1), expected4, atol=1e-6)
        assert http(port, "/v1/models/m/versions/3:predict", {"inputs": columns})[0] == 404

        # Deltas 6 and 8 appear: applied in place, in order; the model equals export 8.
        # Meanwhile a client keeps asking: every answer is some full export's, never a mix.
        watcher = Watcher(port, held)
        for step in (6, 8):
            shutil.copytree(source / "deltas" / str(step), served / "deltas" / str(step))
        wait_for(port, lambda h: h["step"] == 8 and h["version"] == 4, "deltas 6, 8 applied")
        expected8 = export_predictions(source / "export" / "8", held)
        assert np.max(np.abs(expected8 - expected4)) > 1e-4
        np.testing.assert_allclose(served_predictions(port, held), expected8, rtol=0, atol=1e-6)

        # A new full export is swapped in; then kill -9 and a restart serve the same.
        shutil.copytree(source / "export" / "12", served / "export" / ".tmp-12")
        os.replace(served / "export" / ".tmp-12", served / "export" / "12")
        wait_for(port, lambda h: h["version"] == 12, "export 12 swapped in")
        expected12 = export_predictions(source / "export" / "12", held)
        np.testing.assert_allclose(served_predictions(port, held), expected12, rtol=0, atol=1e-6)
        answers = watcher.stop()
        steps = {s: export_predictions(source / "export" / str(s), held) for s in (4, 6, 8, 12)}
        matched = [[s for s, want in steps.items() if np.max(np.abs(got - want)) <= 1e-6] for got in answers]
        assert answers and all(matched), f"{sum(not m for m in matched)} of {len(answers)} answers match no export"
        assert matched[-1] == [12]
        server.send_signal(signal.SIGKILL)
        server.wait()
        server = start_server(served, port, log)
        wait_for(port, lambda h: h["version"] == 12, "restarted")
        np.testing.assert_allclose(served_predictions(port, held), expected12, rtol=0, atol=1e-6)

        # Bad deltas are logged and the last good state keeps serving.
        last = source / "deltas" / "12"
        copy_delta(last, served / "deltas" / "14", step=14, since=12, sequence=7)
        (served / "deltas" / "14" / "i.npz").write_bytes((last / "i.npz").read_bytes()[:100])  # truncated
        copy_delta(last, served / "deltas" / "15", step=15, since=12, sequence=7,
                   structure_sha256="0" * 64)  # another model's
        import time

        def refused_once(metrics):
            lines = [ln for ln in metrics.splitlines() if ln.startswith("recflow_serve_delta_failures ")]
            return lines == ["recflow_serve_delta_failures 1.0"]

        wait_for(port, refused_once, "delta 14 refused", path="/metrics")  # however slow the scan
        time.sleep(1.0)  # several more scans (every 0.2 s): 14 is not retried, 15 waits behind it
        status, metrics = http(port, "/metrics")
        assert status == 200 and refused_once(metrics)
        health = http(port, "/healthz")[1]
        assert (health["version"], health["step"]) == (12, 12)
        np.testing.assert_allclose(served_predictions(port, held), expected12, rtol=0, atol=1e-6)
        # The model dir vanishes: still serving.
        os.rename(served, tmp_path / "gone")
        time.sleep(0.5)
        np.testing.assert_allclose(served_predictions(port, held), expected12, rtol=0, atol=1e-6)
        assert http(port, "/healthz")[0] == 200
        assert 'recflow_serve_requests_total{code="200",endpoint="predict"}' in http(port, "/metrics")[1]
    finally:
        server.kill()
        server.wait()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "deltas/14: not applied" in text and "cannot read its exports" in text


def test_bad_requests_get_400_naming_the_field(trained, tmp_path):
    _, rows, source = trained
    port, log = free_port(), open(tmp_path / "server.log", "w")
    server = start_server(source, port, log)
    try:
        wait_for(port, lambda h: h["version"] == STEPS, "export loaded")
        good = {"user": 1, "item": "i3", "price": 2.5}
        cases = [
            ({"instances": [good, {"user": 1, "price": 1.0}]}, "instances[1].item: missing feature"),
            ({"instances": [{**good, "user": "abc"}]}, "instances[0].user: expected an integer"),
            ({"instances": [{**good, "item": 7}]}, "instances[0].item: expected a string"),
            ({"instances": [{**good, "price": "x"}]}, "instances[0].price: expected a number"),
            ({"instances": []}, "instances: empty batch"),
            ({"inputs": {"user": [1], "item": ["a"]}}, "inputs.price: missing feature"),
            ({"inputs": {"user": [1, 2], "item": ["a"], "price": [1.0, 2.0]}}, "inputs.item: 1 values"),
            (b"{not json", "body: not JSON"),
            ({"signature_name": "candidate", "instances": [good]},
             'signature_name: no signature "candidate" (this model has: serving_default)'),
        ]
        for body, message in cases:
            status, out = http(port, "/v1/models/m:predict", body)
            assert status == 400 and out["error"].startswith(message), (body, out)
        assert http(port, "/v1/models/other:predict", {"instances": [good]})[0] == 404
        for name in ("serving_default", ""):  # named, or TF Serving's empty default
            status, out = http(port, "/v1/models/m:predict", {"signature_name": name, "instances": [good]})
            assert status == 200 and len(out["predictions"]) == 1, out
        # 100k rows in one request are answered, equal to the export's own answer.
        n = 100_000
        big = {"user": np.arange(n, dtype=np.int64) % 20, "item": np.array([f"i{k % 40}" for k in range(n)], dtype=object),
               "price": (np.arange(n) % 7).astype(np.float32)}
        expected = export_predictions(source / "export" / str(STEPS), big)
        np.testing.assert_allclose(served_predictions(port, big), expected, rtol=0, atol=1e-6)
        assert http(port, "/healthz")[0] == 200  # still serving after every bad request
    finally:
        server.kill()
        server.wait()
        log.close()
