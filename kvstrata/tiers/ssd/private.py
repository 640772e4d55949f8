"""Files the SSD tier keeps in its directory, opened only when they are provably its own.

A path check before ``open`` cannot tell a planted file from the tier's: a hard link is a
regular file with its victim's owner, and a symbolic link can appear between the check
and the open. So every file kvstrata writes is opened without following links and without
truncating, then checked on the open descriptor (``fstat``): a regular file of this user
with exactly one name. Only then is it truncated, if asked. Whoever could plant a link
in the directory would otherwise have an open of the tier truncate, chmod or overwrite
a file of their choosing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstrata.errors import ConfigError

__all__ = ["open_private", "check_private"]


def check_private(st: os.stat_result, path: Path, what: str = "path") -> None:
    """A ConfigError naming ``what`` and ``path`` unless ``st`` is a regular file of this user
    with one name."""
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what}: {path} is not a regular file (a symbolic link?); refusing it")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what}: {path} belongs to uid {st.st_uid}, not to this user "
                          f"({os.geteuid()}); refusing to keep KV there")
    if st.st_nlink != 1:
        raise ConfigError(f"{what}: {path} has {st.st_nlink} names (a hard link to a file elsewhere?); "
                          "refusing to write to it")


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` for a file of the tier: never through a link, refused (ConfigError naming
    the file) unless it is the tier's own; ``O_TRUNC`` only after that check."""
    truncate = bool(flags & os.O_TRUNC)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise ConfigError(f"path: cannot open {path}: {exc.strerror}") from None
    try:
        check_private(os.fstat(fd), path)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
