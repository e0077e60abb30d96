"""`subprocess.Popen` and `subprocess.run` for the tests' `python ...` commands, forked
from a zygote instead of started fresh.

About 3 CPU seconds of every `python -m recflow.cli ...` start is importing TensorFlow,
tf_keras and recflow before recflow's first own line runs, and the suite starts dozens
of such processes on two cores. A `Zygote` pays that once per test process: it is a
Python that imports those modules and then forks a child for each command, the way
Android's zygote and Python's `multiprocessing` forkserver start processes.

A child is a real process with its own pid, standard streams, working directory,
environment, session and exit status, and it runs what `python ARGS` would run for the
same arguments (`-m module`, `-c code` or a script): tests signal it, kill -9 it and
read its pipes as they would a `subprocess.Popen`'s. What a child cannot show is what
happens while those modules are first imported. So a command whose environment would
change an import (`SAME_AT_IMPORT`) gets a fresh interpreter from `Popen` and `run`,
and tests about start-up itself (what an import prints, a process that must not
import recflow or TensorFlow) call `subprocess` directly.

Forking is safe because the zygote never runs a TensorFlow op, so it has no threads of
TensorFlow's: importing it starts none, and the two pools that numpy and pyarrow start
at import (OpenBLAS, jemalloc) re-create themselves after a fork.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

# What the zygote imports before its first fork: what every recflow command loads.
PRELOAD = ("recflow", "tensorflow", "tf_keras", "recflow.api", "recflow.cli")

# Environment variables read while those modules import. A command that gives one of
# them another value than the zygote had cannot be forked from it.
SAME_AT_IMPORT = ("TF_CPP_MIN_LOG_LEVEL", "TF_USE_LEGACY_KERAS", "TF_ENABLE_ONEDNN_OPTS",
                  "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                  "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RECFLOW_DEBUG")


class Zygote:
    """A Python process that has imported `PRELOAD` and forks children that run commands.

    It has this process's environment, and ends with `close()` or when this process
    ends; children that outlive it keep running.
    """

    def __init__(self):
        self.env = dict(os.environ)
        self._dir = tempfile.mkdtemp(prefix="recflow-zygote-")
        self._socket = os.path.join(self._dir, "socket")
        self._process = subprocess.Popen([sys.executable, __file__, self._socket],
                                         stdin=subprocess.PIPE, env=self.env)

    def forkable(self, args: list[str], env: dict | None = None) -> bool:
        """Whether a child of this zygote runs `args` as a fresh `python` would: `args` is
        this interpreter and `-m`, `-c` or a script (no interpreter options), and `env`
        imports the preloaded modules as the zygote's environment did."""
        if len(args) < 2 or args[0] != sys.executable:
            return False
        if args[1].startswith("-") and args[1] not in ("-m", "-c"):
            return False
        env = os.environ if env is None else env
        return all(env.get(name) == self.env.get(name) for name in SAME_AT_IMPORT)

    def popen(self, args: list[str], *, env: dict | None = None, cwd: str | None = None,
              stdin=None, stdout=None, stderr=None, text: bool = False,
              start_new_session: bool = False) -> Child:
        """Starts `args` (which `forkable` accepts) as a child; `stdin`, `stdout` and
        `stderr` take what `subprocess.Popen` takes: None, a file or descriptor, PIPE,
        DEVNULL, or STDOUT for stderr."""
        if not self.forkable(args, env):
            raise ValueError(f"a zygote cannot run {args[:3]} with this environment")
        request = {"argv": args[1:], "env": dict(os.environ if env is None else env),
                   "cwd": os.path.abspath(cwd or os.getcwd()), "new_session": start_new_session}
        child_fds, ours, ends = _streams(stdin, stdout, stderr)
        try:
            conn = self._connect()
            body = json.dumps(request).encode()
            socket.send_fds(conn, [struct.pack("!I", len(body))], child_fds)
            conn.sendall(body)
        except BaseException:
            for fd in ends:
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in ours:
                os.close(fd)
        return Child(args, conn, ends, text)

    def run(self, args: list[str], *, check: bool = False, capture_output: bool = False,
            timeout: float | None = None, input=None, **kwargs) -> subprocess.CompletedProcess:
        """`subprocess.run` for a child of this zygote."""
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        child = self.popen(args, **kwargs)
        try:
            out, err = child.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        if check and child.returncode:
            raise subprocess.CalledProcessError(child.returncode, args, out, err)
        return subprocess.CompletedProcess(args, child.returncode, out, err)

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        """Ends the zygote (not its children)."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if os.path.exists(self._socket):
            os.unlink(self._socket)
        if os.path.isdir(self._dir):
            os.rmdir(self._dir)

    def _connect(self) -> socket.socket:
        """A connection to the zygote, waiting while it imports (a few seconds)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 300
        while True:
            try:
                conn.connect(self._socket)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    conn.close()
                    raise OSError(f"the zygote did not start (exit code {self._process.poll()})") from None
                time.sleep(0.02)


