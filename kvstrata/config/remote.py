"""``remote.*``: the shared tier on a Redis or Valkey server, and where its secrets come from.

Every error is a :class:`~kvstrata.errors.ConfigError` naming the key; a URL is shown
with its password redacted.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvstrata.errors import ConfigError
from kvstrata.system.values import (check_keys, duration_s, integer, one_of, parse_size, path_or_none, short_repr,
                             tier_admission)

__all__ = ["RemoteConfig", "REMOTE_SCHEMES", "REMOTE_SECRET_ENV"]


REMOTE_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


REMOTE_SECRET_ENV = "KVSTRATA_REMOTE_SECRET"


def _remote_url(v: Any, path: str) -> str | None:
    """``redis://[user:password@]host:port[/db]``, ``rediss://`` (TLS), ``unix:///socket``
    (``valkey://`` and ``valkeys://`` are read as ``redis://`` and ``rediss://``), or None.
    Errors show the URL with its password redacted."""
    from kvstrata.config.credentials import redact_url

    if v is None:
        return None
    if not isinstance(v, str) or any(c.isspace() for c in v):
        raise ConfigError(f"{path}: expected a URL like redis://host:6379/0, got {short_repr(redact_url(v))}")
    from urllib.parse import urlsplit

    try:
        u = urlsplit(v)
        port = u.port
    except ValueError as exc:
        raise ConfigError(f"{path}: {redact_url(str(exc))}: {short_repr(redact_url(v))}") from None
    if u.scheme not in REMOTE_SCHEMES:
        raise ConfigError(f"{path}: expected a scheme among {', '.join(REMOTE_SCHEMES)}; "
                          f"got {short_repr(redact_url(v))}")
    if u.scheme == "unix":
        if not u.path:
            raise ConfigError(f"{path}: a unix:// URL names a socket file (unix:///run/valkey.sock), "
                              f"got {short_repr(redact_url(v))}")
        return v
    if not u.hostname:
        raise ConfigError(f"{path}: no host in {short_repr(redact_url(v))} (expected redis://host:6379/0)")
    db = u.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"{path}: the path names a database number (redis://host:6379/0), "
                          f"got {short_repr(redact_url(v))}")
    del port
    return v


@dataclass(frozen=True)
class RemoteConfig:
    """A shared tier on a Redis or Valkey server (``url`` null: none).

    ``capacity``: what kvstrata may use of the server (None: the server's ``maxmemory``;
    the server bounds the store itself with ``maxmemory`` and ``allkeys-lru``, kvstrata
    reports both and warns when the capacity exceeds it; ``kvstrata bench`` sizes its model
    of the shared tier with it). ``timeout``: the deadline of one round trip (a lookup that cannot answer
    in time is a miss). ``queue_capacity``: bytes waiting to be written (beyond it puts
    are dropped and counted). ``batch_bytes``: values per pipelined round trip.
    ``secret_file``: the deployment's secrets (one per line, the first signs; a file only
    its owner can read), which every value is signed with; else the environment variable
    ``KVSTRATA_REMOTE_SECRET``; blank and ``#`` lines are ignored, a secret that is easy to
    guess is refused (``kvstrata remote secret`` makes one). ``encrypt``: values are
    encrypted and authenticated (AES-256-GCM; the default), else only signed (whoever
    can read the server can read the KV, and from it the prompts' tokens).
    ``trust_server``: run without a secret (values neither signed nor encrypted:
    whoever can write to the server can have their bytes served). ``password_file``: the
    server's password (first line; else ``REDISCLI_AUTH``), so that none is inline in the URL.
    """

    url: str | None = None
    cluster: bool = False
    secret_file: str | None = None
    trust_server: bool = False
    encrypt: bool = True
    password_file: str | None = None
    capacity: int | None = None
    compression: str = "auto"
    level: int = 1
    timeout: float = 0.5
    connect_timeout: float = 1.0
    queue_capacity: int = 256 * 1024**2
    batch_bytes: int = 8 * 1024**2
    admission: str = "always"
    ghost_keys: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "remote") -> "RemoteConfig":
        check_keys(d, ("url", "cluster", "capacity", "compression", "level", "timeout", "connect_timeout",
                        "queue_capacity", "batch_bytes", "secret_file", "trust_server", "password_file",
                        "admission", "ghost_keys", "encrypt"), p)
        cluster, trust, encrypt = d.get("cluster", False), d.get("trust_server", False), d.get("encrypt", True)
        for key, flag in (("cluster", cluster), ("trust_server", trust), ("encrypt", encrypt)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{p}.{key}: expected true or false, got {short_repr(flag)}")
        secret_file, password_file = path_or_none(d, "secret_file", p), path_or_none(d, "password_file", p)
        batch = parse_size(d.get("batch_bytes", cls.batch_bytes), f"{p}.batch_bytes")
        if batch < 64 * 1024:
            raise ConfigError(f"{p}.batch_bytes: expected at least 64KiB, got {short_repr(d.get('batch_bytes'))}")
        return cls(url=_remote_url(d.get("url"), f"{p}.url"), cluster=cluster, secret_file=secret_file,
                   trust_server=trust, encrypt=encrypt, password_file=password_file,
                   capacity=None if d.get("capacity") is None else parse_size(d["capacity"], f"{p}.capacity"),
                   compression=one_of(d.get("compression", "auto"), f"{p}.compression", ("auto", "zstd", "none")),
                   level=integer(d.get("level", 1), f"{p}.level", minimum=-7, maximum=22),
                   timeout=duration_s(d.get("timeout", cls.timeout), f"{p}.timeout", minimum=0.001, maximum=60),
                   connect_timeout=duration_s(d.get("connect_timeout", cls.connect_timeout), f"{p}.connect_timeout",
                                            minimum=0.001, maximum=60),
                   queue_capacity=parse_size(d.get("queue_capacity", cls.queue_capacity), f"{p}.queue_capacity"),
                   batch_bytes=batch, **tier_admission(d, p))

    @property
    def enabled(self) -> bool:
        return self.url is not None and self.capacity != 0

    def secrets(self) -> list[bytes] | None:
        """The secrets values are signed with (``secret_file``, else ``KVSTRATA_REMOTE_SECRET``);
        None with ``trust_server``. A ConfigError naming ``remote.secret_file`` when there is
        none: a server anyone can write to would otherwise have its bytes served as KV."""
        from kvstrata.config.credentials import read_secret_file, secrets_from_env

        if self.secret_file is not None:
            return read_secret_file(self.secret_file, "remote.secret_file")
        found = secrets_from_env(REMOTE_SECRET_ENV)
        if found is not None:
            return found
        if self.trust_server:
            return None
        raise ConfigError(f"remote.secret_file: the remote tier signs its values with a secret: set "
                          f"remote.secret_file (a file only its owner can read) or {REMOTE_SECRET_ENV}, or set "
                          f"remote.trust_server: true if only trusted processes can write to the server")

    def password(self) -> str | None:
        """The server's password from ``password_file`` (else ``REDISCLI_AUTH``); None: the URL's own."""
        from kvstrata.config.credentials import read_secret_file

        if self.password_file is not None:
            return read_secret_file(self.password_file, "remote.password_file", min_bytes=1, password=True)[0].decode()
        return os.environ.get("REDISCLI_AUTH") or None

    def __repr__(self) -> str:  # the URL's password is never shown
        from kvstrata.config.credentials import redact_url

        fields = ", ".join(f"{f.name}={redact_url(v) if f.name == 'url' else v!r}"
                           for f in dataclasses.fields(self) for v in (getattr(self, f.name),))
        return f"RemoteConfig({fields})"
