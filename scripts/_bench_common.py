"""Helpers shared by the benchmark scripts (`scripts/bench_*.py`, `scripts/compare_deepctr.py`).

Not part of the recflow package. Import this module before TensorFlow: it selects
Keras 2 (`TF_USE_LEGACY_KERAS=1`) the way `import recflow` does, so recflow,
DeepCTR and tf_keras share one Keras.

What is here:
    criteo_data          the Criteo-like synthetic rows (recflow.data.synthetic, schema "criteo")
    write_csv / write_npz  hand the same rows to a config or to another process
    log1p_dense          the numeric transform every system uses (log1p of max(x, 0), NaN -> 0)
    run_recflow          a recflow job (build + train + eval), timed like the peers
    run_deepctr          DeepCTR's DeepFM on the same rows (LabelEncoder vocabularies)
    tfra_python          the side virtualenv with TF 2.16.2 + TFRA 0.8.1 (built once)
    print_table, emit_json, rss_bytes, median
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C_COLUMNS = tuple(f"C{i}" for i in range(1, 27))
I_COLUMNS = tuple(f"I{i}" for i in range(1, 14))
LABEL = "label"

# ----------------------------------------------------------------------------- data


def criteo_data(rows: int, eval_rows: int, seed: int = 7) -> tuple[dict, dict, float]:
    """(train columns, eval columns, oracle eval AUC) of the synthetic Criteo-like set.

    The same (rows, eval_rows, seed) as a config's `data.synthetic` gives the very
    rows a `format: synthetic` recflow run reads (the generator is cached in-process).
    """
    from recflow.config.schema import SyntheticOptions
    from recflow.data import synthetic

    options = SyntheticOptions(rows=rows, eval_rows=eval_rows, seed=seed, schema="criteo")
    train, _ = synthetic.generate(options, "train")
    evaluation, oracle = synthetic.generate(options, "eval")
    return train, evaluation, oracle


def write_csv(out_dir: str, train: dict, evaluation: dict) -> tuple[str, str]:
    """Writes `train.csv` and `eval.csv` (empty cells for missing values)."""
    from recflow.data.writer import write_columns

    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "train.csv"), os.path.join(out_dir, "eval.csv")
    write_columns(paths[0], train, "csv", labels=[LABEL])
    write_columns(paths[1], evaluation, "csv", labels=[LABEL])
    return paths


def write_npz(path: str, columns: dict) -> None:
    """Columns as an .npz readable without pickle (strings as fixed-width unicode)."""
    arrays = {}
    for name, a in columns.items():
        a = np.asarray(a)
        arrays[name] = a.astype(str) if a.dtype == object else a
    np.savez(path, **arrays)


def log1p_dense(x: np.ndarray) -> np.ndarray:
    """recflow's `log1p` normalizer in numpy: log(1 + max(x, 0)), missing (NaN) -> 0."""
    x = np.nan_to_num(np.asarray(x, np.float32), nan=0.0)
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)


def deepfm_config(
    rows: int,
    eval_rows: int,
    *,
    seed: int = 7,
    batch_size: int = 4096,
    epochs: int = 1,
    dim: int = 8,
    hidden: Sequence[int] = (256, 128),
    lr: float = 0.005,
    fusion: bool = True,
    model_dir: str = "runs/bench",
    csv: tuple[str, str] | None = None,
    dnn_dtype: str = "float32",
) -> list[str]:
    """`--set` overrides of configs/criteo_bench.yaml for a benchmark run.

    With `csv` = (train file, eval file) the run reads those CSV files (see
    `write_csv`) instead of generating the synthetic rows in memory. `dnn_dtype`:
    the DNN's `dtype` ("mixed_bfloat16": its hidden layers compute in bfloat16).
    """
    units = "[" + ", ".join(str(u) for u in hidden) + "]"
    if csv is None:
        data = [
            "data.format=synthetic",
            f"data.synthetic={{rows: {rows}, eval_rows: {eval_rows}, seed: {seed}, schema: criteo}}",
        ]
    else:
        data = ["data.format=csv", f"data.train={json.dumps(csv[0])}", f"data.eval={json.dumps(csv[1])}"]
    overrides = data + [
        f"data.batch_size={batch_size}",
        f"train.epochs={epochs}",
        f"train.optimizer={{type: adam, learning_rate: {lr}}}",
        f"train.sparse_optimizer={{type: adam, learning_rate: {lr}}}",
        f"model.params={{dnn: {{hidden_units: {units}, dropout: 0.0, dtype: {dnn_dtype}}}}}",
        f"embedding.fusion={'true' if fusion else 'false'}",
        f"train.model_dir={model_dir}",
    ]
    overrides += [f"features.C{i}.dim={dim}" for i in range(1, 27)]
    return overrides


