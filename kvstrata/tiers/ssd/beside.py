"""Reading an SSD tier beside the process that owns it: a read-only child process.

A damaged environment can fault the process that maps it, so the keys or tags of a
tier another process owns are read in a child (``python -c``) that opens it read-only,
as one more LMDB reader (with no owner running, without a lock: not a byte changes),
and sends them back packed in one buffer (:func:`pack_keys`, :func:`pack_tags`). What
is not a kvstrata tier (a tier of the previous name, another program's environment) is
refused before it is opened.

Threads: pure functions (plus the child process).
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvstrata.tiers.ssd.index import Index, IndexFailure
from kvstrata.tiers.ssd.walk import child_command

__all__ = ["read_beside", "pack_keys", "unpack_keys", "pack_tags", "unpack_tags"]


def read_beside(path: str | os.PathLike[str], prefix: bytes, what: str, timeout: float) -> Any:
    """The ``keys`` (least recently used first) or ``tags`` of namespace ``prefix`` in the tier
    at ``path``, from a child process (``_print_<what>``) that opens it read-only."""
    unpack, empty = {"keys": (unpack_keys, []), "tags": (unpack_tags, {})}[what]
    where = Path(os.path.expanduser(os.fspath(path))).absolute()
    if not (where / "data.mdb").exists():
        return empty
    _check_tier(where)
    code = f"from kvstrata.tiers.ssd.beside import _print_{what}; _print_{what}()"
    try:
        proc = subprocess.run(child_command(code, str(where), prefix.hex()),
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OSError(f"reading the {what} of {where} took over {timeout:g} s") from None
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(f"cannot read the {what} of {where}: "
                      f"{why[-1] if why else f'exit {proc.returncode}'}")
    try:
        return unpack(proc.stdout)
    except ValueError as exc:  # anything else on the child's stdout
        raise OSError(f"cannot read the {what} of {where}: unexpected output ({exc})") from None


def _check_tier(where: Path) -> None:
    """The environment at ``where`` is a kvstrata tier's, told by its meta record without a
    write (:func:`~kvstrata.tiers.ssd.directory.check_environment`); ``OSError`` with the
    refusal's line otherwise (a tier of the previous name, another program's)."""
    from kvstrata.errors import ConfigError
    from kvstrata.tiers.ssd.directory import check_environment

    try:
        check_environment(where, str(where))
    except ConfigError as exc:
        raise OSError(str(exc)) from None


def _keys_lru(path: Path, prefix: bytes) -> list[bytes]:
    """:meth:`Index.keys_lru` of the environment at ``path``, opened read-only beside the
    process that owns it (empty if it has no kvstrata databases yet). Raises
    :class:`IndexFailure`."""
    return _read_only(path, lambda index: index.keys_lru(prefix), [])


def _tags(path: Path, prefix: bytes) -> tuple[list[bytes], list[bytes]]:
    """:meth:`Index.tags` of the environment at ``path``, opened as :func:`_keys_lru`
    opens it. Raises :class:`IndexFailure`."""
    return _read_only(path, lambda index: index.tags(prefix), ([], []))


def _read_only(path: Path, read: Any, empty: Any) -> Any:
    """``read(index)`` of the environment at ``path`` opened read-only (``empty`` when it
    has no kvstrata databases yet)."""
    index = Index(path, 0, readonly=True)
    try:
        if b"head" not in index.names():
            return empty
        index.open_dbs(create=False)
        return read(index)
    finally:
        index.close()


def _print_keys() -> None:
    """``python -c`` entry of :func:`kvstrata.tiers.ssd.tier.read_keys`'s child: argv
    ``path prefix-hex``; the keys, without the prefix, on stdout (:func:`pack_keys`), exit
    3 on an LMDB error."""
    _print(lambda path, prefix: pack_keys(_keys_lru(path, prefix), len(prefix)))


def _print_tags() -> None:
    """The same for :func:`kvstrata.tiers.ssd.tier.read_tags`: :func:`pack_tags` on stdout."""
    _print(lambda path, prefix: pack_tags(*_tags(path, prefix), len(prefix)))


def _print(read: Any) -> None:
    import sys

    prefix = bytes.fromhex(sys.argv[2])
    try:
        out = read(Path(sys.argv[1]), prefix)
    except IndexFailure as exc:
        print(exc, file=sys.stderr)
        sys.exit(3)
    sys.stdout.buffer.write(out)


def pack_tags(nskeys: Sequence[bytes], tags: Sequence[bytes], strip: int) -> bytes:
    """Keys (without their first ``strip`` bytes) and their tags in one buffer: the keys'
    :func:`pack_keys` buffer's length, that buffer, then the tags' (``u16`` lengths)."""
    keys = pack_keys(nskeys, strip)
    return _COUNT.pack(len(keys)) + keys + pack_keys(tags, 0)


def unpack_tags(data: bytes) -> dict[bytes, bytes]:
    """The ``key -> tag`` map :func:`pack_tags` packed. Raises ``ValueError`` for anything else."""
    if len(data) < _COUNT.size:
        raise ValueError(f"{len(data)} bytes")
    (n,) = _COUNT.unpack_from(data)
    keys = unpack_keys(data[_COUNT.size:_COUNT.size + n])
    tags = unpack_keys(data[_COUNT.size + n:])
    if len(keys) != len(tags):
        raise ValueError(f"{len(keys)} keys, {len(tags)} tags")
    return dict(zip(keys, tags))


_COUNT = struct.Struct("<Q")


def pack_keys(nskeys: Sequence[bytes], strip: int) -> bytes:
    """Keys, each without its first ``strip`` bytes, in one buffer: the count, every
    length (``u16``), then the keys end to end."""
    n = len(nskeys)
    lengths = np.fromiter(map(len, nskeys), np.int64, n)
    width = int(lengths[0]) if n else 0
    if n and width > strip and (lengths == width).all():  # one size: cut in one numpy step
        rows = np.array(nskeys, dtype=f"S{width}").view(np.uint8).reshape(n, width)
        blob = rows[:, strip:].tobytes()
    else:
        blob = b"".join(k[strip:] for k in nskeys)
    return _COUNT.pack(n) + (lengths - strip).astype(np.uint16).tobytes() + blob


def unpack_keys(data: bytes) -> list[bytes]:
    """The keys :func:`pack_keys` packed. Raises ``ValueError`` for anything else."""
    if len(data) < _COUNT.size:
        raise ValueError(f"{len(data)} bytes")
    (n,) = _COUNT.unpack_from(data)
    start = _COUNT.size + 2 * n
    if start > len(data):
        raise ValueError(f"{n} keys in {len(data)} bytes")
    lengths = np.frombuffer(data, np.uint16, n, _COUNT.size).astype(np.int64)
    if start + int(lengths.sum()) != len(data):
        raise ValueError("key lengths do not add up")
    if n and (lengths == lengths[0]).all():
        width = int(lengths[0])
        return [data[a:a + width] for a in range(start, len(data), width)] if width else [b""] * n
    ends = np.cumsum(lengths) + start
    return [data[a:b] for a, b in zip((ends - lengths).tolist(), ends.tolist())]
