"""tests/procs.py: a zygote's child does what a fresh `python` does with the same
arguments. Fresh interpreters started by `subprocess` are the reference."""

import os
import select
import signal
import subprocess
import sys

import procs
import pytest

PY = sys.executable
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "child_probe.py")
ENV = dict(os.environ, RECFLOW_PROBE="probe")


@pytest.mark.parametrize("args", [
    [PROBE, "show", "a", "--b"],
    [PROBE, "exit", "3"],
    [PROBE, "exit-message"],
    [PROBE, "raise"],
    [PROBE, "stdin"],
    ["-c", "raise SystemExit(4)"],
    ["-m", "recflow.cli", "--version"],
    ["-m", "recflow.cli", "no-such-command"],
], ids=["argv-cwd-env", "exit-3", "exit-message", "exception", "stdin", "code", "module", "module-error"])
def test_a_child_runs_as_python_would(tmp_path, args):
    want, got = (
        run([PY, *args], cwd=tmp_path, env=ENV, input="some text", capture_output=True, text=True, timeout=60)
        for run in (subprocess.run, procs.run)
    )
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
    assert got.stderr.splitlines()[-1:] == want.stderr.splitlines()[-1:]


def test_input_a_child_never_reads_is_dropped_as_subprocess_drops_it():
    big = "x" * (1 << 20)  # more than a pipe holds: the write fails once the child is gone
    want, got = (
        run([PY, PROBE, "exit", "5"], input=big, capture_output=True, text=True, timeout=60)
        for run in (subprocess.run, procs.run)
    )
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr) == (5, "", "")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_signalled_child_ends_as_python_would(sig):
    codes = []
    for popen in (subprocess.Popen, procs.Popen):
        proc = popen([PY, PROBE, "sleep"], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "up\n"
        proc.send_signal(sig)
        codes.append(proc.wait(timeout=30))
        proc.stdout.close()
    assert codes == [-sig, -sig]


def test_pipes_streams_sessions_and_poll():
    child = procs.Popen([PY, PROBE, "session"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, start_new_session=True)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.01)
    out, err = child.communicate(timeout=30)
    assert (out, err, child.returncode) == (b"True\nto err\n", None, 0)
    assert child.poll() == 0


def test_pythonunbuffered_writes_each_print_at_once():
    child = procs.Popen([PY, PROBE, "unflushed"], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                        stdout=subprocess.PIPE, text=True)
    assert select.select([child.stdout], [], [], 30)[0], "the line stayed in the child's buffer"
    assert child.stdout.readline() == "now\n"
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.stdout.close()


def test_an_environment_that_changes_imports_gets_a_fresh_interpreter():
    env = dict(ENV, TF_CPP_MIN_LOG_LEVEL="0")
    for fresh in (procs.Popen([PY, PROBE, "modules"], env=env), procs.Popen([PY, "-u", PROBE, "modules"])):
        assert isinstance(fresh, subprocess.Popen)
        fresh.wait(timeout=60)
    # ... started with that environment (the probe prints RECFLOW_PROBE from it).
    want, got = (run([PY, PROBE, "show"], env=env, capture_output=True, text=True, timeout=60)
                 for run in (subprocess.run, procs.run))
    assert got.stdout == want.stdout and " probe " in got.stdout


def test_a_child_starts_with_tensorflow_imported_by_the_zygote():
    child = procs.Popen([PY, PROBE, "modules"], stdout=subprocess.PIPE)
    assert isinstance(child, procs.Child)
    assert child.communicate(timeout=60) == (b"True\n", None)
