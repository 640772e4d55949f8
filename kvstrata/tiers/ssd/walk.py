"""The integrity check of an environment that was not closed cleanly, and its rebuild,
in a child process.

A damaged B-tree (bit rot, a torn write, a crash mid-sync) can make LMDB
abort() or fault with SIGBUS on the first page it reaches, so a child process
(:func:`walk`) takes that risk before the tier maps the environment: it
reads every page the B-tree reaches in every database, and checks that every
value lies inside ``data.mdb`` (by address) before it reads it. Then, from
the heads it read, it computes the :class:`~kvstrata.tiers.ssd.survey.Survey`
recovery needs and sends it back, packed, on stdout: the tier applies it
without reading every head itself.

What the walk read is also written out, entry by entry, as a fresh
environment (:data:`REBUILT`, beside ``data.mdb``), synced before the child
exits. The tier swaps it in for ``data.mdb`` and only ever maps that: pages
the walk never reaches (LMDB's free-page list above all, which the owner
would read at its first write and LMDB trusts blindly) are not carried over,
so damage there cannot reach the owner as an assertion or a fault. A
compacting copy also drops the space the old file wasted.

Exit status of the child: 0 (the survey follows), 3 (a value lies outside
the file), 4 (not a kvstrata environment: :class:`Foreign`, refused untouched);
a signal or anything else means damage (:class:`Damaged`).

Threads: :func:`walk` runs on the thread that recovers the tier and may be
cancelled from another (:class:`Cancel`, which kills the child).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvstrata.tiers.ssd.survey import Survey

__all__ = ["walk", "Cancel", "child_command", "Damaged", "Foreign", "Cancelled", "REBUILT"]

NOT_KVSTRATA = 4
PREVIOUS = 5              # written under the project's previous name: stdout holds its record format
BARE = 6                  # an environment holding no record (stdout: ``bare`` or ``blank``)
_DATABASES = frozenset({b"meta", b"head", b"lru", b"tag", b"body"})  # the index's named databases, ever
OUTSIDE = 3
REBUILT = "rebuilt.mdb"   # the walked environment, written afresh (no lock file: one writer)
_BATCH = 20_000           # entries per write transaction of the rebuild (bounds its dirty pages)
_ROOT = str(Path(__file__).resolve().parents[3])   # the directory holding the kvstrata package


class Damaged(Exception):
    """The environment did not verify (the message says how)."""


class Foreign(Exception):
    """The environment holds databases kvstrata did not create."""


class Cancelled(Exception):
    """The walk was cancelled."""


def child_command(code: str, *args: str) -> list[str]:
    """``python -c code args`` that imports this kvstrata whatever the child's path, and dies
    with this process (a parent-death signal): a SIGKILLed owner leaves no walk behind."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {_ROOT!r}); "
            f"from kvstrata.tiers.ssd.walk import _die_with; _die_with({os.getpid()}); {code}", *args]


def _die_with(parent: int) -> None:
    """In a child: have the kernel SIGKILL it when ``parent`` exits (Linux), and exit now if
    that already happened."""
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: the child ends with its walk
        return
    if os.getppid() != parent:
        os._exit(1)


