"""Reading files kvstrata did not write (regular files only, with a bound, never blocking),
and writing its JSON reports.

A path given by a user or found in a directory others can write may be a FIFO (an
``open`` that waits forever), a device (``/dev/zero``: endless), or a link to either.
:func:`read_bounded` opens without blocking, checks on the open descriptor that it is
a regular file, and refuses one larger than the caller's bound before reading it.

Threads: pure functions (plus the file read).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

__all__ = ["NotRegular", "open_regular", "read_bounded", "read_named", "write_json"]


class NotRegular(OSError):
    """The path is not a regular file, or is larger than allowed."""


def open_regular(path: str | os.PathLike[str], *, follow: bool = True) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``, when it is a regular file (a
    link is followed unless ``follow`` is False); ``NotRegular`` or ``OSError`` otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: str | os.PathLike[str], limit: int, *, follow: bool = True) -> bytes:
    """The bytes of the regular file ``path``, of at most ``limit`` bytes (``NotRegular``
    beyond it, before anything is read)."""
    fd, st = open_regular(Path(path), follow=follow)
    try:
        if st.st_size > limit:
            raise NotRegular(f"{path} holds {st.st_size:,} bytes, more than the {limit:,} allowed")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew meanwhile
        raise NotRegular(f"{path} holds more than the {limit:,} bytes allowed")
    return data


def read_named(path: str | os.PathLike[str], limit: int, what: str, kind: str) -> bytes:
    """The bytes of ``path``, a file a user named as a ``what`` ("config file", "model config")
    holding ``kind`` ("YAML", "JSON"): a regular file of at most ``limit`` bytes. Anything else
    is a one-line ``ConfigError`` naming the path."""
    from kvstrata.errors import ConfigError
    from kvstrata.system.values import format_size

    try:
        fd, _ = open_regular(path)  # a FIFO or a device is refused, never waited on
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except NotRegular:
        raise ConfigError(f"{path}: not a regular file; a {what} is a {kind} file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConfigError(f"{path}: larger than {format_size(limit)}; not a {what}")
    return data


def write_json(path: str, data: dict[str, Any]) -> None:
    """A report as indented JSON, to ``path`` or to standard output for ``-``."""
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")
