"""A TCP server on a free loopback port that answers every connection with one fixed reply
(a server that is not Redis, or a broken one), for the remote tier's failure tests."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator


@contextlib.contextmanager
def answering(reply: bytes) -> Iterator[int]:
    """Yield the port of a server that reads a request and sends ``reply`` to each connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def answer() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(1024)
            conn.sendall(reply)
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()