class Cancel:
    """Cancels a :func:`walk` from another thread (its child is killed)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def __call__(self) -> None:
        with self._lock:
            self.event.set()
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()

    def track(self, proc: subprocess.Popen[bytes] | None) -> bool:
        """Follow ``proc`` (None: stop following); False when already cancelled."""
        with self._lock:
            self._proc = proc
            return not self.event.is_set()


def walk(path: Path, blocks_size: int, cancel: Cancel | None = None,
         timeout: float = 600.0) -> "Survey":
    """The survey of the environment at ``path`` (its page file ``blocks_size`` bytes
    long), if a child process can walk all of it; the walked entries are then in
    ``path / REBUILT``, synced, for the caller to swap in. Raises :class:`Damaged`,
    :class:`Foreign` or :class:`Cancelled` (a partial :data:`REBUILT` may be left)."""
    from kvstrata.tiers.ssd.survey import Survey
    cancel = cancel or Cancel()
    cmd = child_command("from kvstrata.tiers.ssd.walk import _main; _main()", str(path),
                        str(blocks_size))
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise Damaged(f"verification did not start: {exc}") from None
    if not cancel.track(proc):
        proc.kill()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise Damaged(f"verification took over {timeout:g} s") from None
    finally:
        cancel.track(None)
    if cancel.event.is_set():
        raise Cancelled()
    if proc.returncode == NOT_KVSTRATA:
        raise Foreign()
    if proc.returncode != 0:
        raise Damaged(_problem(proc.returncode, err.decode(errors="replace")))
    try:
        return Survey.unpack(out)
    except ValueError as exc:
        raise Damaged(f"verification failed: {exc}") from None


def _problem(code: int, err: str) -> str:
    if code < 0:
        return f"walking it killed a process with signal {-code}"
    if code == OUTSIDE:
        return "a value points past the end of data.mdb"
    return (err.strip().splitlines() or [f"exit {code}"])[-1]


# ====================================================================== the child

def _main() -> None:
    """Child entry: argv ``path blocks_size``."""
    import lmdb

    from kvstrata.tiers.ssd.survey import survey
    path, blocks_size = sys.argv[1], int(sys.argv[2])
    data = os.path.join(path, "data.mdb")
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=8, readahead=False)
    inside = _inside(os.path.realpath(data))
    target = Path(path) / REBUILT
    keys: list[bytes] = []
    heads: list[bytes] = []
    with env.begin(buffers=True) as txn:
        names = [bytes(k) for k in txn.cursor().iternext(values=False)]
        if names and b"meta" not in names:
            sys.exit(NOT_KVSTRATA)  # the caller refuses it without writing
        out = _fresh(target, os.path.getsize(data))
        for name in names:
            db = env.open_db(name, txn=txn, create=False)
            keep = (keys, heads) if name == b"head" else None
            _copy(txn.cursor(db=db), inside, out, out.open_db(name), keep)
    out.sync(True)
    out.close()
    _fsync(target)
    sys.stdout.buffer.write(survey(keys, heads, blocks_size).pack())


def _identify() -> None:
    """Child entry of :func:`~kvstrata.tiers.ssd.directory.identify`: argv ``path lock``
    (``1``: take a reader slot beside the owner running; ``0``: no lock, not a byte changes).
    Exit 0 for a kvstrata environment (its format record; stdout: the format),
    :data:`PREVIOUS` for one of the previous name (stdout: its format), :data:`BARE` for one
    that holds no record at all (stdout ``bare`` when its databases are kvstrata's, empty:
    a tier that never committed its format record; ``blank`` when it has none),
    :data:`NOT_KVSTRATA` for anything else. Read-only."""
    import lmdb

    from kvstrata.identity.fingerprint import PREVIOUS_NAME

    env = lmdb.open(sys.argv[1], readonly=True, lock=sys.argv[2:3] == ["1"], max_dbs=8, readahead=False)
    with env.begin() as txn:
        names = set(txn.cursor().iternext(values=False))
        try:
            meta = env.open_db(b"meta", txn=txn, create=False) if b"meta" in names else None
        except lmdb.IncompatibleError:  # a plain record named "meta": another program's
            sys.exit(NOT_KVSTRATA)
        record = txn.get(b"kvstrata", db=meta) if meta is not None else None
        if record is not None:
            sys.stdout.write(str(_format_of(record)))
            return
        previous = txn.get(PREVIOUS_NAME.encode(), db=meta) if meta is not None else None
        if previous is not None:
            sys.stdout.write(str(_format_of(previous)))
            sys.exit(PREVIOUS)
        if not names:
            sys.stdout.write("blank")
            sys.exit(BARE)
        try:
            empty = names <= _DATABASES and not any(
                txn.stat(env.open_db(n, txn=txn, create=False))["entries"] for n in names)
        except lmdb.IncompatibleError:
            empty = False
        if empty:
            sys.stdout.write("bare")
            sys.exit(BARE)
        sys.exit(NOT_KVSTRATA)  # another program's databases, or records without a format record


def _format_of(meta: bytes) -> object:
    """The record format a meta record names (None when it cannot be read)."""
    import msgpack
    try:
        about = msgpack.unpackb(meta, raw=False)
    except Exception:  # a damaged meta record
        return None
    return about.get("format") if isinstance(about, dict) else None


def _fresh(target: Path, size: int) -> Any:
    """An empty environment in the file ``target`` (the tier's own: created or emptied)."""
    import lmdb

    from kvstrata.tiers.ssd.private import open_private
    os.close(open_private(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC))
    return lmdb.open(str(target), subdir=False, lock=False, max_dbs=8, sync=False,
                     metasync=False, meminit=False, map_size=max(2 * size, 2**24))


def _copy(cursor: Any, inside: Callable[[Any], bool], out: Any, db: Any,
          keep: tuple[list[bytes], list[bytes]] | None) -> None:
    """Write every entry of ``cursor``'s database into ``db`` of ``out``, each value checked
    before it is read, appended while they come sorted (a damaged tree may hand them out
    of order: then inserted), in batches that bound a transaction's dirty pages; copies of
    the entries into ``keep`` too when given."""
    import lmdb

    entries = cursor.iternext()
    while True:
        batch = [(bytes(k), _checked(v, inside)) for k, v in itertools.islice(entries, _BATCH)]
        if not batch:
            return
        with out.begin(write=True, db=db) as txn:
            for k, v in batch:
                try:
                    txn.put(k, v, append=True)
                except lmdb.KeyExistsError:
                    txn.put(k, v)
        if keep is not None:
            keep[0].extend(k for k, _ in batch)
            keep[1].extend(v for _, v in batch)


def _checked(value: Any, inside: Callable[[Any], bool]) -> bytes:
    if len(value) and not inside(value):
        sys.exit(OUTSIDE)
    return bytes(value)


def _fsync(target: Path) -> None:
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _inside(data: str) -> Callable[[Any], bool]:
    """Whether a buffer lies inside this process's mapping of ``data`` (always True when
    the mapping is not found)."""
    lo = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(data):
                lo = int(line.split("-")[0], 16)
                break
    if lo is None:
        return lambda view: True
    hi = lo + os.path.getsize(data)
    address = _address_of()

    def inside(view: Any) -> bool:
        at = address(view)
        return lo <= at and at + len(view) <= hi
    return inside


def _address_of() -> Callable[[Any], int]:
    """The address of a buffer's first byte: through the buffer protocol (fast), or numpy
    where that does not give what numpy gives."""
    import numpy as np

    def by_numpy(view: Any) -> int:
        return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])

    class PyBuffer(ctypes.Structure):
        _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                    ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int),
                    ("ndim", ctypes.c_int), ("format", ctypes.c_char_p),
                    ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                    ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]

    get, release = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
    get.argtypes = [ctypes.py_object, ctypes.POINTER(PyBuffer), ctypes.c_int]
    release.argtypes = [ctypes.POINTER(PyBuffer)]
    buf = PyBuffer()
    ref = ctypes.byref(buf)

    def by_protocol(view: Any) -> int:
        get(view, ref, 0)
        at = buf.buf or 0
        release(ref)
        return at

    probe = memoryview(b"kvstrata")[2:]
    return by_protocol if by_protocol(probe) == by_numpy(probe) else by_numpy
