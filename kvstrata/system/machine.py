"""What this machine has to give: memory available now, the machine's (or its cgroup's) total,
and memory held for a slab that is still being made resident.

* Readings: ``MemAvailable``/``MemTotal`` of :data:`MEMINFO`, and every memory limit set on this
  process's cgroup or one of its ancestors, cgroup v1 (``memory.limit_in_bytes``, usage
  ``memory.usage_in_bytes``) and v2 (``memory.max``, ``memory.current``), under
  :data:`CGROUP_ROOT`. A group's use counts its inactive file cache as free (the kernel
  reclaims it before it kills anything), as ``MemAvailable`` does. The tightest one wins.
* :func:`reserved_memory`: a host-wide ledger of memory promised to slabs that are not yet
  resident (the workers of one engine start together, and each one's slab takes seconds to
  fault in: without it every worker passes the check on the same free memory). A start
  reads the memory available less the live reservations of others and records its own
  under an exclusive ``fcntl`` lock on one file of :data:`RUNTIME_DIR`; the caller makes its
  memory resident, then the reservation goes. The reservation of a process that died
  (its PID gone, or reused by a process started at another time) counts for nothing.

Threads: pure functions over ``/proc`` and ``/sys/fs/cgroup``; the ledger is guarded by its
file lock, across threads and processes alike. The paths are module constants so that
tests can point them at trees of their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvstrata.errors import ConfigError

__all__ = ["CgroupLimit", "available_memory_bytes", "cgroup_limits", "default_max_memory",
           "reserved_memory", "total_memory_bytes"]

log = logging.getLogger(__name__)

#: Where the cgroup hierarchies are mounted (v1: ``memory/`` below it; v2: itself).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's cgroup paths, one ``id:controllers:path`` line per hierarchy.
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
#: The reservation ledger's directory; None: ``/dev/shm/kvstrata-<uid>`` (the temp dir without /dev/shm).
RUNTIME_DIR: Path | None = None
#: How long a start waits for the ledger's lock before it checks without the ledger.
LOCK_WAIT_S = 10.0

#: cgroup v1 writes "no limit" as the largest page count times the page size (2**63 - 4096 with
#: 4 KiB pages): any limit this large is none.
_V1_UNLIMITED = 1 << 62
_LEDGER = "slab-reservations"
Entry = tuple[str, int, int]  # a reservation: token ("pid:start time:unique"), pid, bytes


@dataclass(frozen=True)
class CgroupLimit:
    """A memory limit on this process's cgroup or one of its ancestors."""

    version: int
    group: Path
    limit: int
    used: int  # less the group's inactive file cache

    @property
    def room(self) -> int:
        return max(0, self.limit - self.used)

    def describe(self) -> str:
        return (f"{_gib(self.used)} GiB in use of the cgroup v{self.version} memory limit of "
                f"{_gib(self.limit)} GiB at {self.group}")


def available_memory_bytes() -> int | None:
    """``MemAvailable``, or less where a cgroup limit leaves less; None when neither can be read."""
    got = [n for n in (_meminfo("MemAvailable"), _tightest_room()) if n is not None]
    return min(got) if got else None


def total_memory_bytes() -> int | None:
    """The machine's memory, or this process's cgroup limit when lower; None when neither
    can be read."""
    limits = [c.limit for c in cgroup_limits()]
    got = [n for n in (_meminfo("MemTotal"), min(limits, default=None)) if n is not None]
    return min(got) if got else None


def default_max_memory() -> int | None:
    """Half of :func:`total_memory_bytes`; None when it cannot be read."""
    total = total_memory_bytes()
    return total // 2 if total is not None else None


def cgroup_limits() -> list[CgroupLimit]:
    """Every memory limit on this process's cgroup and its ancestors, v1 and v2, innermost first.

    A group directory that does not exist under :data:`CGROUP_ROOT` (a container that mounts
    its own group as the root) is skipped: its ancestors, the mount's root included, still count.
    """
    out: list[CgroupLimit] = []
    for version, rel in _cgroup_paths():
        base = CGROUP_ROOT / "memory" if version == 1 else CGROUP_ROOT
        group = base / rel.lstrip("/")
        while True:
            found = _v1_limit(group) if version == 1 else _v2_limit(group)
            if found is not None:
                out.append(found)
            if group == base or base not in group.parents:
                break
            group = group.parent
    return out


def _tightest_room() -> int | None:
    return min((c.room for c in cgroup_limits()), default=None)


