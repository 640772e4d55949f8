"""The CPU slab's memory check at start: cgroup v1 and v2 limits, and starts that run together.

Readings come from trees on disk (``kvstrata.system.machine``'s paths point at them): a fake
``/proc/meminfo`` is how these tests give a process a known amount of "available memory"
without allocating it. One test runs under a real cgroup v1 memory limit (root and a v1
memory hierarchy needed: the one mounted at /sys/fs/cgroup/memory, or one mounted in a
private mount namespace). Concurrent starts are real processes started together on a
barrier file; a slab that is "still faulting in" is a real one whose fault-in waits on a
file (a slab of tens of GiB takes seconds to fault in; a test's takes milliseconds).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import kvstrata.system.machine as machine
from kvstrata.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 shows for "no limit" with 4 KiB pages


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def meminfo(path: Path, available: int, total: int = 24 * GiB) -> Path:
    return write(path, f"MemTotal:       {total // 1024} kB\nMemFree:        {available // 1024} kB\n"
                       f"MemAvailable:   {available // 1024} kB\n")


def v1_group(root: Path, rel: str, limit: int, usage: int, inactive_file: int = 0) -> Path:
    group = root / "memory" / rel.lstrip("/")
    write(group / "memory.limit_in_bytes", f"{limit}\n")
    write(group / "memory.usage_in_bytes", f"{usage}\n")
    write(group / "memory.stat", f"cache 0\nrss {usage}\ninactive_file {inactive_file // 2}\n"
                                 f"total_inactive_file {inactive_file}\n")
    return group


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """Point the readings at a fake /proc and /sys/fs/cgroup under tmp_path; returns the
    cgroup root. ``raising=False``: the names exist only where the paths can be moved."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(machine, "CGROUP_ROOT", root, raising=False)
    monkeypatch.setattr(machine, "MEMINFO", meminfo(tmp_path / "meminfo", 20 * GiB), raising=False)
    monkeypatch.setattr(machine, "PROC_SELF_CGROUP", tmp_path / "proc-self-cgroup", raising=False)
    monkeypatch.setattr(machine, "RUNTIME_DIR", tmp_path / "run", raising=False)
    return root


def in_groups(tmp_path: Path, v1: str | None = None, v2: str = "/") -> None:
    lines = ["12:pids:/", "11:cpu,cpuacct:/"] + ([f"4:memory:{v1}"] if v1 else []) + [f"0::{v2}"]
    write(tmp_path / "proc-self-cgroup", "\n".join(lines) + "\n")


# ---------------------------------------------------------------------- readings