# ----------------------------------------------------------------------------- systems


def run_recflow(config, model_dir: str, export: bool = False) -> dict:
    """One recflow job, timed like the peers: build + train + evaluate (+ export).

    Returns the trainer's summary and metrics plus `build_seconds`, `fit_seconds`,
    `eval_seconds`, `export_seconds` and `job_seconds` (wall time of the whole job).
    """
    from recflow.training.trainer import Trainer

    gc.collect()  # the Trainer seeds everything from `train.seed`
    began = time.perf_counter()
    trainer = Trainer(config, model_dir, verbose=0)
    built = time.perf_counter()
    summary = trainer.fit()
    trained = time.perf_counter()
    result = trainer.evaluate()
    evaluated = time.perf_counter()
    if export:
        result["export"] = trainer.model_dir.export()
    ended = time.perf_counter()
    result.update(summary)
    result.update(
        build_seconds=built - began,
        fit_seconds=trained - built,
        eval_seconds=evaluated - trained,
        export_seconds=ended - evaluated,
        job_seconds=ended - began,
    )
    return result


def label_encode(train: dict, evaluation: dict, columns: Sequence[str]) -> tuple[dict, dict, dict]:
    """DeepCTR's recipe: one sklearn LabelEncoder per column, fit on train + eval rows.

    Returns (train codes, eval codes, vocabulary size per column).
    """
    from sklearn.preprocessing import LabelEncoder

    n = len(train[columns[0]])
    codes_train, codes_eval, sizes = {}, {}, {}
    for name in columns:
        values = np.concatenate([np.asarray(train[name]), np.asarray(evaluation[name])]).astype(str)
        codes = LabelEncoder().fit_transform(values).astype(np.int32)
        codes_train[name], codes_eval[name] = codes[:n], codes[n:]
        sizes[name] = int(codes.max()) + 1
    return codes_train, codes_eval, sizes


def run_deepctr(
    train: dict,
    evaluation: dict,
    *,
    dim: int = 8,
    hidden: Sequence[int] = (256, 128),
    batch_size: int = 4096,
    epochs: int = 1,
    lr: float = 0.005,
    l2: float = 0.0,
    seed: int = 7,
) -> dict:
    """DeepCTR's DeepFM: SparseFeat per C column, DenseFeat per I column, Adam.

    The job (timed) = LabelEncoder vocabularies + log1p + build + fit + predict.
    `l2` is DeepCTR's `l2_reg_embedding` and `l2_reg_linear` (its default is 1e-5;
    0 gives the objective recflow's DeepFM optimizes).
    """
    import tensorflow as tf
    import tf_keras as keras
    from deepctr.feature_column import DenseFeat, SparseFeat
    from deepctr.models import DeepFM

    from recflow.metrics import auc

    gc.collect()
    keras.utils.set_random_seed(seed)
    began = time.perf_counter()
    x_train, x_eval, sizes = label_encode(train, evaluation, C_COLUMNS)
    for name in I_COLUMNS:
        x_train[name] = log1p_dense(train[name])
        x_eval[name] = log1p_dense(evaluation[name])
    prepared = time.perf_counter()
    features = [SparseFeat(c, vocabulary_size=sizes[c], embedding_dim=dim) for c in C_COLUMNS]
    features += [DenseFeat(c, 1) for c in I_COLUMNS]
    model = DeepFM(
        features, features, dnn_hidden_units=tuple(hidden), l2_reg_embedding=l2,
        l2_reg_linear=l2, dnn_dropout=0.0, seed=seed, task="binary",
    )  # fmt: skip
    model.compile(keras.optimizers.Adam(learning_rate=lr), "binary_crossentropy")
    built = time.perf_counter()
    y = np.asarray(train[LABEL], np.float32)
    model.fit(x_train, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=True)
    trained = time.perf_counter()
    scores = model.predict(x_eval, batch_size=batch_size, verbose=0).reshape(-1)
    ended = time.perf_counter()
    examples = len(y) * epochs
    del model
    tf.keras.backend.clear_session()
    return {
        "auc": auc(evaluation[LABEL], scores),
        "prep_seconds": prepared - began,
        "build_seconds": built - prepared,
        "fit_seconds": trained - built,
        "eval_seconds": ended - trained,
        "job_seconds": ended - began,
        "examples": examples,
        "fit_examples_per_sec": examples / (trained - built),
        "vocabulary": sum(sizes.values()),
    }


