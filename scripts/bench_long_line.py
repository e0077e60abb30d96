"""Peak memory of `recflow train` on a CSV file holding one very long multi_hot line.

For each size, a fresh directory gets `train.csv`: 64 ordinary rows and one row whose
multi_hot column holds values `t0|t1|...` up to about SIZE megabytes (`multi_hot.max_values`
keeps the first 1000). `recflow train` runs one epoch on it in a child process, and the
child's peak resident set (ru_maxrss) is reported, against the same run where that row
holds 3 values (`baseline`). Bounded parsing keeps `extra` (peak minus baseline) near a small
multiple of the line's size; without it, every value of the line cost kilobytes.

Usage (defaults: 1, 4 and 50 MB):
    python scripts/bench_long_line.py
    python scripts/bench_long_line.py --mb 1,2,4 --limit-gb 8

Last line: {"bench": "long_line", "results": [{"mb": .., "values": .., "peak_mb": .., ...}]}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import yaml

ROWS = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", default="1,4,50", help="comma-separated line sizes in MB (default 1,4,50)")
    p.add_argument(
        "--limit-gb", type=float, default=None,
        help="address-space limit of each child (a run over it fails instead of exhausting memory)",
    )  # fmt: skip
    return p.parse_args(argv)


def write_data(directory: str, line_bytes: int) -> int:
    """Writes train.csv; returns the number of values on the long line (0: baseline)."""
    values, parts, size = 0, [], 0
    while size < line_bytes:
        token = f"t{values}"
        parts.append(token)
        size += len(token) + 1
        values += 1
    long_tags = "|".join(parts) if parts else "a|b|c"
    with open(os.path.join(directory, "train.csv"), "w", encoding="utf-8") as f:
        f.write("user,tags,click\n")
        for i in range(ROWS):
            f.write(f"{i},a|b|c{i % 5},{i % 2}\n")
            if i == ROWS // 2:
                f.write(f"999,{long_tags},1\n")
    return values


def write_config(directory: str) -> str:
    config = {
        "version": 1,
        "data": {"format": "csv", "train": os.path.join(directory, "train.csv"), "label": "click",
                 "batch_size": 16, "shuffle": False},
        "features": [
            {"name": "user", "kind": "categorical", "dtype": "int64", "dim": 4},
            {"name": "tags", "kind": "multi_hot", "dtype": "string", "dim": 4, "max_values": 1000},
        ],
        "model": {"type": "deepfm", "params": {"dnn": {"hidden_units": [4]}}},
        "train": {"model_dir": os.path.join(directory, "run"), "epochs": 1,
                  "checkpoint_every_steps": None},
    }  # fmt: skip
    path = os.path.join(directory, "config.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f)
    return path


def peak_mb(config: str, limit_gb: float | None) -> tuple[float, int]:
    """(peak RSS in MB, exit code) of `recflow train CONFIG --quiet` in a child process."""

    def limit():
        if limit_gb:
            size = int(limit_gb * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "recflow.cli", "train", config, "--quiet"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit,
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        print(proc.stderr.read().decode(errors="replace")[-500:], file=sys.stderr)
    return usage.ru_maxrss / 1024, proc.returncode


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        write_data(directory, 0)
        baseline, code = peak_mb(write_config(directory), args.limit_gb)
        print(f"baseline (3 values): peak {baseline:.0f} MB (exit {code})", flush=True)
    results = []
    for mb in [float(x) for x in args.mb.split(",")]:
        with tempfile.TemporaryDirectory() as directory:
            values = write_data(directory, int(mb * (1 << 20)))
            peak, code = peak_mb(write_config(directory), args.limit_gb)
        extra = peak - baseline
        result = {"mb": mb, "values": values, "exit": code, "peak_mb": round(peak),
                  "extra_mb": round(extra), "bytes_per_line_byte": round(extra / mb, 1)}  # fmt: skip
        results.append(result)
        print(
            f"{mb:g} MB line, {values} values: peak {peak:.0f} MB, extra {extra:.0f} MB "
            f"({extra / mb:.1f} bytes per byte of the line) (exit {code})",
            flush=True,
        )
    print(json.dumps({"bench": "long_line", "baseline_mb": round(baseline), "results": results}))


if __name__ == "__main__":
    main()