def test_a_cgroup_v1_limit_is_read(tree, tmp_path):
    """A v1 memory limit of the process's group bounds what is available: its limit less its
    use, inactive file cache counted as free (the kernel reclaims it first)."""
    in_groups(tmp_path, v1="/kubepods/pod1")
    v1_group(tree, "/kubepods/pod1", limit=4 * GiB, usage=3 * GiB, inactive_file=GiB // 2)
    assert machine.available_memory_bytes() == 3 * GiB // 2
    assert machine.total_memory_bytes() == 4 * GiB
    assert machine.default_max_memory() == 2 * GiB


def test_a_lower_v1_limit_on_a_parent_group_counts(tree, tmp_path):
    """The group itself sets no limit (v1's "unlimited"); its parent's lower one binds."""
    in_groups(tmp_path, v1="/kubepods/pod1/c1")
    v1_group(tree, "/kubepods", limit=V1_UNLIMITED, usage=10 * GiB)
    v1_group(tree, "/kubepods/pod1", limit=2 * GiB, usage=GiB + GiB // 4)
    v1_group(tree, "/kubepods/pod1/c1", limit=V1_UNLIMITED, usage=GiB)
    assert machine.available_memory_bytes() == 3 * GiB // 4
    assert machine.total_memory_bytes() == 2 * GiB


def test_v1_unlimited_is_no_limit(tree, tmp_path):
    in_groups(tmp_path, v1="/user")
    v1_group(tree, "/", limit=V1_UNLIMITED, usage=23 * GiB)
    v1_group(tree, "/user", limit=V1_UNLIMITED, usage=GiB)
    assert machine.available_memory_bytes() == 20 * GiB  # MemAvailable
    assert machine.total_memory_bytes() == 24 * GiB


def test_a_container_whose_own_group_is_the_mount_root(tree, tmp_path):
    """Without a cgroup namespace, /proc/self/cgroup names the host's path, which the
    container's mount lacks: the mount's root (the container's group) still counts."""
    in_groups(tmp_path, v1="/docker/0123abcd")
    v1_group(tree, "/", limit=GiB, usage=GiB // 4)
    assert machine.available_memory_bytes() == 3 * GiB // 4


def test_a_cgroup_v2_limit_is_still_read(tree, tmp_path):
    in_groups(tmp_path, v2="/user.slice/app.scope")
    group = tree / "user.slice" / "app.scope"
    write(group / "memory.max", f"{3 * GiB}\n")
    write(group / "memory.current", f"{2 * GiB}\n")
    write(group / "memory.stat", f"anon {GiB}\ninactive_file {GiB // 2}\n")
    write(tree / "user.slice" / "memory.max", "max\n")  # no limit on the parent
    write(tree / "user.slice" / "memory.current", f"{5 * GiB}\n")
    assert machine.available_memory_bytes() == 3 * GiB // 2
    assert machine.total_memory_bytes() == 3 * GiB


def test_a_slab_over_a_cgroup_v1_limit_is_refused_naming_the_limit(tree, tmp_path):
    from kvstrata.tiers.host import HostSlab

    in_groups(tmp_path, v1="/job")
    group = v1_group(tree, "/job", limit=64 * MiB, usage=16 * MiB)
    with pytest.raises(ConfigError) as err:
        HostSlab(80, MiB, pin_memory=False)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cpu.capacity: ")
    assert "slab of 0.08 GiB" in msg and "0.05 GiB of memory available" in msg
    assert f"cgroup v1 memory limit of 0.06 GiB at {group}" in msg
    assert HostSlab(40, MiB, pin_memory=False).num_slots == 40  # what fits is made


# ---------------------------------------------------------------------- starts that run together

CHILD = r'''
import json, os, sys, time
from pathlib import Path
cfg = json.loads(sys.argv[1])
import torch  # before the barrier: the starts race on the check, not on imports
import kvstrata.system.machine as machine
import kvstrata.tiers.host as host
from kvstrata.errors import ConfigError
for name in ("MEMINFO", "CGROUP_ROOT", "PROC_SELF_CGROUP", "RUNTIME_DIR"):
    if cfg.get(name):
        setattr(machine, name, Path(cfg[name]))
if cfg.get("release"):  # the slab takes until the release file appears to fault in
    fault_in = host._faulted_in
    def slow(array):
        Path(cfg["dir"], f"faulting.{os.getpid()}").touch()
        while not Path(cfg["release"]).exists():
            time.sleep(0.01)
        return fault_in(array)
    host._faulted_in = slow
if cfg.get("join"):  # after the imports: v1 leaves what they charged with the old group
    Path(cfg["join"]).write_text(str(os.getpid()))
Path(cfg["dir"], f"ready.{os.getpid()}").touch()
while not Path(cfg["dir"], cfg.get("go", "go")).exists():
    time.sleep(0.005)
try:
    slab = host.HostSlab(cfg["slots"], 1 << 20, pin_memory=False)
except ConfigError as exc:
    print("REFUSED", exc, flush=True)
    sys.exit(3)
print("MADE", slab.num_slots, flush=True)
'''


class Starts:
    """Child processes that each make a slab of ``slots`` MiB once ``go`` exists."""

    def __init__(self, where: Path, wrap: list[str] | None = None, **cfg) -> None:
        self.dir, self.wrap, self.cfg = where, wrap or [], dict(cfg, dir=str(where))
        where.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def start(self, **extra) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen(self.wrap + [sys.executable, "-c", CHILD, json.dumps(dict(self.cfg, **extra))],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def wait_for(self, prefix: str, n: int, timeout: float = 120.0) -> None:
        """Until ``n`` children wrote a ``prefix`` marker or any of them exited."""
        deadline = time.monotonic() + timeout
        while len(list(self.dir.glob(prefix + ".*"))) < n:
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def go(self, name: str = "go") -> None:
        (self.dir / name).touch()

    def results(self, timeout: float = 120.0) -> list[tuple[int, str]]:
        return [(p.wait(timeout), p.stdout.read()) for p in self.procs]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def exactly_one_made(results: list[tuple[int, str]]) -> str:
    """The refusal's message, once one start made its slab and the other was refused."""
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 3], f"expected one slab made and one refused, got {results}"
    refused = next(out for rc, out in results if rc == 3)
    line = next(line for line in refused.splitlines() if line.startswith("REFUSED "))
    assert line.startswith("REFUSED cpu.capacity: the DRAM tier's slab of "), line
    return line


def fake_machine(tmp_path: Path, available: int) -> dict:
    """What a child needs to see ``available`` bytes of memory and no cgroup limit."""
    (tmp_path / "cgroup").mkdir(exist_ok=True)
    return dict(MEMINFO=str(meminfo(tmp_path / "meminfo", available)), CGROUP_ROOT=str(tmp_path / "cgroup"),
                PROC_SELF_CGROUP=str(write(tmp_path / "proc-self-cgroup", "0::/\n")),
                RUNTIME_DIR=str(tmp_path / "run"))


@pytest.mark.slow
def test_two_starts_together_cannot_both_take_the_same_memory(tmp_path):
    """Two workers (say, two tensor-parallel ranks) each ask for 60% of the memory available,
    at the same moment, and each slab takes a while to fault in: one is made, the other is
    refused, naming what the first reserved."""
    starts = Starts(tmp_path / "starts", release=str(tmp_path / "starts" / "release"),
                    slots=120, **fake_machine(tmp_path, 200 * MiB))
    try:
        starts.start(), starts.start()
        starts.wait_for("ready", 2)
        starts.go()
        starts.wait_for("faulting", 2, timeout=60)  # both there: both passed the check
        (tmp_path / "starts" / "release").touch()
        line = exactly_one_made(starts.results())
    finally:
        starts.kill_all()
    assert "slab of 0.12 GiB is more than the 0.08 GiB of memory available here" in line
    assert "0.12 GiB reserved by 1 other slab(s) still being made resident here, pid " in line


@pytest.mark.slow
def test_the_reservation_of_a_killed_start_does_not_block_a_later_one(tmp_path):
    """A start SIGKILLed while its slab faults in leaves its line in the ledger; it holds the
    memory while the process lives and counts for nothing once it is dead."""
    starts = Starts(tmp_path / "starts", release=str(tmp_path / "never"), slots=120,
                    **fake_machine(tmp_path, 200 * MiB))
    try:
        first, second, third = starts.start(), starts.start(go="go2", release=None), \
            starts.start(go="go3", release=None)
        starts.wait_for("ready", 3)
        starts.go()
        starts.wait_for("faulting", 1, timeout=60)
        assert first.poll() is None, first.stdout.read()
        starts.go("go2")  # while the first still holds its reservation
        assert second.wait(120) == 3, second.stdout.read()
        assert "0.12 GiB reserved by 1 other slab(s) still being made resident here" in second.stdout.read()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        ledger = (tmp_path / "run" / "slab-reservations").read_text()
        assert ledger.startswith(f"{first.pid}:"), ledger  # its reservation is still written there
        starts.go("go3")
        assert third.wait(120) == 0, third.stdout.read()
        assert (tmp_path / "run" / "slab-reservations").read_text() == ""  # and is gone now
    finally:
        starts.kill_all()


def test_a_reservation_of_a_reused_pid_or_an_unreadable_line_counts_for_nothing(tree, tmp_path):
    from kvstrata.tiers.host import HostSlab

    machine.MEMINFO.write_text(f"MemTotal: {GiB // 1024} kB\nMemAvailable: {64 * MiB // 1024} kB\n")
    in_groups(tmp_path)
    machine.RUNTIME_DIR.mkdir(mode=0o700)
    start = machine._start_time(os.getpid())
    # this PID, started at another time (a dead process whose PID was reused); garbage
    write(machine.RUNTIME_DIR / "slab-reservations", f"{os.getpid()}:{start - 1}:x {GiB}\nnot a line\n")
    assert HostSlab(40, MiB, pin_memory=False).num_slots == 40
    # the same line with this process's start time is live: it holds its memory
    write(machine.RUNTIME_DIR / "slab-reservations", f"{os.getpid()}:{start}:x {32 * MiB}\n")
    with pytest.raises(ConfigError, match=r"0\.03 GiB reserved by 1 other slab\(s\) still being made resident here, pid "):
        HostSlab(40, MiB, pin_memory=False)


def test_a_slab_that_fails_to_be_made_leaves_no_reservation(tree, tmp_path, monkeypatch):
    import kvstrata.tiers.host as host

    in_groups(tmp_path)

    def fails(array):
        assert machine.RUNTIME_DIR.joinpath("slab-reservations").read_text().startswith(f"{os.getpid()}:")
        raise MemoryError("faulting in")

    monkeypatch.setattr(host, "_faulted_in", fails)
    with pytest.raises(MemoryError):
        host.HostSlab(4, MiB, pin_memory=False)
    assert machine.RUNTIME_DIR.joinpath("slab-reservations").read_text() == ""


def test_a_ledger_directory_others_can_write_is_not_used(tree, tmp_path, caplog):
    """Whoever can write the ledger's directory could plant reservations (or links): the check
    then runs without the ledger, with one warning."""
    from kvstrata.tiers.host import HostSlab

    in_groups(tmp_path)
    machine.RUNTIME_DIR.mkdir()
    os.chmod(machine.RUNTIME_DIR, 0o777)
    with caplog.at_level("WARNING", logger="kvstrata.system.machine"):
        assert HostSlab(4, MiB, pin_memory=False).num_slots == 4
    assert "reservation ledger cannot be used" in caplog.text
    assert not (machine.RUNTIME_DIR / "slab-reservations").exists()


# ---------------------------------------------------------------------- a real cgroup v1 limit

def own_v1_memory_group() -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        num, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    return None


@pytest.fixture(params=["mounted", pytest.param("private mount", marks=pytest.mark.long)])
def v1_hierarchy(request, tmp_path):
    """(cgroup root, command prefix that sees it): the v1 memory hierarchy mounted at
    /sys/fs/cgroup/memory, or the same one mounted in a private mount namespace."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a cgroup of its own needs root on Linux (CI runs as root)")
    rel = own_v1_memory_group()
    if rel is None:
        pytest.skip("this kernel has no cgroup v1 memory controller (/proc/self/cgroup has no memory "
                    "line: the controller belongs to cgroup v2, or CONFIG_MEMCG_V1 is off)")
    if request.param == "mounted":
        if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
            pytest.skip("no cgroup v1 memory hierarchy is mounted at /sys/fs/cgroup/memory")
        return Path("/sys/fs/cgroup"), [], rel
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    wrap = ["unshare", "-m", "sh", "-c", 'mount -t cgroup -o memory none "$0" && exec "$@"', str(root / "memory")]
    probe = subprocess.run(wrap + ["true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount the cgroup v1 memory controller in a private mount namespace: "
                    f"{probe.stderr.strip()}")
    return root, wrap, rel


@pytest.mark.slow
def test_a_real_cgroup_v1_limit_holds_two_starts_to_one_slab(v1_hierarchy, tmp_path):
    """Two processes in a real v1 memory cgroup limited to 200 MiB each ask for a 120 MiB
    slab at once: one is made, the other refused naming the cgroup's limit (without the
    check both are made and the kernel kills one for memory)."""
    root, wrap, rel = v1_hierarchy
    group = f"{rel.rstrip('/')}/kvstrata-test-{uuid.uuid4().hex[:8]}"
    path = root / "memory" / group.lstrip("/")
    sh = lambda script: subprocess.run(wrap + ["sh", "-c", script], check=True, capture_output=True)
    sh(f"mkdir '{path}' && echo {200 * MiB} > '{path}/memory.limit_in_bytes'")
    starts = Starts(tmp_path / "starts", wrap, slots=120, join=str(path / "cgroup.procs"),
                    RUNTIME_DIR=str(tmp_path / "run"), CGROUP_ROOT=str(root) if wrap else None)
    try:
        starts.start(), starts.start()
        starts.wait_for("ready", 2)
        starts.go()
        line = exactly_one_made(starts.results())
    finally:
        starts.kill_all()
        sh(f"rmdir '{path}'")
    assert f"cgroup v1 memory limit of 0.20 GiB at {root / 'memory' / group.lstrip('/')}" in line