# ----------------------------------------------------------------------------- TFRA side venv

TFRA_REQUIREMENTS = (
    "tensorflow==2.16.2",
    "tf-keras>=2.16,<2.17",
    "tensorflow-recommenders-addons==0.8.1",
    "numpy<2",
)
DEFAULT_TFRA_VENV = os.path.join(os.path.expanduser("~"), ".cache", "recflow-bench", "tfra-venv")


class Unavailable(Exception):
    """A peer system cannot run here; the message is one line."""


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR") or "Error" in ln or "error:" in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def tfra_python(venv_dir: str = DEFAULT_TFRA_VENV, timeout: float = 1800.0) -> str:
    """The python of a virtualenv with TF 2.16.2 + TFRA 0.8.1, created on first use.

    Raises:
        Unavailable: the venv cannot be built or TFRA does not import (one line).
    """
    python = os.path.join(venv_dir, "bin", "python")
    marker = os.path.join(venv_dir, "recflow-bench-ok")
    check = [
        python,
        "-c",
        "import tensorflow_recommenders_addons.dynamic_embedding as de; de.keras",
    ]
    if os.path.exists(marker) and os.path.exists(python):
        return python
    steps = []
    if not os.path.exists(python):
        steps.append([sys.executable, "-m", "venv", venv_dir])
    steps.append([python, "-m", "pip", "install", "-q", *TFRA_REQUIREMENTS])
    steps.append(check)
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
    print(f"building the TFRA venv in {venv_dir} (once; downloads TF 2.16.2)", file=sys.stderr)
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"{' '.join(cmd[:4])}: {e}") from None
        if done.returncode != 0:
            raise Unavailable(_last_error_line(done.stderr + "\n" + done.stdout))
    with open(marker, "w") as f:
        f.write("\n".join(TFRA_REQUIREMENTS) + "\n")
    return python


# ----------------------------------------------------------------------------- output


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits + 1 if abs(value) < 1 else digits}f}"
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> None:
    """A plain aligned text table on stdout."""
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    if title:
        print(title)
    print(
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))
        )
    )
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )
    sys.stdout.flush()


def _json_ready(value):
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return None if value != value else round(value, 6)
    if isinstance(value, np.integer):
        return int(value)
    return value


def emit_json(bench: str, **fields) -> None:
    """The final line: `{"bench": NAME, ...}` (NaN -> null)."""
    print(json.dumps({"bench": bench, **_json_ready(fields)}), flush=True)


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, np.float64)))


def ratio(a, b):
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or not b:
        return None
    return a / b


# ----------------------------------------------------------------------------- any schema


