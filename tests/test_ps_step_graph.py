"""What a parameter-server worker's step sends to the PS: the dense optimizer runs on the
PS, so only the dense gradients cross, packed into one tensor; with prefetching, the
next batch's rows stay on the PS (staged there), so no packed rows cross in a loop
variable or a step's result.

The step is traced in a separate process connected to a real in-process PS server
(connecting changes the process's device names, which the other test modules share).
"""

import json
import os
import sys

import procs
import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
SCRIPT = os.path.join(SCRIPTS, "ps_step_graph_report.py")
RUN_ON_A_WORKER = os.path.join(SCRIPTS, "ps_prefetch_on_a_worker.py")


def _run(script):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = procs.run(
        [sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report():
    return _run(SCRIPT)


def test_dense_update_runs_on_the_ps_and_receives_one_packed_gradient(report):
    # The demo DeepFM has several dense variables, all on the PS.
    assert report["variables"] > 2 and report["remote_variables"] == report["variables"]
    assert report["update_ops"] > 0
    # On the worker only the packing: the gradients flattened and concatenated.
    assert set(report["local_ops"]) <= {"Reshape", "ConcatV2", "Const"}, report
    # Into the PS: one tensor, the packed gradients (not one per variable, nor slot reads).
    assert report["crossing"] == ["ConcatV2"] and report["crossing_count"] == 1, report


def test_prefetched_rows_stay_on_the_ps(report):
    """A tensor leaving a loop, a branch or a call goes through the worker: the loop may
    carry the batches' keys (int64 [U, 2], the worker's) but no packed rows (float32
    [U, width]), and a prefetching step returns only scalars (its loss and the staging
    token), not what it wrote."""
    carried = [tuple(x) for x in report["loop_carried"]]
    assert ("int64", 2) in carried  # the next batch's keys: the loop is the prefetching one
    assert ("float32", 2) not in carried, carried
    assert [rank for _, rank in report["step_outputs"]] == [0, 0], report["step_outputs"]


def test_a_remote_worker_prefetching_into_its_slot_trains_as_without_prefetch():
    """The chunk on a remote worker, its rows staged in slot 1 of 2 on the PS (the picked
    variable handle, the bit-cast matrix): the same rows, slots and weights as without
    prefetching, to float rounding."""
    result = _run(RUN_ON_A_WORKER)
    assert result["steps"] == [4, 4] and result["keys"] > 0
    assert result["max_diff"] < 1e-5, result
