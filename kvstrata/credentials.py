"""Secrets: read from a private file or the environment, never from the config inline.

vLLM logs ``kv_connector_extra_config`` as given, so a secret written there is in
every engine's log. kvstrata reads secrets from a file only its owner can read
(:func:`read_secret_file`) or from an environment variable, and shows URLs with
their password replaced (:func:`redact_url`) wherever it prints one.

Threads: pure functions (plus the file read).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstrata.errors import ConfigError
from kvstrata.files import NotRegular, open_regular

__all__ = ["MIN_SECRET_BYTES", "MAX_SECRET_FILE_BYTES", "read_secret_file", "secrets_from_env", "redact_url",
           "url_has_password"]

MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 64 * 1024


def read_secret_file(path: str | os.PathLike[str], key: str, min_bytes: int = MIN_SECRET_BYTES) -> list[bytes]:
    """The secrets in ``path``, one per non-empty line (the first is the current one; the
    others are still accepted, for a rotation). Refused, with a ConfigError naming ``key``,
    unless ``path`` is a regular file of this user that nobody else can read or write,
    opened without following a link, of at most 64 KiB, whose every secret has at least
    ``min_bytes`` bytes. Never blocks on a FIFO."""
    p = Path(path).expanduser()
    try:
        fd, st = open_regular(p, follow=False)
    except NotRegular:
        raise ConfigError(f"{key}: {p} is not a regular file") from None
    except OSError as exc:
        raise ConfigError(f"{key}: cannot open {p}: {exc.strerror}") from None
    try:
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{key}: {p} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise ConfigError(f"{key}: {p} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"chmod 600 it")
        if st.st_size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(f"{key}: {p} holds {st.st_size:,} bytes; a secret file holds at most "
                              f"{MAX_SECRET_FILE_BYTES:,}")
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _secrets(data, f"{key} ({p})", min_bytes)


def secrets_from_env(name: str) -> list[bytes] | None:
    """The secrets in environment variable ``name`` (one per line), or None when it is unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    return _secrets(value.encode(), f"the environment variable {name}")


def _secrets(data: bytes, where: str, min_bytes: int = MIN_SECRET_BYTES) -> list[bytes]:
    out = [line.strip() for line in data.splitlines() if line.strip()]
    if not out:
        raise ConfigError(f"{where}: holds no secret")
    short = [i + 1 for i, s in enumerate(out) if len(s) < min_bytes]
    if short:  # the line number only: never the secret itself
        raise ConfigError(f"{where}: the secret on line {short[0]} is shorter than {min_bytes} bytes")
    return out


def url_has_password(url: str | None) -> bool:
    """Does ``url`` carry a password (in its user info or a ``password=`` option)?"""
    return url is not None and redact_url(url) != url


def redact_url(url: str | None) -> str:
    """``url`` with its password (and a user name that may be one) replaced by ``***``: what
    every log line, error and ``repr`` shows."""
    if url is None:
        return "None"
    import re

    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    tail = re.sub(r"(?i)(password=)[^&#]*", r"\1***", tail)  # redis-py also reads ?password=
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"
    return f"{scheme}://{netloc}{slash}{tail}"