def _cgroup_paths() -> list[tuple[int, str]]:
    """(1, path of the v1 memory hierarchy) and (2, the v2 path), as far as this process has them."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out.append((2, parts[2]))
        elif "memory" in parts[1].split(","):
            out.append((1, parts[2]))
    return out


def _v1_limit(group: Path) -> CgroupLimit | None:
    limit = _read_int(group / "memory.limit_in_bytes")
    if limit is None or limit >= _V1_UNLIMITED:
        return None
    used = _read_int(group / "memory.usage_in_bytes")
    if used is None:
        return None
    return CgroupLimit(1, group, limit, max(0, used - _stat(group, "total_inactive_file")))


def _v2_limit(group: Path) -> CgroupLimit | None:
    limit = _read_int(group / "memory.max")  # "max" (no limit) reads as None
    if limit is None:
        return None
    used = _read_int(group / "memory.current")
    if used is None:
        return None
    return CgroupLimit(2, group, limit, max(0, used - _stat(group, "inactive_file")))


def _stat(group: Path, field: str) -> int:
    """A field of the group's ``memory.stat`` (0 when it cannot be read)."""
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _meminfo(field: str) -> int | None:
    """A ``/proc/meminfo`` field in bytes."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


# ---------------------------------------------------------------------- the reservation ledger

@contextlib.contextmanager
def reserved_memory(nbytes: int, key: str, what: str) -> Iterator[None]:
    """Hold ``nbytes`` of this machine's memory while the caller makes ``what`` resident.

    Refused with a one-line ConfigError naming ``key`` when ``nbytes`` is more than the memory
    available less what other starts have reserved. The reservation is dropped when the
    block exits (however it exits); the caller's memory is then in use and counted as such.
    No check at all when the memory available cannot be read; a check without the ledger
    (one warning) when the ledger cannot be used.
    """
    with _ledger() as fd:
        avail = available_memory_bytes()
        token = None if avail is None else _add_reservation(fd, nbytes, avail, key, what)
    try:
        yield
    finally:
        if token is not None:
            with _ledger() as fd:
                if fd is not None:
                    _write_entries(fd, [e for e in _live_entries(fd) if e[0] != token])


def _add_reservation(fd: int | None, nbytes: int, avail: int, key: str, what: str) -> str | None:
    """Check ``nbytes`` against ``avail`` less the live reservations, and record it: its token
    (None without a ledger). Runs under the ledger's lock."""
    entries = _live_entries(fd) if fd is not None else []
    held = sum(e[2] for e in entries)
    if nbytes > avail - held:
        raise ConfigError(_refusal(nbytes, avail, entries, key, what))
    if fd is None:
        return None
    token = f"{os.getpid()}:{_start_time(os.getpid())}:{uuid.uuid4().hex}"
    _write_entries(fd, entries + [(token, os.getpid(), nbytes)])
    return token


def _refusal(nbytes: int, avail: int, entries: list[Entry], key: str, what: str) -> str:
    held = sum(e[2] for e in entries)
    why = []
    tightest = min(cgroup_limits(), key=lambda c: c.room, default=None)
    if tightest is not None and tightest.room <= (_meminfo("MemAvailable") or tightest.room):
        why.append(tightest.describe())
    if entries:
        why.append(f"{_gib(held)} GiB reserved by {len(entries)} other slab(s) still being made resident "
                   f"here, pid {', '.join(str(e[1]) for e in entries)}")
    because = f" ({'; '.join(why)})" if why else ""
    return (f"{key}: {what} of {_gib(nbytes)} GiB is more than the {_gib(max(0, avail - held))} GiB "
            f"of memory available here{because}: use a smaller {key}")


def _live_entries(fd: int) -> list[Entry]:
    """The ledger's reservations whose process still runs (same PID, same start time)."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = b""
    while chunk := os.read(fd, 1 << 16):
        text += chunk
    out = []
    for line in text.decode("ascii", "replace").splitlines():
        fields = line.split()
        try:
            token, nbytes = fields[0], int(fields[1])
            pid, start = (int(x) for x in token.split(":")[:2])
        except (IndexError, ValueError):
            continue  # not ours to understand: it counts for nothing
        if nbytes > 0 and _start_time(pid) == start:
            out.append((token, pid, nbytes))
    return out


def _write_entries(fd: int, entries: list[Entry]) -> None:
    data = "".join(f"{token} {nbytes}\n" for token, _, nbytes in entries).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None when it does not run: with the
    PID, it tells a live process from a later one that reuses a dead one's PID."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def _ledger() -> Iterator[int | None]:
    """The ledger's descriptor, locked exclusively; None (one warning) when it cannot be used."""
    try:
        fd = _open_ledger()
    except OSError as exc:
        log.warning("CPU tier: the memory reservation ledger cannot be used (%s): a start here is "
                    "not checked against other processes' starts", exc)
        yield None
        return
    try:
        if _lock(fd):
            yield fd
        else:
            log.warning("CPU tier: the memory reservation ledger stayed locked for %.0f s: this start "
                        "is not checked against other processes' starts", LOCK_WAIT_S)
            yield None
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int) -> bool:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _open_ledger() -> int:
    """The ledger file, in a directory of this user that nobody else can write, never through a link."""
    folder = RUNTIME_DIR if RUNTIME_DIR is not None else _default_runtime_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{folder} is not a directory of this user that only it can write")
    fd = os.open(folder / _LEDGER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(f"{folder / _LEDGER} is not a regular file of this user")
    return fd


def _default_runtime_dir() -> Path:
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"kvstrata-{os.geteuid()}"
