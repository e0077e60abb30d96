"""Freshness and serving latency of `recflow serve` following `recflow train --follow`.

End to end, on loopback, in one soak run:

- a producer writes a CSV file of old item ids into a followed folder every
  `--file-seconds`; `recflow train --follow` trains them with a delta every
  `--delta-seconds` (`export.delta_every_seconds`) and a full export every
  `--export-seconds` (`export.every_seconds`);
- `recflow serve` serves that model dir (deltas applied in place, exports hot
  swapped), and a second `recflow serve` serves a frozen copy of the first export
  (no deltas, no swaps): the baseline;
- on each server, under the same training load and at the same time, one client
  sends batch-1 requests and one batch-256 requests, paced (`--rate-1`,
  `--rate-256` per second), on persistent connections: latency p50/p99 of each;
- every `--fresh-every` seconds a file with one new item id is written, and a
  client polls the live server for that id (beside a never-seen id, in one
  request) until its prediction differs from the default row's: freshness = that
  time minus the time the file was written;
- the soak ends once the live server has applied `--deltas` deltas and swapped in
  `--swaps` exports (or after `--max-seconds`); then the live server's throughput
  at batch 1 with 1 and 16 concurrent clients (training and deltas go on).

Every non-200 answer and every broken connection is a failed request (a client
reopens a connection idle for 4 s, as a pooling client does: uvicorn closes
keep-alive connections idle for 5 s).

    python scripts/bench_freshness.py [--deltas 200] [--swaps 20] [--max-seconds 600]

Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import yaml
from _bench_common import emit_json  # noqa: F401  (Keras 2 before TF)

BATCH = 32
PREDICT = "/v1/models/m:predict"
IDLE_SECONDS = 4.0  # a connection idle this long is reopened: uvicorn closes one idle for 5 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAILURES: collections.Counter = collections.Counter()  # why requests failed, over all clients


class Client:
    """One persistent connection; counts failures (and their reasons in FAILURES)."""

    def __init__(self, port: int):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.failed = 0
        self.last = time.monotonic()

    def call(self, method: str, path: str, body: bytes | None = None) -> bytes | None:
        if time.monotonic() - self.last > IDLE_SECONDS:  # as a pooling client does
            self.conn.close()
        self.last = time.monotonic()
        try:
            self.conn.request(method, path, body, {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            text = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.failed += 1
            FAILURES[f"{type(exc).__name__}: {exc}"] += 1
            self.conn.close()
            return None
        if response.status != 200:
            self.failed += 1
            FAILURES[f"HTTP {response.status}: {text[:200].decode(errors='replace')}"] += 1
            return None
        return text


def rows(n: int, rng, new_item: str | None = None) -> list[dict]:
    out = []
    for k in range(n):
        item = new_item if new_item and k % 2 == 0 else f"old{rng.integers(0, 200)}"
        out.append({"user": int(rng.integers(0, 100)), "item": item, "price": float(rng.random() * 9)})
    return out


def body(batch: list[dict]) -> bytes:
    return json.dumps({"instances": batch}).encode()


def write_file(folder: str, name: str, batch: list[dict], rng) -> None:
    tmp = os.path.join(folder, f".{name}")
    with open(tmp, "w") as f:
        f.write("click,user,item,price\n")
        for r in batch:
            click = 1 if r["item"].startswith("new") else int(rng.integers(0, 2))
            f.write(f"{click},{r['user']},{r['item']},{r['price']:.3f}\n")
    os.replace(tmp, os.path.join(folder, name))


def wait_ready(port: int, seconds: float = 180) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/healthz")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server on {port} never became ready")


def paced(port: int, payload: bytes, rate: float, stop: threading.Event, times: list, failed: list) -> None:
    """Sends `payload` `rate` times a second (or as fast as answers come) until `stop`."""
    client, interval = Client(port), 1.0 / rate
    due = time.perf_counter()
    while not stop.is_set():
        t = time.perf_counter()
        client.call("POST", PREDICT, payload)
        times.append(time.perf_counter() - t)
        due = max(due + interval, time.perf_counter())
        stop.wait(due - time.perf_counter())
    failed.append(client.failed)


def throughput(port: int, payload: bytes, clients: int, seconds: float) -> tuple[float, int]:
    done, failed = [0] * clients, [0] * clients

    def work(i):
        client = Client(port)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            client.call("POST", PREDICT, payload)
            done[i] += 1
        failed[i] = client.failed

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / seconds, sum(failed)


def metrics(port: int) -> dict[str, float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def histogram(m: dict, name: str) -> dict:
    """Mean and the smallest bucket bound holding every observation of a Prometheus histogram."""
    count = m.get(f"{name}_count", 0.0)
    bounds = sorted((float(k.split('le="')[1].rstrip('"}')), v) for k, v in m.items()
                    if k.startswith(f"{name}_bucket") and "+Inf" not in k)
    top = next((b for b, v in bounds if v >= count), float("inf"))
    return {"n": int(count), "mean_ms": 1000 * m.get(f"{name}_sum", 0.0) / count if count else float("nan"),
            "max_below_ms": 1000 * top}


def pct(values, q) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deltas", type=int, default=200, help="applied deltas the soak waits for")
    parser.add_argument("--swaps", type=int, default=20, help="hot-swapped exports the soak waits for")
    parser.add_argument("--max-seconds", type=float, default=600, help="the soak ends here at the latest")
    parser.add_argument("--delta-seconds", type=float, default=2.0)
    parser.add_argument("--export-seconds", type=float, default=18.0)
    parser.add_argument("--file-seconds", type=float, default=1.0,
                        help="one 32-row file (a step) this often: below training speed, no backlog")
    parser.add_argument("--fresh-every", type=float, default=8.0, help="a new id this often")
    parser.add_argument("--rate-1", type=float, default=20.0, help="batch-1 requests/s per server")
    parser.add_argument("--rate-256", type=float, default=5.0, help="batch-256 requests/s per server")
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput measurement")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp(prefix="bench-fresh-")
    stream, model_dir, frozen = (os.path.join(tmp, d) for d in ("in", "shop", "frozen"))
    os.makedirs(stream)
    config = {
        "version": 1,
        "data": {"format": "csv", "train": os.path.join(stream, "*.csv"), "label": "click",
                 "batch_size": BATCH, "shuffle": False},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64"},
            {"name": "item", "kind": "categorical", "dtype": "string", "table": "item"},
            {"name": "price", "kind": "numeric", "normalizer": {"type": "log1p"}},
        ],
        "tables": {"item": {"dim": 8, "eviction": {"ttl_steps": 400}}},
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [32, 16]}}},
        "train": {"model_dir": model_dir, "checkpoint_every_seconds": 30},
        "export": {"delta_every_seconds": args.delta_seconds, "every_seconds": args.export_seconds,
                   "keep": 3},
    }
    path = os.path.join(tmp, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    log = open(os.path.join(tmp, "log.txt"), "w")
    load_start = os.getloadavg()
    for k in range(4):
        write_file(stream, f"{k:06d}.csv", rows(BATCH * 4, rng), rng)
    train = subprocess.Popen([sys.executable, "-m", "recflow.cli", "train", path, "--follow", "--quiet",
                              "--poll-seconds", "0.2"], stdout=log, stderr=subprocess.STDOUT, env=env)

    def versions():
        folder = os.path.join(model_dir, "export")
        return sorted(d for d in os.listdir(folder) if d.isdigit()) if os.path.isdir(folder) else []

    stop = threading.Event()
    counter = [4]
    lock = threading.Lock()

    def next_name(suffix=""):
        with lock:
            counter[0] += 1
            return f"{counter[0]:06d}{suffix}.csv"

    def producer():
        while not stop.is_set():
            write_file(stream, next_name(), rows(BATCH, rng), rng)
            stop.wait(args.file_seconds)

    feeder = threading.Thread(target=producer)
    feeder.start()
    servers, threads = [], []
    results: dict = {"config": {k: v for k, v in vars(args).items()}}
    try:
        while not versions():
            time.sleep(0.5)
            if train.poll() is not None:
                raise SystemExit(f"training ended: see {log.name}")
        first = versions()[0]
        shutil.copytree(os.path.join(model_dir, "export", first), os.path.join(frozen, "export", first))
        live, still = free_port(), free_port()
        servers = [subprocess.Popen([sys.executable, "-m", "recflow.cli", "serve", d, "--port", str(p),
                                     "--model-name", "m"], stdout=log, stderr=subprocess.STDOUT, env=env)
                   for d, p in ((model_dir, live), (frozen, still))]
        wait_ready(live)
        wait_ready(still)
        start = metrics(live)
        loads0, deltas0 = start["recflow_serve_model_loads"], start["recflow_serve_deltas_applied"]

        # The soak: paced batch-1 and batch-256 clients on both servers, freshness probes.
        lat = {f"{label}_b{b}": [] for label in ("with_deltas", "without_deltas") for b in (1, 256)}
        failed: list[int] = []
        for label, port in (("with_deltas", live), ("without_deltas", still)):
            for size, rate in ((1, args.rate_1), (256, args.rate_256)):
                payload = body(rows(size, np.random.default_rng(size)))
                threads.append(threading.Thread(target=paced, args=(
                    port, payload, rate, stop, lat[f"{label}_b{size}"], failed)))
        fresh, timed_out = [], [0]

        def freshness():
            poller, k = Client(live), 0
            while not stop.is_set():
                item = f"new{k}"
                written = time.time()
                write_file(stream, next_name("-new"), rows(BATCH, rng, new_item=item), rng)
                probe = body([{"user": 1, "item": item, "price": 1.0},
                              {"user": 1, "item": f"never{k}", "price": 1.0}])
                while True:
                    out = poller.call("POST", PREDICT, probe)
                    if out:
                        p = json.loads(out)["predictions"]
                        if abs(p[0][0] - p[1][0]) > 1e-7:
                            fresh.append(time.time() - written)
                            break
                    if time.time() - written > 30:
                        timed_out[0] += 1
                        break
                    time.sleep(0.02)
                k += 1
                stop.wait(max(0.0, written + args.fresh_every - time.time()))
            failed.append(poller.failed)

        threads.append(threading.Thread(target=freshness))
        soak_start = time.monotonic()
        for t in threads:
            t.start()
        while time.monotonic() - soak_start < args.max_seconds:
            time.sleep(2)
            m = metrics(live)
            applied = m["recflow_serve_deltas_applied"] - deltas0
            swaps = m["recflow_serve_model_loads"] - loads0
            if applied >= args.deltas and swaps >= args.swaps:
                break
        soak = time.monotonic() - soak_start
        stop.set()
        for t in threads:
            t.join()
        stop.clear()  # training (and its deltas) goes on during the throughput runs
        one = body(rows(1, rng))
        tput = {}
        for clients in (1, 16):
            rate, f = throughput(live, one, clients, args.seconds)
            failed.append(f)
            tput[f"{clients}_clients_b1_rps"] = rate
        m = metrics(live)
        results.update(
            soak_seconds=soak,
            freshness_s={"n": len(fresh), "timed_out": timed_out[0],
                         "p50": float(np.percentile(fresh, 50)) if fresh else float("nan"),
                         "p95": float(np.percentile(fresh, 95)) if fresh else float("nan"),
                         "max": float(max(fresh, default=float("nan")))},
            latency={k: {"p50_ms": pct(v, 50), "p99_ms": pct(v, 99), "n": len(v)} for k, v in lat.items()},
            throughput=tput,
            failed_requests=sum(failed),
            failure_reasons=dict(FAILURES),
            files_written=counter[0],
            served_step=int(m["recflow_serve_model_step"]),
            deltas_applied=int(m["recflow_serve_deltas_applied"]),
            hot_swaps=int(m["recflow_serve_model_loads"] - 1),
            delta_failures=int(m["recflow_serve_delta_failures"]),
            delta_apply=histogram(m, "recflow_serve_delta_apply_seconds"),
            export_load=histogram(m, "recflow_serve_export_load_seconds"),
            loadavg={"start": load_start, "end": os.getloadavg()},
        )
        for b in (1, 256):
            results["latency"][f"p99_ratio_b{b}"] = (results["latency"][f"with_deltas_b{b}"]["p99_ms"]
                                                     / results["latency"][f"without_deltas_b{b}"]["p99_ms"])
    finally:
        stop.set()
        feeder.join()
        for p in servers:
            p.kill()
        train.send_signal(signal.SIGTERM)
        train.wait(timeout=120)
        log.close()
    lt = results["latency"]
    table = [
        ("freshness (file written -> prediction reflects the trained row) p50 / p95 / max",
         "{p50:.2f} / {p95:.2f} / {max:.2f} s over {n} ids ({timed_out} timed out)".format(**results["freshness_s"])),
    ]
    for b in (1, 256):
        w, wo = lt[f"with_deltas_b{b}"], lt[f"without_deltas_b{b}"]
        table.append((f"batch {b} latency p50 / p99, deltas and hot swaps arriving",
                      f"{w['p50_ms']:.2f} / {w['p99_ms']:.2f} ms ({w['n']} requests)"))
        table.append((f"batch {b} latency p50 / p99, frozen export (no deltas)",
                      f"{wo['p50_ms']:.2f} / {wo['p99_ms']:.2f} ms ({wo['n']} requests)"))
        table.append((f"batch {b} p99 with / without deltas", f"{lt[f'p99_ratio_b{b}']:.2f}x"))
    table += [
        ("throughput, batch 1, 1 client / 16 clients",
         "{1_clients_b1_rps:.0f} / {16_clients_b1_rps:.0f} req/s".format(**results["throughput"])),
        ("deltas applied / hot swaps / deltas refused",
         f"{results['deltas_applied']} / {results['hot_swaps']} / {results['delta_failures']}"
         f" in {results['soak_seconds']:.0f} s"),
        ("apply_delta write-lock hold, mean (all below)",
         "{mean_ms:.2f} ms (< {max_below_ms:.0f} ms)".format(**results["delta_apply"])),
        ("export load + warm-up before a swap, mean", "{mean_ms:.0f} ms".format(**results["export_load"])),
        ("failed requests", str(results["failed_requests"])),
        ("load average (1 min) at start / end",
         f"{results['loadavg']['start'][0]:.1f} / {results['loadavg']['end'][0]:.1f}"),
    ]
    print("| measure | value |\n|---|---|")
    for name, value in table:
        print(f"| {name} | {value} |")
    emit_json("freshness", **results)
    if results["failed_requests"]:
        print(f"failed requests: the servers' and training's log is {log.name}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