class Child:
    """A process a `Zygote` started: the `subprocess.Popen` calls that apply to it.

    The zygote is its parent, so its exit status comes over the connection its start
    was asked on; its pid is real, and signals go to it directly."""

    def __init__(self, args, conn: socket.socket, ends, text: bool):
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        modes = ("w", "r", "r") if text else ("wb", "rb", "rb")
        self.stdin, self.stdout, self.stderr = (
            None if fd is None else os.fdopen(fd, mode, encoding="utf-8" if text else None)
            for fd, mode in zip(ends, modes))
        kind, value = _read_line(conn).split(" ", 1)
        if kind != "pid":
            conn.close()
            raise OSError(f"the zygote could not start {args[:3]}: {value.strip()}")
        self.pid = int(value)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish()
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        read: dict[str, object] = {}

        def drain(stream, name):
            read[name] = stream.read()

        readers = [threading.Thread(target=drain, args=(s, n), daemon=True)
                   for s, n in ((self.stdout, "out"), (self.stderr, "err")) if s is not None]
        for r in readers:  # reading before writing: a child that answers first cannot block
            r.start()
        if self.stdin is not None:
            # A child that exits without reading its input: ignored, as subprocess does. The
            # close (which flushes) apart, so the pipe end is closed even after a failed write.
            with contextlib.suppress(BrokenPipeError):
                if input is not None:
                    self.stdin.write(input)
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout

        def left():
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for r in readers:
            r.join(left())
            if r.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(left())
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        return read.get("out"), read.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in (self.stdin, self.stdout, self.stderr):
            if s is not None:
                with contextlib.suppress(BrokenPipeError):
                    s.close()
        self.wait()

    def _finish(self) -> None:
        self.returncode = int(_read_line(self._conn).split()[1])
        self._conn.close()


def _streams(stdin, stdout, stderr):
    """(the child's three descriptors, the ones this side closes once they are sent,
    this side's pipe ends or None)."""
    child, ours, ends = [], [], []
    for i, spec in enumerate((stdin, stdout, stderr)):
        end = None
        if spec is None:
            fd = i
        elif spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            ours.append(fd)
        elif spec == subprocess.PIPE:
            r, w = os.pipe()
            fd, end = (r, w) if i == 0 else (w, r)
            ours.append(fd)
        elif spec == subprocess.STDOUT:
            fd = child[1]
        else:
            fd = spec if isinstance(spec, int) else spec.fileno()
        child.append(fd)
        ends.append(end)
    return child, ours, ends


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise OSError(f"the zygote closed the connection (read: {data!r})")
        data += chunk
    return data.decode()


# ----------------------------------------------------------------------------- the zygote's side


def _serve(path: str) -> None:
    """Imports `PRELOAD`, then forks a child per request and reports its pid and exit
    status on the request's connection; returns when stdin closes (its owner is gone)."""
    import importlib

    from recflow.quiet import native_stderr_silenced

    with native_stderr_silenced():  # TF's import-time lines, as `recflow.cli` hides them
        for name in PRELOAD:
            importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    owner = sys.stdin.fileno()
    children: dict[int, socket.socket] = {}
    while True:
        ready = select.select([listener, wake_r, owner], [], [])[0]
        if wake_r in ready:
            _drain(wake_r)
            _reap(children)
        if owner in ready and not os.read(owner, 512):
            return
        if listener in ready:
            conn, _ = listener.accept()
            fds = []
            try:
                header, fds, _, _ = socket.recv_fds(conn, 4, 3)
                request = json.loads(_recv_exactly(conn, struct.unpack("!I", header)[0]))
                pid = os.fork()
            except Exception as e:  # noqa: BLE001  (told to the asker, who raises it)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"error {type(e).__name__}: {e}\n".encode())
                conn.close()
                continue
            if pid == 0:
                listener.close()
                conn.close()
                for fd in (wake_r, wake_w, owner):
                    os.close(fd)
                _become(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _reap(children: dict[int, socket.socket]) -> None:
    """Tells each ended child's asker its exit code (negative: the signal that ended it)."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid)
        try:
            conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:  # the asker is gone
            pass
        conn.close()


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the request ended early")
        data += chunk
    return data


def _become(request: dict, fds: list[int]) -> None:
    """In a new child: become `python ARGV` with the request's streams, directory and
    environment, run it, and exit as python would. Never returns."""
    import atexit
    import io
    import runpy
    import traceback

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8")  # noqa: SIM115
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False),  # noqa: SIM115
                         encoding="utf-8", errors=errors, write_through=unbuffered,
                         line_buffering=os.isatty(fd))
        for fd, errors in ((1, "strict"), (2, "backslashreplace")))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:1] = [os.getcwd(), *extra]
            sys.modules.pop(argv[1], None)  # `python -m` runs it as __main__, not as itself
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:1] = ["", *extra]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            sys.argv = list(argv)
            sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001  (printed, as python prints it)
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as python does at exit: join the other threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code == -signal.SIGINT:  # as python does: die of the interrupt that stopped it
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


# ----------------------------------------------------------------------------- what tests call

_zygote: Zygote | None = None


def _the_zygote() -> Zygote:
    global _zygote
    if _zygote is None or not _zygote.alive():
        _zygote = Zygote()
        atexit.register(_zygote.close)
    return _zygote


def Popen(args, **kwargs):  # noqa: N802  (stands in for subprocess.Popen)
    """A zygote's child running `args`, or a fresh process where it cannot be one."""
    zygote = _the_zygote()
    if zygote.forkable(args, kwargs.get("env")):
        return zygote.popen(args, **kwargs)
    return subprocess.Popen(args, **kwargs)


def run(args, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` for a zygote's child, or a fresh process where it cannot be one."""
    zygote = _the_zygote()
    if zygote.forkable(args, kwargs.get("env")):
        return zygote.run(args, **kwargs)
    return subprocess.run(args, **kwargs)


if __name__ == "__main__":
    _serve(sys.argv[1])
