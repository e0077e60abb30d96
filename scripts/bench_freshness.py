"""Freshness and serving latency of `recflow serve` following `recflow train --follow`.

End to end, on loopback: a producer writes CSV files with new item ids into a
followed folder; `recflow train --follow` trains them with deltas every
`--delta-steps` steps and a full export every `--export-steps`; `recflow serve`
serves the same model dir. A client polls each new id (beside a never-seen id,
in one request) and records when its prediction first differs from the default
row's: freshness = that time minus the time its file was written.

Latency (p50/p99, persistent HTTP connections) is measured at batch 1 and 256
on the live server (deltas and hot swaps arriving) and on a second server over
a frozen copy of an export (no deltas), under the same training load; then the
throughput of 1 and 16 concurrent clients. Every non-200 answer is counted.

    python scripts/bench_freshness.py [--ids 24] [--seconds 8]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
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
from _bench_common import emit_json, print_table  # noqa: F401  (Keras 2 before TF)

BATCH = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """One persistent connection; counts failures."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.failed = 0

    def call(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body)
        try:
            self.conn.request(method, path, data, {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            text = response.read()
        except (OSError, http.client.HTTPException):
            self.failed += 1
            self.conn.close()
            return None
        if response.status != 200:
            self.failed += 1
            return None
        return json.loads(text)


def rows(n: int, rng, new_item: str | None = None, tag: str = "") -> list[dict]:
    out = []
    for k in range(n):
        item = new_item if new_item and k % 2 == 0 else f"old{rng.integers(0, 200)}"
        out.append({"user": int(rng.integers(0, 100)), "item": item, "price": float(rng.random() * 9)})
    return out


def write_file(folder: str, name: str, batch: list[dict], rng) -> None:
    tmp = os.path.join(folder, f".{name}")
    with open(tmp, "w") as f:
        f.write("click,user,item,price\n")
        for r in batch:
            click = 1 if r["item"].startswith("new") else int(rng.integers(0, 2))
            f.write(f"{click},{r['user']},{r['item']},{r['price']:.3f}\n")
    os.replace(tmp, os.path.join(folder, name))


def wait_ready(port: int, seconds: float = 120) -> None:
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


def latency(port: int, batch: list[dict], seconds: float) -> tuple[list[float], int]:
    client, times = Client(port), []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        client.call("POST", "/v1/models/m:predict", {"instances": batch})
        times.append(time.perf_counter() - t)
    return times, client.failed


def throughput(port: int, batch: list[dict], clients: int, seconds: float) -> tuple[float, int]:
    done, failed = [0] * clients, [0] * clients

    def work(i):
        client = Client(port)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            client.call("POST", "/v1/models/m:predict", {"instances": batch})
            done[i] += 1
        failed[i] = client.failed

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / seconds, sum(failed)


def metric(port: int, name: str) -> float:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def pct(values, q) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=24, help="new ids whose freshness is measured")
    parser.add_argument("--seconds", type=float, default=6.0, help="per latency measurement")
    parser.add_argument("--delta-steps", type=int, default=2)
    parser.add_argument("--export-steps", type=int, default=16)
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
        "train": {"model_dir": model_dir, "checkpoint_every_steps": 50},
        "export": {"delta_every_steps": args.delta_steps, "every_steps": args.export_steps, "keep": 3},
    }
    path = os.path.join(tmp, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    log = open(os.path.join(tmp, "log.txt"), "w")
    for k in range(4):
        write_file(stream, f"{k:05d}.csv", rows(BATCH * 4, rng), rng)
    train = subprocess.Popen([sys.executable, "-m", "recflow.cli", "train", path, "--follow", "--quiet",
                              "--poll-seconds", "0.2"], stdout=log, stderr=subprocess.STDOUT, env=env)
    def versions():
        folder = os.path.join(model_dir, "export")
        return sorted(d for d in os.listdir(folder) if d.isdigit()) if os.path.isdir(folder) else []

    while not versions():
        time.sleep(0.5)
        if train.poll() is not None:
            raise SystemExit(f"training ended: see {log.name}")
    first = versions()[0]
    shutil.copytree(os.path.join(model_dir, "export", first), os.path.join(frozen, "export", first))
    live_port, frozen_port = free_port(), free_port()
    servers = [subprocess.Popen([sys.executable, "-m", "recflow.cli", "serve", d, "--port", str(p),
                                 "--model-name", "m"], stdout=log, stderr=subprocess.STDOUT, env=env)
               for d, p in ((model_dir, live_port), (frozen, frozen_port))]
    results: dict = {}
    try:
        wait_ready(live_port)
        wait_ready(frozen_port)
        # Background files keep training (and deltas) going during the latency runs.
        stop = threading.Event()
        counter = [4]

        def producer():
            while not stop.is_set():
                write_file(stream, f"{counter[0]:05d}.csv", rows(BATCH, rng), rng)
                counter[0] += 1
                stop.wait(1.0)  # one step a second, below training speed: no backlog

        feeder = threading.Thread(target=producer)
        feeder.start()

        # Freshness: one new id per file, polled until its prediction leaves the default.
        fresh, poller = [], Client(live_port)
        for k in range(args.ids):
            item = f"new{k}"
            written = time.time()
            write_file(stream, f"{counter[0]:05d}-new.csv", rows(BATCH, rng, new_item=item), rng)
            counter[0] += 1
            probe = [{"user": 1, "item": item, "price": 1.0}, {"user": 1, "item": f"never{k}", "price": 1.0}]
            while time.time() - written < 30:
                out = poller.call("POST", "/v1/models/m:predict", {"instances": probe})
                if out and abs(out["predictions"][0][0] - out["predictions"][1][0]) > 1e-7:
                    fresh.append(time.time() - written)
                    break
                time.sleep(0.02)
        results["freshness_s"] = {"n": len(fresh), "timed_out": args.ids - len(fresh), "p50": float(np.percentile(fresh, 50)),
                                  "p95": float(np.percentile(fresh, 95)), "max": float(max(fresh))}
        failed = poller.failed
        one, many = rows(1, rng), rows(256, rng)
        lat = {}
        for label, port in (("with_deltas", live_port), ("without_deltas", frozen_port)):
            for size, batch in (("1", one), ("256", many)):
                times, f = latency(port, batch, args.seconds)
                failed += f
                lat[f"{label}_b{size}"] = {"p50_ms": pct(times, 50), "p99_ms": pct(times, 99), "n": len(times)}
        results["latency"] = lat
        tput = {}
        for clients in (1, 16):
            rate, f = throughput(live_port, one, clients, args.seconds)
            failed += f
            tput[f"{clients}_clients_b1_rps"] = rate
        results["throughput"] = tput
        stop.set()
        feeder.join()
        results["failed_requests"] = failed
        results["deltas_applied"] = metric(live_port, "recflow_serve_deltas_applied")
        results["exports_loaded"] = metric(live_port, "recflow_serve_model_loads")
        results["delta_failures"] = metric(live_port, "recflow_serve_delta_failures")
    finally:
        for p in servers:
            p.kill()
        train.send_signal(signal.SIGTERM)
        train.wait(timeout=120)
        log.close()
    table = [["freshness p50 / p95 / max (s)",
              "{p50:.2f} / {p95:.2f} / {max:.2f} over {n} ids".format(**results["freshness_s"])]]
    for key, v in results["latency"].items():
        table.append([f"latency {key} p50 / p99 (ms)", f"{v['p50_ms']:.2f} / {v['p99_ms']:.2f} ({v['n']} req)"])
    for key, v in results["throughput"].items():
        table.append([f"throughput {key}", f"{v:.0f} req/s"])
    for key in ("failed_requests", "deltas_applied", "exports_loaded", "delta_failures"):
        table.append([key, f"{results[key]:.0f}"])
    print_table(["measure", "value"], table)
    emit_json("freshness", **results)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
