"""A disk slower than recompute, for real: an ext4 file system on a file-backed loop
device whose reads a blkio cgroup (v1) throttles. Needs root and cgroup v1's blkio
controller (``/sys/fs/cgroup/blkio``); :func:`unavailable` says why not, where not.

    with ThrottledDisk(tmp_path, read_bps=6 << 20) as disk:
        ...                        # disk.mount: a directory on the loop device
        with disk.throttled():     # this process, and the processes it starts, read at 6 MiB/s
            run_engine()
        disk.drop_cache()          # before a measured pass: reads of its files reach the device

Everything is undone on exit (unmounted, the loop device detached, the cgroup removed).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

BLKIO = Path("/sys/fs/cgroup/blkio")

__all__ = ["ThrottledDisk", "drop_page_cache", "unavailable"]


def unavailable() -> str | None:
    """Why a throttled disk cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "not root (a loop device, a mount and a blkio cgroup need it)"
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return f"no cgroup v1 blkio controller at {BLKIO}"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} is not installed"
    return None


class ThrottledDisk:
    """``size_mib`` of ext4 at ``root/mnt`` whose reads, by processes in :meth:`throttled`,
    run at ``read_bps`` bytes per second."""

    def __init__(self, root: Path, read_bps: int, size_mib: int = 1024) -> None:
        self.root = Path(root)
        self.read_bps = int(read_bps)
        self.size_mib = size_mib
        self.image = self.root / "disk.img"
        self.mount = self.root / "mnt"
        self.cgroup = BLKIO / f"kvstrata-throttle-{os.getpid()}"
        self.device: str | None = None

    def __enter__(self) -> "ThrottledDisk":
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"a throttled disk cannot be made here: {why}")
        self.mount.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size_mib << 20)
        try:
            self.device = _run("losetup", "--find", "--show", str(self.image)).strip()
            _run("mkfs.ext4", "-q", "-F", self.device)
            _run("mount", self.device, str(self.mount))
            self.cgroup.mkdir(exist_ok=True)
            st = os.stat(self.device)
            (self.cgroup / "blkio.throttle.read_bps_device").write_text(
                f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {self.read_bps}\n")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def throttled(self) -> Iterator[None]:
        """This process in the throttled cgroup (the processes it starts meanwhile stay there)."""
        (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (BLKIO / "cgroup.procs").write_text(str(os.getpid()))

    def drop_cache(self) -> None:
        """Write back and drop the page cache of every file on the disk: the next reads of
        them reach the device (the rest of the machine's cache, the engine's libraries and
        weights included, stays warm)."""
        os.sync()
        for d in [self.mount, *(p for p in self.mount.rglob("*") if p.is_dir())]:
            drop_page_cache(d)

    def close(self) -> None:
        if self.device is not None:
            subprocess.run(["umount", str(self.mount)], capture_output=True)
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
            self.device = None
        if self.cgroup.exists():
            with contextlib.suppress(OSError):
                (BLKIO / "cgroup.procs").write_text(str(os.getpid()))
                self.cgroup.rmdir()
        self.image.unlink(missing_ok=True)


def drop_page_cache(path: "str | os.PathLike[str]") -> None:
    """Write back and evict a file's pages (every file of a directory) for a cold read."""
    p = Path(path)
    for f in ([p] if p.is_file() else [c for c in p.iterdir() if c.is_file()]):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()[:300]}")
    return proc.stdout
