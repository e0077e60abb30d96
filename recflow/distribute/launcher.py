"""`recflow launch`: a local multi-process PS cluster on loopback.

One process per task (PS tasks, workers and the chief), each a real TF gRPC
server started by `recflow train` with its own TF_CONFIG. The launcher writes
`MODEL_DIR/cluster.json` and one log per task under `MODEL_DIR/logs/`, and
supervises: a worker that dies is restarted (its steps run on the others in
the meantime); when a PS dies the whole cluster is restarted, and the chief
restores the last checkpoint and goes on. What the chief says to its user
(its `recflow: ...` lines: warnings, and the error it stops with) is relayed to
the launcher's standard error as it is logged. Every process it started is stopped
on success, failure or Ctrl-C, and dies with the launcher even when the
launcher is killed with -9 (`PR_SET_PDEATHSIG`).

Ctrl-C (SIGINT) or SIGTERM to the launcher stops the run as it stops `recflow train`:
the chief gets the signal and stops after its current step with a final checkpoint,
while the workers and PS tasks serve it; then they are stopped. The tasks run in
sessions of their own, so a terminal's Ctrl-C reaches the launcher alone (it reached
every task at once: the workers died mid-step and the chief, unable to finish its
step, was killed after the grace period without a checkpoint). A second signal, or
`STOP_GRACE` seconds, stops everything at once.

Privacy: TF's gRPC server always listens on every interface (0.0.0.0), and its
RPCs are unauthenticated. So every task runs in one private network namespace
that holds nothing but the loopback interface: the servers are reachable on
127.0.0.1 from the other tasks and from nowhere else. Without namespaces (no
root and no unprivileged user namespaces), `launch` refuses to start unless
RECFLOW_LAUNCH_PUBLIC=1 is set.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

from recflow.atomic import write_json
from recflow.errors import RecflowError
from recflow.layout import Layout

logger = logging.getLogger(__name__)

MAX_RESTARTS = 5
STOP_GRACE = 120.0  # seconds a signalled chief has to finish its step and checkpoint


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (bound together, then released)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _die_with_parent(parent: int) -> None:
    """In a child before exec: SIGKILL when the launcher dies (even by kill -9)."""
    _check(_libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _loopback_up() -> None:
    """Brings `lo` up in the current (new) network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _new_private_network(uid: int, gid: int) -> None:
    """In the namespace holder before exec: a new network namespace with only `lo`, up.

    As root a network namespace alone; otherwise a user namespace (mapping this
    user to root inside) around it.
    """
    libc = _libc()
    if libc.unshare(_CLONE_NEWNET) != 0:
        _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    _loopback_up()


class PrivateNetwork:
    """One network namespace with only loopback, shared by every task of a cluster.

    A short-lived holder process creates it; the launcher keeps file descriptors
    to it (which keep it alive) and each task joins it before exec.
    """

    def __init__(self):
        parent = os.getpid()
        uid, gid = os.getuid(), os.getgid()

        def setup():
            _die_with_parent(parent)
            _new_private_network(uid, gid)

        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=setup,
        )
        try:
            self.fds = []
            for kind in ("user", "net"):
                mine = os.stat(f"/proc/self/ns/{kind}").st_ino
                theirs = os.stat(f"/proc/{holder.pid}/ns/{kind}").st_ino
                if kind == "net" or theirs != mine:  # join a new user ns only if one was made
                    self.fds.append(os.open(f"/proc/{holder.pid}/ns/{kind}", os.O_RDONLY))
        finally:
            holder.stdin.close()
            holder.wait()

    def join(self) -> None:
        """In a child before exec: enter the namespace(s)."""
        libc = _libc()
        for fd in self.fds:
            _check(libc.setns(fd, 0), "setns")

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def private_network() -> PrivateNetwork | None:
    """The cluster's private network, or None when RECFLOW_LAUNCH_PUBLIC=1.

    Raises:
        RecflowError: namespaces are not available here.
    """
    if os.environ.get("RECFLOW_LAUNCH_PUBLIC") == "1":
        logger.warning("RECFLOW_LAUNCH_PUBLIC=1: the cluster's gRPC servers listen on every interface")
        return None
    try:
        return PrivateNetwork()
    except (OSError, subprocess.SubprocessError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if isinstance(e, OSError) and e.errno in (errno.EPERM, errno.EACCES):
            reason = "not permitted (needs root or unprivileged user namespaces)"
        raise RecflowError(
            "launch: cannot give the cluster a private network namespace "
            f"({reason}); TF's gRPC servers would listen on every interface, unauthenticated. "
            "Set RECFLOW_LAUNCH_PUBLIC=1 to run them anyway on a trusted network"
        ) from None


@dataclass
class Task:
    job: str
    index: int
    address: str
    process: subprocess.Popen | None = None
    restarts: int = 0
    log: object = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.job}-{self.index}"


