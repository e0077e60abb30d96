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
ENV = dict(os.environ, RECFLOW_PROBE="probe")
SHOW = "import os, sys; print(sys.argv, os.getcwd(), os.environ.get('RECFLOW_PROBE'), sys.path[0])"


@pytest.mark.parametrize("args", [
    ["-c", SHOW, "a", "--b"],
    ["-c", "import sys; sys.exit(3)"],
    ["-c", "import sys; sys.exit('a message')"],
    ["-c", "raise ValueError('boom')"],
    ["-c", "import sys; print(sys.stdin.read().upper())"],
    ["-m", "recflow.cli", "--version"],
    ["-m", "recflow.cli", "no-such-command"],
    ["SCRIPT", "x", "y"],
], ids=["argv-cwd-env", "exit-3", "exit-message", "exception", "stdin", "module", "module-error", "script"])
def test_a_child_runs_as_python_would(tmp_path, args):
    script = tmp_path / "script.py"
    script.write_text(SHOW + "\nassert __name__ == '__main__'\n")
    args = [PY, *(str(script) if a == "SCRIPT" else a for a in args)]
    want, got = (
        run(args, cwd=tmp_path, env=ENV, input="some text", capture_output=True, text=True, timeout=60)
        for run in (subprocess.run, procs.run)
    )
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
    assert got.stderr.splitlines()[-1:] == want.stderr.splitlines()[-1:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_signalled_child_ends_as_python_would(sig):
    args = [PY, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    codes = []
    for popen in (subprocess.Popen, procs.Popen):
        proc = popen(args, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "up\n"
        proc.send_signal(sig)
        codes.append(proc.wait(timeout=30))
        proc.stdout.close()
    assert codes == [-sig, -sig]


def test_pipes_streams_sessions_and_poll():
    child = procs.Popen([PY, "-c", "import os, sys, time; print(os.getsid(0) == os.getpid()); "
                         "print('to err', file=sys.stderr); time.sleep(0.3)"],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.01)
    out, err = child.communicate(timeout=30)
    assert (out, err, child.returncode) == (b"True\nto err\n", None, 0)
    assert child.poll() == 0


def test_pythonunbuffered_writes_each_print_at_once():
    child = procs.Popen([PY, "-c", "import time; print('now'); time.sleep(60)"],
                        env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, text=True)
    assert select.select([child.stdout], [], [], 30)[0], "the line stayed in the child's buffer"
    assert child.stdout.readline() == "now\n"
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.stdout.close()


def test_an_environment_that_changes_imports_gets_a_fresh_interpreter():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    assert isinstance(procs.Popen([PY, "-c", "pass"], env=env), subprocess.Popen)
    assert isinstance(procs.Popen([PY, "-u", "-c", "pass"]), subprocess.Popen)
    done = procs.run([PY, "-c", "import os; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])"],
                     env=env, capture_output=True, text=True)
    assert done.stdout == "0\n"


def test_a_child_starts_with_tensorflow_imported_by_the_zygote():
    child = procs.Popen([PY, "-c", "import sys; print('tensorflow' in sys.modules)"], stdout=subprocess.PIPE)
    assert isinstance(child, procs.Child)
    assert child.communicate(timeout=60) == (b"True\n", None)
