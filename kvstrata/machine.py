"""What this machine has to give: memory available now, and the machine's (or its cgroup's) total.

Threads: pure functions over ``/proc`` and ``/sys/fs/cgroup``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_memory_bytes", "default_max_memory", "total_memory_bytes"]


def available_memory_bytes() -> int | None:
    """``MemAvailable``, or less where a cgroup limit leaves less; None when neither can be read."""
    limit, used = _cgroup("memory.max"), _cgroup("memory.current")
    room = max(0, limit - used) if limit is not None and used is not None else None
    got = [n for n in (_meminfo("MemAvailable"), room) if n is not None]
    return min(got) if got else None


def total_memory_bytes() -> int | None:
    """The machine's memory, or this process's cgroup limit when lower; None when neither
    can be read."""
    got = [n for n in (_meminfo("MemTotal"), _cgroup("memory.max")) if n is not None]
    return min(got) if got else None


def default_max_memory() -> int | None:
    """Half of :func:`total_memory_bytes`; None when it cannot be read."""
    total = total_memory_bytes()
    return total // 2 if total is not None else None


def _meminfo(field: str) -> int | None:
    """A ``/proc/meminfo`` field in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup(name: str) -> int | None:
    """A cgroup v2 value of this process's group in bytes (None: no limit, or no cgroup v2)."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        value = (Path("/sys/fs/cgroup") / rel.lstrip("/") / name).read_text().strip()
        return None if value == "max" else int(value)
    except (OSError, ValueError, IndexError):
        return None