class Cluster:
    """The processes of one local cluster.

    Args:
        train_args: `recflow train` arguments (config, --model-dir, --set ...).
        model_dir: where cluster.json and logs/ go.
        num_ps: parameter-server tasks.
        num_workers: worker tasks.
    """

    def __init__(self, train_args: list[str], model_dir: str, num_ps: int, num_workers: int):
        if num_ps < 1 or num_workers < 1:
            raise RecflowError("launch: --ps and --workers must be at least 1")
        self.train_args = train_args
        self.model_dir = model_dir
        ports = free_ports(1 + num_workers + num_ps)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        self.tasks = [Task("chief", 0, addresses[0])]
        self.tasks += [Task("worker", i, addresses[1 + i]) for i in range(num_workers)]
        self.tasks += [Task("ps", i, addresses[1 + num_workers + i]) for i in range(num_ps)]
        self.spec = {
            job: [t.address for t in self.tasks if t.job == job] for job in ("chief", "worker", "ps")
        }
        self.network: PrivateNetwork | None = None
        self._relayed = 0  # bytes of the chief's log read for `recflow:` lines
        self._partial = b""  # a line the chief has not finished writing

    def _env(self, task: Task) -> dict:
        tf_config = {"cluster": self.spec, "task": {"type": task.job, "index": task.index}}
        return dict(
            os.environ,
            TF_CONFIG=json.dumps(tf_config),
            TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            PYTHONUNBUFFERED="1",
        )

    def start(self, task: Task) -> None:
        logs = Layout(self.model_dir).logs_dir
        os.makedirs(logs, exist_ok=True)
        if task.log is None:
            task.log = open(os.path.join(logs, f"{task.name}.log"), "ab")  # noqa: SIM115
            if task.job == "chief":  # relay from its end: an earlier launch's lines are not
                self._relayed, self._partial = os.path.getsize(task.log.name), b""
        command = [sys.executable, "-m", "recflow.cli", "train", *self.train_args, "--quiet"]
        command += ["--set", "distribute.strategy=parameter_server"]
        parent, network = os.getpid(), self.network

        def before_exec():
            _die_with_parent(parent)
            if network is not None:
                network.join()

        task.process = subprocess.Popen(
            command, env=self._env(task), stdout=task.log, stderr=subprocess.STDOUT,
            preexec_fn=before_exec, start_new_session=True,  # a terminal's Ctrl-C is the launcher's
        )
        self.write_manifest()

    def _relay(self, chief: Task, ended: bool = False) -> None:
        """Copies the `recflow: ...` lines the chief logged since the last call to standard
        error (every incarnation of the chief appends to one log)."""
        try:
            with open(chief.log.name, "rb") as f:
                f.seek(self._relayed)
                data = f.read()
        except FileNotFoundError:
            return
        self._relayed += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if ended:
            lines, self._partial = [*lines, self._partial], b""
        for line in lines:
            if line.startswith((b"recflow: ", b"stopped at step ")):
                print(line.decode("utf-8", "replace").rstrip(), file=sys.stderr, flush=True)

    def write_manifest(self) -> None:
        write_json(
            Layout(self.model_dir).cluster_path,
            {
                "tasks": [
                    {"job": t.job, "index": t.index, "address": t.address,
                     "pid": t.process.pid if t.process else None}
                    for t in self.tasks
                ]
            },
        )

    def stop(self) -> None:
        """Stops every process this cluster started (SIGTERM, then SIGKILL)."""
        alive = [t for t in self.tasks if t.process and t.process.poll() is None]
        for t in alive:
            t.process.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for t in alive:
            try:
                t.process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                t.process.kill()
                t.process.wait()
        for t in self.tasks:
            if t.log is not None:
                t.log.close()
                t.log = None
        if self.network is not None:
            self.network.close()
            self.network = None

    def _start_all(self) -> None:
        """Starts every task: the PS tasks, the workers, then the chief. The chief takes
        the model dir's lock and clears the stale temp files there as it starts, and the
        launcher writes `cluster.json` (through a temp file) after each start: started
        last, the chief cannot remove one of those mid-write."""
        order = {"ps": 0, "worker": 1, "chief": 2}
        for task in sorted(self.tasks, key=lambda t: order[t.job]):
            self.start(task)

    @staticmethod
    def _failed(task: Task) -> None:
        """Counts a failure of `task`; too many stop the launch."""
        task.restarts += 1
        if task.restarts > MAX_RESTARTS:
            raise RecflowError(f"launch: {task.name} failed {MAX_RESTARTS} times; see logs/{task.name}.log")

    @staticmethod
    def _announce(message: str) -> None:
        logger.warning("%s", message)  # the CLI prints it once: `recflow: warning: ...`

    def _restart(self, task: Task, why: str) -> None:
        self._failed(task)
        self._announce(f"{task.name} {why}; restarting it")
        self.start(task)

    def _restart_cluster(self, dead_ps: list[Task]) -> None:
        """Restarts every task after a PS died; the chief restores the last checkpoint.

        A restarted PS is empty, and the tasks that lived on hold state of the lost
        incarnation: the chief's model, workers' in-flight steps that may wait on the
        dead PS forever once a new server answers at its address, and on the other PS
        tasks the old session's tables (a second copy of every shard until TF drops
        the old context). Workers and PS tasks hold nothing a checkpoint does not, so
        the whole cluster starts over from it, servers first.
        """
        for t in dead_ps:
            self._failed(t)
        why = ", ".join(f"{t.name} exited with {t.process.returncode}" for t in dead_ps)
        self._announce(f"{why}; restarting the cluster from the last checkpoint")
        for t in self.tasks:
            if t.process.poll() is None:
                t.process.kill()
                t.process.wait()
        self._start_all()

    def run(self, poll_seconds: float = 0.2) -> int:
        """Starts the cluster and supervises it until the chief finishes; returns its exit
        code (130 or 143 when a signal stopped the run)."""
        self.network = private_network()
        signals: list[int] = []
        previous = {s: signal.signal(s, lambda signum, _: signals.append(signum))
                    for s in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
        try:
            self._start_all()
            chief = self.tasks[0]
            while True:
                time.sleep(poll_seconds)
                self._relay(chief)
                if signals:
                    return self._stop_chief(chief, signals)
                dead_ps = [t for t in self.tasks if t.job == "ps" and t.process.poll() is not None]
                if dead_ps:
                    self._restart_cluster(dead_ps)
                    continue
                for t in self.tasks:
                    if t.job == "worker" and t.process.poll() is not None:
                        self._restart(t, f"exited with {t.process.returncode}")
                code = chief.process.poll()
                if code is not None:
                    self._relay(chief, ended=True)
                    return code
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.stop()

    def _stop_chief(self, chief: Task, signals: list[int]) -> int:
        """Passes the launcher's first signal on to the chief and waits, relaying its lines,
        until it has stopped after its step and checkpointed (the other tasks still serve
        it); a second signal or `STOP_GRACE` seconds end the wait. Returns its exit code."""
        received = len(signals)
        if chief.process.poll() is None:
            chief.process.send_signal(signals[0])
        deadline = time.time() + STOP_GRACE
        while chief.process.poll() is None and len(signals) == received and time.time() < deadline:
            time.sleep(0.1)
            self._relay(chief)
        self._relay(chief, ended=True)
        code = chief.process.poll()
        return 128 + signals[0] if code is None else code
