"""A slow server, for real: a TCP proxy on loopback in front of a real one, whose answers
(server to client) flow at ``bps`` bytes per second over all connections together, as a
shared server with little bandwidth left would deliver them; requests pass at once.

    with SlowProxy(server.port, bps=6 << 20) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
"""

from __future__ import annotations

import socket
import threading
import time

from valkey_server import free_port

__all__ = ["SlowProxy"]


class SlowProxy:
    def __init__(self, target_port: int, bps: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.bps = int(bps)
        self.port = free_port()
        self._sock = socket.create_server((host, self.port))
        self._lock = threading.Lock()
        self._next = time.monotonic()  # when the shared link is free again
        self._closed = False
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "SlowProxy":
        t = threading.Thread(target=self._accept, daemon=True, name="slow-proxy")
        t.start()
        self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for src, dst, slow in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, slow), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while True:
                data = src.recv(64 * 1024)
                if not data:
                    break
                if slow:
                    self._wait(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _wait(self, nbytes: int) -> None:
        """Hold ``nbytes`` until the shared link has carried them at ``bps``."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.bps
            until = self._next
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)
