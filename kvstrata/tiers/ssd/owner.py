"""One owner per SSD tier directory: an advisory lock held for the tier's lifetime.

Each open tier keeps its own free-space map of ``blocks.dat``; two of them on
one directory would hand the same pages to different records. So a tier
takes an exclusive ``flock`` on ``kvstrata.lock`` in its directory before it
reads or writes anything there, and writes its PID into that file so that a
second opener (another process, or another instance in this process: flock
locks belong to open file descriptions) is refused with the holder's PID.
The kernel drops the lock when the owner exits, SIGKILL included.

A forked child inherits the descriptor, and with it the lock. Right after a
fork the child closes every inherited descriptor (:func:`os.register_at_fork`):
the parent keeps its lock, and the child can open tiers of its own. A
directory the parent had open stays closed to the child even after the
parent lets it go: the child's copy of the parent's LMDB handle must never
be used or closed (closing it would touch the parent's reader slots), and
LMDB allows one handle per environment and process. The child gets a clear
``ConfigError`` instead; a process started afresh (spawn, exec) can open it.

Threads: :data:`_HELD` and :data:`_INHERITED` are guarded by :data:`_LOCK`.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from kvstrata.errors import ConfigError

__all__ = ["Owner", "LOCK_FILE", "held_by", "reader_slot"]

LOCK_FILE = "kvstrata.lock"
_HELD: set["Owner"] = set()
_INHERITED: set[tuple[int, int]] = set()   # (st_dev, st_ino) of directories the parent had open
_LOCK = threading.Lock()


class Owner:
    """This process's exclusive ownership of the tier directory ``path`` (which exists)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._id = _dir_id(path)
        with _LOCK:  # a fork from another thread sees the descriptor in _HELD or not at all
            self._fd = _open_lock_file(path)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._id in _INHERITED:
                    raise ConfigError(f"path: {path} was open in the parent when this process "
                                      "was forked, and cannot be opened again in this process; "
                                      "open it in a process started with spawn or exec")
            except BlockingIOError:
                holder = _holder(self._fd)
                os.close(self._fd)
                raise ConfigError(_in_use(path, holder)) from None
            except OSError as exc:  # a file system without flock (some FUSE mounts)
                os.close(self._fd)
                raise ConfigError(f"path: cannot lock {path / LOCK_FILE}: {exc.strerror}") from None
            except BaseException:
                os.close(self._fd)
                raise
            _HELD.add(self)
        _write_pid(self._fd)

    def release(self) -> None:
        """Give the directory up. Idempotent."""
        with _LOCK:
            _HELD.discard(self)
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the last descriptor of the lock releases it


def held_by(path: Path) -> int | None:
    """The PID of the process that owns the tier at ``path`` (holds its lock), -1 when one
    does but it is not named, None when none does. Creates nothing."""
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def reader_slot(path: Path) -> bool:
    """Whether a read-only open of the environment at ``path`` takes a reader slot in its
    ``lock.mdb``: only beside the owner running (it holds the lock, and ``lock.mdb`` is
    open). With no owner, LMDB would rewrite ``lock.mdb``; without a slot not a byte
    changes."""
    return held_by(path) is not None and (path / "lock.mdb").is_file()


def _open_lock_file(path: Path) -> int:
    from kvstrata.tiers.ssd.private import open_private

    return open_private(path / LOCK_FILE, os.O_RDWR | os.O_CREAT)


def _dir_id(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _write_pid(fd: int) -> None:
    """Best effort: on a full disk the lock still holds, only the PID goes unnamed."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"%d\n" % os.getpid(), 0)
    except OSError:
        pass


def _in_use(path: Path, holder: int | None) -> str:
    who = ("this process (share that SSDTier instance)" if holder == os.getpid() else
           f"process {holder}" if holder is not None else "another process")
    return (f"path: {path} is in use by {who}; an SSD tier directory has one owner at a "
            "time, give each process (each engine, each parallel rank) its own path")


def _forget_in_child() -> None:
    """After fork: close the inherited lock descriptors (the parent keeps its locks)."""
    global _LOCK
    _LOCK = threading.Lock()  # the parent's is held by the forking thread: never released here
    for owner in list(_HELD):
        _INHERITED.add(owner._id)
        owner.release()


os.register_at_fork(before=lambda: _LOCK.acquire(), after_in_parent=lambda: _LOCK.release(),
                    after_in_child=_forget_in_child)
