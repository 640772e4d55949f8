"""The integrity check of an environment that was not closed cleanly, in a child process.

A damaged B-tree (bit rot, a torn write, a crash mid-sync) can make LMDB
abort() or fault with SIGBUS on the first page it reaches, so a child process
(:func:`walk`) takes that risk before the tier maps the environment: it
reads every page the B-tree reaches in every database, and checks that every
value lies inside ``data.mdb`` (by address, without reading overflow pages).
Then, from the heads it read, it computes the :class:`~tierkv.tiers.ssd.survey.Survey`
recovery needs and sends it back, packed, on stdout: the tier applies it
without reading every head itself.

Exit status of the child: 0 (the survey follows), 3 (a value lies outside
the file), 4 (not a tierkv environment: :class:`Foreign`, refused untouched);
a signal or anything else means damage (:class:`Damaged`).

Threads: :func:`walk` runs on the thread that recovers the tier and may be
cancelled from another (:class:`Cancel`, which kills the child).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tierkv.tiers.ssd.survey import Survey

__all__ = ["walk", "Cancel", "child_command", "Damaged", "Foreign", "Cancelled"]

NOT_TIERKV = 4
OUTSIDE = 3
_ROOT = str(Path(__file__).resolve().parents[3])   # the directory holding the tierkv package


class Damaged(Exception):
    """The environment did not verify (the message says how)."""


class Foreign(Exception):
    """The environment holds databases tierkv did not create."""


class Cancelled(Exception):
    """The walk was cancelled."""


def child_command(code: str, *args: str) -> list[str]:
    """``python -c code args`` that imports this tierkv whatever the child's path."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {_ROOT!r}); {code}", *args]


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
    long), if a child process can walk all of it. Raises :class:`Damaged`,
    :class:`Foreign` or :class:`Cancelled`."""
    from tierkv.tiers.ssd.survey import Survey
    cancel = cancel or Cancel()
    cmd = child_command("from tierkv.tiers.ssd.walk import _main; _main()", str(path),
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
    if proc.returncode == NOT_TIERKV:
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

    from tierkv.tiers.ssd.survey import survey
    path, blocks_size = sys.argv[1], int(sys.argv[2])
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=8, readahead=False)
    inside = _inside(os.path.realpath(os.path.join(path, "data.mdb")))
    keys: list[bytes] = []
    heads: list[bytes] = []
    with env.begin(buffers=True) as txn:
        names = [bytes(k) for k in txn.cursor().iternext(values=False)]
        if names and b"meta" not in names:
            sys.exit(NOT_TIERKV)  # the caller refuses it without writing
        for name in names:
            db = env.open_db(name, txn=txn, create=False)
            if name == b"head":
                keys, heads = _walk(txn.cursor(db=db), inside, copy=True)
            else:
                _walk(txn.cursor(db=db), inside, copy=False)
    sys.stdout.buffer.write(survey(keys, heads, blocks_size).pack())


def _walk(cursor: Any, inside: Callable[[Any], bool], copy: bool
          ) -> tuple[list[bytes], list[bytes]]:
    """Every entry of a database, each value checked; copies of the entries if ``copy``."""
    keys: list[bytes] = []
    values: list[bytes] = []
    for k, v in cursor.iternext():
        if len(v) and not inside(v):
            sys.exit(OUTSIDE)
        if copy:
            keys.append(bytes(k))
            values.append(bytes(v))
    return keys, values


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

    probe = memoryview(b"tierkv")[2:]
    return by_protocol if by_protocol(probe) == by_numpy(probe) else by_numpy
