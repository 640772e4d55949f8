"""The SSD tier's arguments checked (keys, sizes, fingerprint, directory), and file sizes.

Errors are :class:`~kvstrata.errors.ConfigError` (a ``ValueError`` for a bad key) naming
the argument.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd.index import MAX_KEY
from kvstrata.tiers.ssd.pagefile import BLOCKS
from kvstrata.tiers.ssd.record import NS_LEN

__all__ = ["check_key", "check_int", "check_block_nbytes", "check_capacity", "check_fingerprint", "check_path",
           "file_size", "MAX_KEY_LEN"]

MAX_KEY_LEN = MAX_KEY - NS_LEN   # longest key a caller may use


def check_key(key: object, what: str) -> bytes:
    if not isinstance(key, bytes):
        raise ValueError(f"{what}: expected bytes (a block hash), got {type(key).__name__}")
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"{what}: a key has at most {MAX_KEY_LEN} bytes, got {len(key)}")
    return key


def check_int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    return value


def check_block_nbytes(value: int | None) -> int | None:
    return None if value is None else check_int(value, "block_nbytes", 1)


def check_capacity(value: object, block_nbytes: int | None) -> int:
    cap = check_int(value, "capacity_bytes", 0)
    floor = max(2 * (block_nbytes or 0), 1024**2)
    if cap < floor:
        raise ConfigError(f"capacity_bytes: {cap} is too small; the SSD tier needs at least "
                          f"{floor} bytes (1 MiB and two blocks)")
    return cap


def check_fingerprint(value: object) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or not value:
        raise ConfigError(f"fingerprint: expected a non-empty str or bytes, got {value!r}")
    return value


def check_path(value: object, what: str = "path") -> Path:
    """``value`` as an absolute directory path a tier may use (it or its parent exists and
    is writable: a missing parent is an error, an unmounted disk must not fill the root
    file system); errors name ``what``."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ConfigError(f"{what}: expected a directory path, got {value!r}")
    path = Path(os.path.expanduser(os.fspath(value))).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what}: {path} exists and is not a directory")
    if not path.exists() and not path.parent.is_dir():
        raise ConfigError(f"{what}: the parent directory {path.parent} does not exist "
                          "(create it first; kvstrata does not create mount points)")
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: {target} is not writable")
    for name in ("data.mdb", BLOCKS):
        if (path / name).exists() and not os.access(path / name, os.R_OK | os.W_OK):
            raise ConfigError(f"{what}: {path / name} is not readable and writable")
    return path


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
