"""Parameter-server scaling on this machine, and how fusion scales with the PS count.

1. steps/s of the same job single-process, on 1 PS + 1 worker and on 2 PS + 2 workers
   (real `recflow launch` clusters on loopback; the chief's own training time).
2. From the traced train step on an in-process cluster of N PS tasks: the number of
   table lookups and inserts that cross to a PS per step, fused vs unfused.

    python scripts/bench_ps.py [--steps 200] [--batch 512] [--max-ps 4]

Prints a table and a final JSON line. On 2 cores more processes mostly add
RPC and scheduling overhead: the numbers are honest, not a scaling claim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "deepfm_demo.yaml")


def settings(steps: int, batch: int) -> list[str]:
    return [
        "data.synthetic={rows: 100000, eval_rows: 2000, seed: 7, schema: demo}",
        f"data.batch_size={batch}",
        "train.epochs=null",
        f"train.steps={steps}",
        "train.checkpoint_every_steps=null",
        "model.params={dnn: {hidden_units: [64, 32]}}",
    ]


def run_job(command: str, model_dir: str, extra: list[str], sets: list[str]) -> dict:
    args = [sys.executable, "-m", "recflow.cli", command, CONFIG, "--model-dir", model_dir, *extra]
    for item in sets:
        args += ["--set", item]
    if command == "train":
        args.append("--quiet")
    subprocess.run(args, check=True, cwd=REPO, capture_output=True, text=True)
    with open(os.path.join(model_dir, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    return {"steps": metrics["steps"], "seconds": metrics["train_seconds"],
            "steps_per_sec": round(metrics["steps"] / metrics["train_seconds"], 2)}


def op_counts(max_ps: int) -> list[dict]:
    """Cross-process lookups/inserts per step from the traced graph, fused vs unfused."""
    import tensorflow as tf

    import recflow  # noqa: F401  (Keras 2)
    from recflow.config import load_config
    from recflow.data import make_dataset
    from recflow.distribute.cluster import ps_devices
    from recflow.distribute.launcher import free_ports
    from recflow.embedding.placement import ModPlacement
    from recflow.features.transform import transform
    from recflow.models import build_model
    from recflow.training.trainer import make_dense_optimizer

    ports = free_ports(max_ps + 1)
    cluster = tf.train.ClusterSpec(
        {"ps": [f"localhost:{p}" for p in ports[1:]], "chief": [f"localhost:{ports[0]}"]}
    )
    servers = [tf.distribute.Server(cluster, job_name="ps", task_index=i) for i in range(max_ps)]
    tf.config.experimental_connect_to_cluster(cluster, job_name="chief")
    rows = []
    for fusion in (True, False):
        for num_ps in sorted({1, 2, max_ps}):
            config = load_config(CONFIG, [f"embedding.fusion={str(fusion).lower()}"])
            devices = ps_devices(max_ps)[:num_ps]
            model = build_model(config, ModPlacement(num_ps, devices))
            model.compile(optimizer=make_dense_optimizer(config.train.optimizer))
            ds = make_dataset(config, "train", epochs=1).take(1)
            features, labels, bad = next(iter(ds))
            batch = (transform(config, features), labels, bad)
            graph = tf.function(model.train_step, autograph=False).get_concrete_function(batch).graph
            nodes = list(graph.as_graph_def().node)
            for fn in graph.as_graph_def().library.function:
                nodes += list(fn.node_def)
            remote = [n for n in nodes if "/job:ps" in n.device]
            rows.append({
                "fusion": fusion,
                "num_ps": num_ps,
                "physical_tables": len(model.embedding.physical_tables),
                "lookups": sum(n.op == "LookupTableFindV2" for n in remote),
                "inserts": sum(n.op == "LookupTableInsertV2" for n in remote),
            })
    del servers
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--max-ps", type=int, default=4)
    parser.add_argument("--skip-clusters", action="store_true", help="only count ops")
    args = parser.parse_args()

    sets = settings(args.steps, args.batch)
    speed = {}
    if not args.skip_clusters:
        with tempfile.TemporaryDirectory() as tmp:
            speed["single process"] = run_job("train", os.path.join(tmp, "local"), [], sets)
            for ps, workers in ((1, 1), (2, 2)):
                name = f"{ps} PS + {workers} workers"
                extra = ["--ps", str(ps), "--workers", str(workers)]
                speed[name] = run_job("launch", os.path.join(tmp, f"ps{ps}"), extra, sets)
        print(f"{'setup':<22} {'steps':>6} {'seconds':>8} {'steps/s':>8}")
        for name, r in speed.items():
            print(f"{name:<22} {r['steps']:>6} {r['seconds']:>8.1f} {r['steps_per_sec']:>8.2f}")
        print()

    counts = op_counts(args.max_ps)
    print(f"{'fusion':<7} {'PS':>3} {'physical tables':>16} {'PS lookups/step':>16} {'PS inserts/step':>16}")
    for r in counts:
        print(f"{str(r['fusion']):<7} {r['num_ps']:>3} {r['physical_tables']:>16} "
              f"{r['lookups']:>16} {r['inserts']:>16}")
    print(json.dumps({"bench": "ps", "batch": args.batch, "speed": speed, "ops": counts}))


if __name__ == "__main__":
    main()
