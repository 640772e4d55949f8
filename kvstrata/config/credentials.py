"""Secrets: read from a private file or the environment, never from the config inline.

vLLM logs ``kv_connector_extra_config`` as given, so a secret written there is in
every engine's log. kvstrata reads secrets from a file only its owner can read
(:func:`read_secret_file`) or from an environment variable, and shows URLs with
their password replaced (:func:`redact_url`) wherever it prints one.

A secret file holds one secret a line; blank lines and lines starting with ``#`` are
ignored. kvstrata's own secrets must resist guessing (:func:`secret_bits`, at least
:data:`MIN_SECRET_BITS`): a weak one is refused naming the file and the line, never the
secret. :func:`generate_secret` makes one that passes (``kvstrata remote secret``).

Threads: pure functions (plus the file read).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstrata.errors import ConfigError
from kvstrata.system.files import NotRegular, open_regular

__all__ = ["MIN_SECRET_BYTES", "MIN_SECRET_BITS", "MAX_SECRET_FILE_BYTES", "read_secret_file", "secrets_from_env",
           "redact_url", "url_has_password", "secret_bits", "generate_secret"]

MIN_SECRET_BYTES = 16
MIN_SECRET_BITS = 128
MAX_SECRET_FILE_BYTES = 64 * 1024


def read_secret_file(path: str | os.PathLike[str], key: str, min_bytes: int = MIN_SECRET_BYTES, *,
                     password: bool = False) -> list[bytes]:
    """The secrets in ``path``, one per line that is neither blank nor a ``#`` comment (the
    first is the current one; the others are still accepted, for a rotation). Refused, with
    a ConfigError naming ``key``, unless ``path`` is a regular file of this user that nobody
    else can read or write, opened without following a link, of at most 64 KiB, whose every
    secret has at least ``min_bytes`` bytes and resists guessing (:func:`secret_bits`).
    ``password``: a server's password (every non-blank line, as given; no strength rule:
    the server's operator chose it). Never blocks on a FIFO."""
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
    return _secrets(data, f"{key} ({p})", min_bytes, password=password)


def secrets_from_env(name: str) -> list[bytes] | None:
    """The secrets in environment variable ``name`` (one per line), or None when it is unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    return _secrets(value.encode(), f"the environment variable {name}")


def _secrets(data: bytes, where: str, min_bytes: int = MIN_SECRET_BYTES, *, password: bool = False) -> list[bytes]:
    lines = [(n, line.strip()) for n, line in enumerate(data.splitlines(), 1)]
    out = [(n, s) for n, s in lines if s and (password or not s.startswith(b"#"))]
    if not out:
        raise ConfigError(f"{where}: holds no secret")
    for n, s in out:  # the line number only: never the secret itself
        if len(s) < min_bytes:
            raise ConfigError(f"{where}: the secret on line {n} is shorter than {min_bytes} bytes")
        bits = secret_bits(s)
        if not password and bits < MIN_SECRET_BITS:
            raise ConfigError(f"{where}: the secret on line {n} is too easy to guess (about {bits:.0f} bits by "
                              f"kvstrata's estimate, at least {MIN_SECRET_BITS} needed: repeats, runs such as "
                              f"1234 and phrases count for little); `kvstrata remote secret` makes a strong one")
    return [s for _, s in out]


def secret_bits(secret: bytes) -> float:
    """A conservative estimate of how many guesses ``secret`` takes (log2). A character
    counts log2 of the secret's alphabet (the character classes it uses), only 2 bits when
    it is whitespace or in a word (a run of 4 letters or more in one case, or capitalised:
    phrases, however joined), and nothing when it repeats the one before, continues a run
    (``abcd``, ``4321``) or ends a 4-character sequence seen earlier. Random secrets of 32
    characters or more pass 128 bits."""
    import math
    import re

    classes = ((b"abcdefghijklmnopqrstuvwxyz", 26), (b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", 26), (b"0123456789", 10))
    alphabet = sum(size for chars, size in classes if any(c in chars for c in secret))
    alphabet += 33 if any(32 <= c < 127 and not chr(c).isalnum() for c in secret) else 0
    alphabet += 128 if any(c >= 127 or c < 32 for c in secret) else 0
    wordy = {i for m in re.finditer(rb"[A-Z]?[a-z]{4,}|[A-Z]{4,}|\s", secret) for i in range(m.start(), m.end())}
    seen: set[bytes] = set()
    bits = 0.0
    for i, c in enumerate(secret):
        gram = secret[i - 3:i + 1] if i >= 3 else b""
        repeated = gram in seen
        seen.add(gram)
        if i and abs(c - secret[i - 1]) <= 1 or repeated:
            continue
        bits += 2.0 if i in wordy else math.log2(max(2, alphabet))
    return bits


def generate_secret() -> bytes:
    """A new secret of 256 random bits (43 URL-safe characters) that :func:`secret_bits` passes."""
    import secrets

    while True:
        out = secrets.token_urlsafe(32).encode()
        if secret_bits(out) >= MIN_SECRET_BITS:  # the first draw, but for a one-in-billions string of runs
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
