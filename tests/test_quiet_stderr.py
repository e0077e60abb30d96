"""A run keeps TensorFlow's noise to itself: a run with XLA prints nothing on stderr
(absl's `I0000 ... XLA service` lines came through before) and leaves nothing in the
temp dir (AutoGraph's generated modules stayed there: the CLI's fast exit skipped
their removal). And the CLI's TensorFlow import loads no more than it needs."""

import json
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def test_an_xla_run_prints_nothing_on_stderr_and_leaves_no_temp_files(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RECFLOW_DEBUG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["TMPDIR"] = str(tmp_path / "tmp")  # the run's temp dir (Python's tempfile reads it)
    os.mkdir(env["TMPDIR"])
    done = subprocess.run(
        [sys.executable, "-m", "recflow.cli", "train", "configs/deepfm_demo.yaml", "--quiet",
         "--model-dir", str(tmp_path / "m"), "--set", "data.synthetic={rows: 2000, eval_rows: 200}",
         "--set", "train.epochs=1", "--set", "train.xla=true",
         "--set", "model.params={dnn: {hidden_units: [8]}}"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "model dir:" in done.stdout
    assert os.listdir(env["TMPDIR"]) == []


def test_the_clis_tensorflow_import_leaves_out_pandas_and_setuptools_and_freezes_its_objects():
    # tf_keras imports pandas only for DataFrames in `Model.fit`; TensorFlow imports
    # distutils, which setuptools' shim would serve by importing setuptools and
    # pkg_resources. Neither is used: 0.25-0.3 and 0.1 s of every command's start.
    # TensorFlow's and tf_keras' objects are frozen out of the collector's full passes
    # (0.5 s of a training job), which stays on and still collects what comes after.
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "cli_tensorflow_import.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    frozen = loaded.pop("frozen")
    assert frozen > 100_000  # TensorFlow's import alone leaves about 300,000 objects
    assert loaded == {
        "pandas": False, "setuptools": False, "pkg_resources": False, "tf.lite": True,
        "gc enabled": True, "tensorflow tracked": False, "collected": 1,
    }


def test_a_retrieval_run_prints_nothing_on_stderr(tmp_path):
    """The in-batch candidates' integer reduce made oneDNN log `E ... oneDNN supports
    DT_INT64 only on platforms with AVX-512` on every two-tower run."""
    env = {k: v for k, v in os.environ.items() if k != "RECFLOW_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "recflow.cli", "train", "configs/two_tower.yaml", "--quiet",
         "--model-dir", str(tmp_path / "m"), "--set", "train.epochs=null", "--set", "train.steps=3"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_a_config_naming_a_users_module_prints_nothing_on_stderr(tmp_path):
    """The user's module imported TensorFlow while the config was read, before the CLI's
    quiet import: the cuFFT/cuDNN/cuBLAS factory lines reached the terminal."""
    extensions = os.path.join(os.path.dirname(__file__), "extensions")
    env = {k: v for k, v in os.environ.items() if k != "RECFLOW_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([extensions, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "recflow.cli", "plan", "configs/deepfm_demo.yaml",
         "--set", 'train.sparse_optimizer={type: "my_extensions:MomentumSGD", momentum: 0.5}'],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
