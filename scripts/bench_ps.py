"""Parameter-server training on loopback: input read once, per-step traffic, shard balance,
and a paper model of how steps/s scales with workers.

Per setup (1 PS + 1 worker, 2 + 2, 4 + 4; real `recflow launch` clusters on loopback):

1. `--epochs` passes (3): steps, seconds, steps/s over the whole training (start-up,
   traces and the table growth of pass 1 included) and over passes 2.. (steady, from
   `timing.steady_examples_per_sec`), each against the single process; examples trained
   and `examples_read` (rows read from the data by all workers; 1.00x the rows per epoch
   means each row was read once), and AUC; 1 PS + 1 worker also with
   `train.prefetch_embeddings` (docs/distributed.md, "Prefetching embeddings").
2. Per step and worker, from the step as a worker runs it in a chunk's loop, traced on an
   in-process cluster of P PS tasks (dense weights on PS 0; DESIGN.md section 7: one lookup
   and one insert per physical table and shard): tensor transfers between the worker and
   the PS tasks (each is one RecvTensor RPC in TF's gRPC runtime: a tensor per destination
   device, control edges grouped per device pair) and bytes moved, from a real batch's
   unique keys per shard (keys and counts out, embeddings back, gradients out: the sparse
   and dense optimizers run on the PS) and the dense variables (read, then gradients
   pushed).
3. Keys per shard under Zipf ids (a = 1.1 over 10^6 ids, batch keys): distinct keys per
   shard per step, max / mean.

Then a paper model (not a measurement: this machine has 2 cores, so every extra
process competes for them) of steps/s against workers, from those per-step costs,
the single-process time per step measured here (trace included), a stated network
and the table speed of DESIGN.md section 9.

    python scripts/bench_ps.py [--rows 100000] [--batch 512] [--epochs 3]

Prints tables and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Keras 2, as `import recflow` selects
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "deepfm_demo.yaml")
SETUPS = ((1, 1), (2, 2), (4, 4))
# The network of the paper model.
BANDWIDTH = 10e9 / 8  # bytes/s per task (10 Gbit/s NIC, full duplex)
LATENCY = 100e-6  # s per sequential RPC round
ROUNDS = 3  # sequential rounds per step: lookups, dense reads, then inserts + gradient pushes
TABLE_KEYS_PER_SEC = 5e6  # DenseHashTable lookups (or inserts) per PS task (DESIGN.md section 9)


def settings(rows: int, batch: int, epochs: int) -> list[str]:
    return [
        f"data.synthetic={{rows: {rows}, eval_rows: 2000, seed: 7, schema: demo}}",
        f"data.batch_size={batch}",
        f"train.epochs={epochs}",
        "train.checkpoint_every_steps=null",
        "model.params={dnn: {hidden_units: [64, 32]}}",
    ]


def run_job(command: str, model_dir: str, extra: list[str], sets: list[str], batch: int) -> dict:
    args = [sys.executable, "-m", "recflow.cli", command, CONFIG, "--model-dir", model_dir, *extra]
    for item in sets:
        args += ["--set", item]
    if command == "train":
        args.append("--quiet")
    subprocess.run(args, check=True, cwd=REPO, capture_output=True, text=True)
    with open(os.path.join(model_dir, "metrics.json"), encoding="utf-8") as f:
        m = json.load(f)
    steady = m["timing"].get("steady_examples_per_sec")
    return {
        "steps": m["steps"], "seconds": m["train_seconds"],
        "steps_per_sec": round(m["steps"] / m["train_seconds"], 2),
        # Passes 2.. only: no start-up, tracing or table growth (every id seen in pass 1).
        "steady_steps_per_sec": round(steady / batch, 2) if steady else None,
        "examples": m["examples"], "examples_read": m["examples_read"], "auc": m.get("auc"),
    }


def _transfers(graph) -> int:
    """Cross-device transfers of a traced step: one per tensor and destination device (TF
    sends a tensor to a device once), plus one per device pair with control edges between
    them (grouped). An op without a device that takes a resource runs on the resource's
    device, as TF colocates it; any other runs on the worker (the step's own device)."""
    import tensorflow as tf

    handles = {internal.op.name: external.device for external, internal in graph.captures}

    def device(op) -> str:
        name = op.device
        if not name and op.type == "Placeholder":
            name = handles.get(op.name, "")
        elif not name:
            resources = [t.op for t in op.inputs if t.dtype == tf.resource]
            return device(resources[0]) if resources else "worker"
        return "ps:" + name.split("/task:")[1].split("/")[0] if "/job:ps" in name else "worker"

    data, control = set(), set()
    for op in graph.get_operations():
        here = device(op)
        data |= {(t.name, here) for t in op.inputs if device(t.op) != here}
        control |= {(device(c), here) for c in op.control_inputs if device(c) != here}
    return len(data) + len(control)


def step_costs(batch: int, ps_counts: list[int]) -> list[dict]:
    """Per-step transfers and bytes between one worker and the PS tasks, per PS count."""
    import numpy as np
    import tensorflow as tf

    from recflow.config import load_config
    from recflow.data import make_dataset
    from recflow.distribute.cluster import ps_devices
    from recflow.distribute.launcher import free_ports
    from recflow.embedding.placement import ModPlacement
    from recflow.features.transform import transform
    from recflow.models import build_model
    from recflow.training.dense_optimizer import make_dense_optimizer

    most = max(ps_counts)
    ports = free_ports(most + 1)
    cluster = tf.train.ClusterSpec(
        {"ps": [f"localhost:{p}" for p in ports[1:]], "chief": [f"localhost:{ports[0]}"]}
    )
    servers = [tf.distribute.Server(cluster, job_name="ps", task_index=i) for i in range(most)]
    tf.config.experimental_connect_to_cluster(cluster, job_name="chief")
    config = load_config(CONFIG, [f"data.batch_size={batch}", "model.params={dnn: {hidden_units: [64, 32]}}"])
    features, labels, bad = next(iter(make_dataset(config, "train", epochs=1).take(1)))
    batch_data = (transform(config, features), labels, bad)
    rows = []
    for num_ps in ps_counts:
        placement = ModPlacement(num_ps, ps_devices(most)[:num_ps])
        with tf.device(ps_devices(most)[0]):  # the dense weights and their slots on PS 0
            model = build_model(config, placement)
            model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
            model.build_weights()
        # The step as a worker runs it inside a chunk's loop.
        step = tf.function(lambda b, m=model: m.train_on_rows(b, in_loop=True)[0], autograph=False)
        transfers = _transfers(step.get_concrete_function(batch_data).graph)
        ids, _ = model.split_features(batch_data[0])
        sparse_bytes, keys_per_shard = 0, np.zeros(num_ps, np.int64)
        for table in model.embedding.physical_tables:
            keys, _ = tf.unique(model.embedding._keys(table, ids))
            shards = np.bincount(placement.shard_of(keys).numpy(), minlength=num_ps)
            keys_per_shard += shards
            dim = table.spec.dim
            # Keys and their batch counts out, embeddings back, gradients out: the rows'
            # optimizer slots and metadata never leave the PS (the update runs there).
            sparse_bytes += int(shards.sum()) * (8 + 4 + 4 * dim + 4 * dim)
        dense = sum(int(np.prod(v.shape)) * v.dtype.size for v in model.trainable_variables)
        rows.append({
            "num_ps": num_ps,
            "transfers_per_step": transfers,
            "sparse_bytes_per_step": sparse_bytes,
            "dense_bytes_per_step": 2 * dense,  # weights read, gradients pushed
            "bytes_per_step": sparse_bytes + 2 * dense,
            "keys_per_shard": keys_per_shard.tolist(),
        })
    del servers
    return rows


def zipf_balance(batch: int, shard_counts: list[int], steps: int = 50) -> list[dict]:
    """Distinct keys per shard per step for Zipf(1.1) ids over 10^6 values."""
    import numpy as np
    import tensorflow as tf

    from recflow.embedding.placement import ModPlacement
    from recflow.features.keys import encode, int_ids

    rng = np.random.default_rng(0)
    out = []
    for shards in shard_counts:
        placement = ModPlacement(shards)
        worst, per = [], np.zeros(shards)
        for _ in range(steps):
            ids = (rng.zipf(1.1, size=batch) - 1) % 1_000_000
            keys = np.unique(encode(int_ids(tf.constant(ids, tf.int64)), 0).numpy(), axis=0)
            counts = np.bincount(placement.shard_of(tf.constant(keys)).numpy(), minlength=shards)
            worst.append(counts.max() / counts.mean())
            per += counts
        out.append({
            "shards": shards,
            "keys_per_shard_per_step": [round(float(c), 1) for c in per / steps],
            "max_over_mean": round(float(np.mean(worst)), 3),
        })
    return out


def paper_model(local_step_s: float, cost: dict, workers: int, ps: int) -> float:
    """Steps/s of the cluster, the least of three limits: the workers (each step = compute +
    RPC rounds + its bytes over its NIC), the PS NICs (every step's bytes cross one), and the PS
    table ops (a lookup and an insert of each key of the busiest shard)."""
    per_worker = local_step_s + ROUNDS * LATENCY + cost["bytes_per_step"] / BANDWIDTH
    busiest = max(cost["keys_per_shard"])
    return min(
        workers / per_worker,
        ps * BANDWIDTH / cost["bytes_per_step"],
        TABLE_KEYS_PER_SEC / (2 * busiest),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3, help="passes (the steady rate needs 2+)")
    parser.add_argument("--skip-clusters", action="store_true", help="only the per-step costs")
    args = parser.parse_args()

    sets = settings(args.rows, args.batch, args.epochs)
    speed = {}
    with tempfile.TemporaryDirectory() as tmp:
        speed["single process"] = run_job("train", os.path.join(tmp, "local"), [], sets, args.batch)
        if not args.skip_clusters:
            for ps, workers in SETUPS:
                extra = ["--ps", str(ps), "--workers", str(workers)]
                speed[f"{ps} PS + {workers} workers"] = run_job(
                    "launch", os.path.join(tmp, f"ps{ps}"), extra, sets, args.batch
                )
                if ps == 1:  # the same with train.prefetch_embeddings
                    speed["1 PS + 1 workers, prefetch"] = run_job(
                        "launch", os.path.join(tmp, "ps1p"), extra,
                        sets + ["train.prefetch_embeddings=true"], args.batch,
                    )
    print(f"{args.epochs} epoch(s) of {args.rows} rows, batch {args.batch} (2 cores: every process "
          "shares them); steps/s over the whole training (start-up, traces, table growth included), "
          "steady over passes 2..")
    print(f"{'setup':<30} {'steps':>6} {'seconds':>8} {'steps/s':>8} {'vs single':>9} {'steady':>7} "
          f"{'vs single':>9} {'examples':>9} {'read/rows/epoch':>15} {'AUC':>7}")
    single = speed["single process"]
    for name, r in speed.items():
        steady = r["steady_steps_per_sec"]
        ratio = steady / single["steady_steps_per_sec"] if steady and single["steady_steps_per_sec"] else None
        print(f"{name:<30} {r['steps']:>6} {r['seconds']:>8.1f} {r['steps_per_sec']:>8.2f} "
              f"{r['steps_per_sec'] / single['steps_per_sec']:>8.2f}x "
              f"{steady if steady else '-':>7} {f'{ratio:.2f}x' if ratio else '-':>9} {r['examples']:>9} "
              f"{r['examples_read'] / args.rows / args.epochs:>15.3f} {r['auc']:>7.4f}")
    print()

    costs = step_costs(args.batch, [ps for ps, _ in SETUPS])
    print(f"per step and worker, batch {args.batch}")
    print(f"{'PS':>3} {'transfers':>10} {'sparse KB':>10} {'dense KB':>9} {'total KB':>9}  keys per shard")
    for c in costs:
        print(f"{c['num_ps']:>3} {c['transfers_per_step']:>10} {c['sparse_bytes_per_step'] / 1e3:>10.1f} "
              f"{c['dense_bytes_per_step'] / 1e3:>9.1f} {c['bytes_per_step'] / 1e3:>9.1f}  {c['keys_per_shard']}")
    print()

    balance = zipf_balance(4096, [ps for ps, _ in SETUPS])
    print("Zipf(1.1) ids, 4096 per step: distinct keys per shard per step")
    for b in balance:
        print(f"{b['shards']:>3} shards: {b['keys_per_shard_per_step']}  max/mean {b['max_over_mean']}")
    print()

    local_step = 1.0 / speed["single process"]["steps_per_sec"]
    by_ps = {c["num_ps"]: c for c in costs}
    print(f"paper model (not a measurement): compute {local_step * 1e3:.1f} ms/step (single process here), "
          f"{BANDWIDTH * 8 / 1e9:.0f} Gbit/s per task, {LATENCY * 1e6:.0f} us x {ROUNDS} RPC rounds per step, "
          f"{TABLE_KEYS_PER_SEC / 1e6:.0f}M table keys/s per PS")
    print(f"{'workers':>8} {'PS':>3} {'steps/s':>9} {'examples/s':>11}")
    model_rows = []
    for workers in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        ps = min(workers, 4)
        cost = dict(by_ps[ps])
        rate = paper_model(local_step, cost, workers, ps)
        model_rows.append({"workers": workers, "ps": ps, "steps_per_sec": round(rate, 1)})
        print(f"{workers:>8} {ps:>3} {rate:>9.1f} {rate * args.batch:>11.0f}")
    print(json.dumps({
        "bench": "ps", "rows": args.rows, "batch": args.batch, "speed": speed, "step_costs": costs,
        "zipf_balance": balance, "paper_model": model_rows,
    }))


if __name__ == "__main__":
    main()