def deepctr_inputs(config, train: dict, evaluation: dict) -> tuple[list, dict, dict]:
    """DeepCTR feature columns and inputs for the features of a recflow config.

    Categorical -> `SparseFeat`; multi_hot / sequence -> `VarLenSparseFeat` (mean
    pooled, padded to max_values / max_len with 0); a table shared by several
    features -> one vocabulary and one `embedding_name`; numeric -> `DenseFeat`
    holding recflow's own normalized values (the same inputs both systems see).
    Vocabularies are fit on train + eval rows (DeepCTR's LabelEncoder recipe).
    """
    import tensorflow as tf
    from deepctr.feature_column import DenseFeat, SparseFeat, VarLenSparseFeat

    from recflow.features.kinds import normalize

    def tokens(feature, column):
        if feature.kind == "categorical":
            return [[str(v)] for v in column]
        return [[t for t in str(v).split(feature.separator) if t] for v in column]

    split = {
        f.name: (tokens(f, train[f.source]), tokens(f, evaluation[f.source]))
        for f in config.sparse_features
    }
    vocab: dict[str, dict[str, int]] = {}
    for f in config.sparse_features:
        ids = vocab.setdefault(f.table_name, {})
        for rows in split[f.name]:
            for row in rows:
                for t in row:
                    ids.setdefault(t, len(ids) + 1)  # 0 pads
    columns, x_train, x_eval = [], {}, {}
    for f in config.features:
        if f.kind == "numeric":
            columns.append(DenseFeat(f.name, 1))
            for out, data in ((x_train, train), (x_eval, evaluation)):
                raw = tf.constant(np.asarray(data[f.source], np.float32))
                out[f.name] = normalize(f, raw).numpy()
            continue
        ids = vocab[f.table_name]
        dim = config.table(f.table_name).dim
        sparse = SparseFeat(f.name, len(ids) + 1, embedding_dim=dim, embedding_name=f.table_name)
        if f.kind == "categorical":
            columns.append(sparse)
            for out, rows in zip((x_train, x_eval), split[f.name]):
                out[f.name] = np.array([ids[r[0]] for r in rows], np.int32)
            continue
        length = f.max_len if f.kind == "sequence" else min(f.max_values, 64)
        columns.append(VarLenSparseFeat(sparse, maxlen=length, combiner="mean"))
        for out, rows in zip((x_train, x_eval), split[f.name]):
            padded = np.zeros((len(rows), length), np.int32)
            for i, row in enumerate(rows):
                row = [ids[t] for t in row[:length]]
                padded[i, : len(row)] = row
            out[f.name] = padded
    return columns, x_train, x_eval


def run_deepctr_config(
    config, train: dict, evaluation: dict, *, lr: float = 0.001, seed: int = 7, l2: float = 1e-5
) -> dict:
    """DeepCTR's DeepFM at its own defaults (Adam, `lr`, l2 1e-5) on a recflow config's
    features, batch size, epochs and DNN units."""
    import tensorflow as tf
    import tf_keras as keras
    from deepctr.models import DeepFM

    from recflow.metrics import auc

    gc.collect()
    keras.utils.set_random_seed(seed)
    began = time.perf_counter()
    columns, x_train, x_eval = deepctr_inputs(config, train, evaluation)
    hidden = tuple(config.model.params.get("dnn", {}).get("hidden_units", (256, 128)))
    model = DeepFM(
        columns, columns, dnn_hidden_units=hidden, l2_reg_embedding=l2, l2_reg_linear=l2,
        dnn_dropout=0.0, seed=seed, task="binary",
    )  # fmt: skip
    model.compile(keras.optimizers.Adam(learning_rate=lr), "binary_crossentropy")
    label = config.labels[0]
    y = np.asarray(train[label], np.float32)
    fit_began = time.perf_counter()
    epochs = config.train.total_epochs
    model.fit(x_train, y, batch_size=config.data.batch_size, epochs=epochs, verbose=0, shuffle=True)
    fit_ended = time.perf_counter()
    scores = model.predict(x_eval, batch_size=config.data.batch_size, verbose=0).reshape(-1)
    ended = time.perf_counter()
    del model
    tf.keras.backend.clear_session()
    return {
        "auc": auc(np.asarray(evaluation[label]), scores),
        "job_seconds": ended - began,
        "fit_examples_per_sec": len(y) * epochs / (fit_ended - fit_began),
    }
