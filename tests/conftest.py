"""Shared fixtures: quiet TensorFlow, Keras 2, the demo at test size, a trained model."""

import json
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import recflow  # noqa: E402,F401  (selects Keras 2 before TensorFlow loads)


def fingerprint_ids(strings) -> list[int]:
    """The ids recflow gives strings, worked out without recflow: each string's
    `Fingerprint64` as int64, pieced together from `to_hash_bucket_fast` (which
    reduces that fingerprint mod its bucket count): its low 62 bits (mod 2**62),
    then which of the four fingerprints with those bits leaves the right
    remainder mod 2**63 - 1 (the four leave distinct ones)."""
    import tensorflow as tf

    strings = list(strings)
    if not strings:
        return []
    low = tf.strings.to_hash_bucket_fast(strings, 2**62).numpy().tolist()
    rem = tf.strings.to_hash_bucket_fast(strings, 2**63 - 1).numpy().tolist()
    out = []
    for lo, r in zip(low, rem):
        (fp,) = [lo + k * 2**62 for k in range(4) if (lo + k * 2**62) % (2**63 - 1) == r]
        out.append(fp - 2**64 if fp >= 2**63 else fp)
    return out


# ----------------------------------------------------------------------------- test order

# The modules that take longest (real clusters, kill-and-resume runs, a stateful model
# test), longest first. pytest-xdist hands whole modules to its two workers in collection
# order (`--dist loadfile --no-loadscope-reorder` in pyproject.toml): started first, they
# leave the short modules to fill the end, and both workers finish together.
LONGEST_FIRST = (
    "test_reshard", "test_ps_cluster", "test_signals", "test_ps_input", "test_cache",
    "test_kafka", "test_resume_and_stream", "test_faults", "test_zoo", "test_store_model",
    "test_prefetch", "test_end_to_end", "test_serve", "test_growth", "test_ps_step_graph",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


# ----------------------------------------------------------------------------- the demo at test size

DEMO = "configs/deepfm_demo.yaml"

# The demo model at test size: 1024 rows in batches of 128 (8 steps an epoch), one epoch,
# one hidden layer of 8. Modules change what their check needs with `small(...)`.
SMALL = {
    "data.synthetic": {"rows": 1024, "eval_rows": 256, "seed": 3, "schema": "demo"},
    "data.batch_size": 128,
    "model.params": {"dnn": {"hidden_units": [8]}},
    "train.epochs": 1,
}


def small(*changes: dict, export: bool = False, evaluate: bool = False) -> dict:
    """SMALL with `changes` merged in, later ones winning. Without `export` the run
    ends without writing a SavedModel (`export.at_end: false`), and without `evaluate`
    without its evaluation (`train.evaluate: false`, about a quarter of a small run):
    a test that reads the export or the eval metrics asks for them."""
    merged = dict(SMALL)
    for change in changes:
        merged.update(change)
    merged.setdefault("export.at_end", export)
    merged.setdefault("train.evaluate", evaluate)
    return merged


def sets(overrides: dict) -> list[str]:
    """`--set KEY=VALUE` command-line arguments; values as JSON, which YAML reads."""
    return [arg for item in items(overrides) for arg in ("--set", item)]


def items(overrides: dict) -> list[str]:
    """`KEY=VALUE` override strings (what `load_config` and `--set` take)."""
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


# The shared trained model: 8 steps, checkpoints at 4 and 8, item admission and user
# eviction (so its tables have waiting keys and evicted rows), the export of step 8.
TRAINED = small(
    {
        "train.checkpoint_every_steps": 4,
        "tables.item.admission": {"min_count": 2},
        "tables.user.eviction": {"ttl_steps": 3},
    },
    export=True,
    evaluate=True,
)


@pytest.fixture(scope="session")
def trained_demo(tmp_path_factory):
    """(model dir, metrics) of the demo trained once with TRAINED for the whole session.

    Read it only: a test that trains, evaluates or exports into a model dir copies
    this one first (`shutil.copytree`)."""
    import recflow.api

    model_dir = tmp_path_factory.mktemp("trained_demo") / "model"
    metrics = recflow.api.train(DEMO, model_dir=str(model_dir), overrides=TRAINED)
    assert metrics["steps"] == 8 and metrics["export"] == str(model_dir / "export" / "8")
    return model_dir, metrics
