"""The request recorder: a trace of what a deployment served, in kvstrata's trace
format, for ``kvstrata bench`` to replay (``trace:`` in the config).

What a recording holds, per request (one JSON line, in admission order):
arrival time and how long the request ran (seconds from the recording's
start), prompt and output lengths, and the block hashes of its prompt and of
the full blocks its output completed (kvstrata's hash chain, cut to 128 bits;
with ``trace.secret_file``, HMAC-SHA256 of each hash under the secret, so a hash
cannot be matched against the chain of a known prompt). Never token ids, text,
tenant salts or adapter names: equal hashes are all a replay needs. Without a
secret, whoever reads a recording and can guess a prompt can tell whether it was
served (its hash chain matches): recordings are then not private.

Where: ``trace.path`` is a directory. Each recorder (one per server start)
writes the recording ``<id>`` there as parts ``<id>-00000.jsonl``,
``<id>-00001.jsonl``, ... rotated after ``trace.rotate_bytes`` or
``trace.rotate_seconds``, each opening with the format's header plus the
recording's id and part number and the deployment in force (the tier
capacities and policy, the GPU blocks as the engine sized them). Beside them,
``<id>.measured.json`` holds what the plugin measured over the recording (its
hit, store and eviction counters), rewritten every few seconds and at
shutdown. Every file is created 0600, new (``O_EXCL``) and never through a link;
the measurements are written to a new file of an unpredictable name and renamed
over the old. A directory that another user owns or others can write stops the
recorder at start (one log line): a link planted there could otherwise redirect
a write.

Costs and failures: the scheduler thread only appends a request's finished
record to a reorder buffer (records leave in admission order) and hands
complete ones to a bounded queue; a writer thread keys, formats and writes
them, buffered. A full queue drops the record (counted). An unwritable
directory, a full disk or any other write error disables recording with one
log line and never affects serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import os
import queue
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvstrata.trace.format import HASH_BYTES, HEADER_KEY, MEASURED_SUFFIX, TRACE_VERSION

if TYPE_CHECKING:
    from kvstrata.config.schema import TraceConfig

__all__ = ["TraceRecorder", "RecordedRequest", "HASH_BYTES", "MEASURED_SUFFIX", "rekey"]

log = logging.getLogger(__name__)

MAX_QUEUED = 65536                # records waiting for the writer thread
MAX_WAITING = 4096                # finished records held back behind a request still running
FLUSH_S = 1.0                     # the writer flushes its file at least this often


def rekey(keys: Sequence[bytes], secret: bytes | None) -> list[str]:
    """Block hashes as a recording writes them: the first 128 bits, or with a secret
    those of HMAC-SHA256(secret, hash)."""
    if secret is None:
        return [k[:HASH_BYTES].hex() for k in keys]
    return [hmac.new(secret, k, hashlib.sha256).digest()[:HASH_BYTES].hex() for k in keys]


@dataclass(frozen=True)
class RecordedRequest:
    """One finished request as the scheduler saw it (times in seconds since the epoch)."""

    arrival: float
    finish: float
    input_length: int
    output_length: int
    keys: Sequence[bytes]         # full prompt blocks
    output_keys: Sequence[bytes]  # full blocks completed by the output
    preemptions: Sequence[tuple[float, float, int]] = ()  # (preempted, resumed, tokens looked up again)
    late: bool = False  # written after requests admitted later (it ran past the reorder buffer)


class TraceRecorder:
    """Records finished requests into ``cfg.path``; owned by one scheduler thread."""

    def __init__(self, cfg: "TraceConfig", *, block_size: int, deployment: dict[str, Any],
                 clock: Callable[[], float] = time.time) -> None:
        assert cfg.path is not None
        self.cfg = cfg
        self.block_size = block_size
        self.deployment = deployment
        self.clock = clock
        self.started = clock()
        self.id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.started)) + f"-{os.getpid()}"
        self.dir = Path(cfg.path).expanduser()
        self._secret = cfg.key()
        self._pending: OrderedDict[str, RecordedRequest | None] = OrderedDict()
        self._late: set[str] = set()  # still running, no longer holding the others back
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(MAX_QUEUED)
        self.counts = {"recorded": 0, "sampled_out": 0, "dropped": 0, "unfinished": 0, "late": 0}
        self.disabled: str | None = None
        self._part = -1
        self._file: Any = None
        self._part_bytes = 0
        self._part_started = 0.0
        self._last_ts = 0.0
        self._thread = threading.Thread(target=self._run, name="kvstrata-trace", daemon=True)
        if cfg.secret is not None:
            log.warning("kvstrata: trace.secret is given inline; vLLM logs its connector config as given: "
                        "use trace.secret_file")
        if self._secret is None and not cfg.insecure_hashes:
            self.disabled = "no trace.secret_file: recorded hashes would match those of any guessed prompt"
            log.warning("kvstrata: request recording is off: set trace.secret_file (a private file holding a "
                        "secret) to key the recorded hashes, or trace.insecure_hashes: true to record them plain")
            return
        self._thread.start()
        log.info("kvstrata: recording requests to %s/%s-*.jsonl (sample %g%s)", self.dir, self.id, cfg.sample,
                 ", hashes keyed" if self._secret else "")

    # ------------------------------------------------------------ scheduler thread

    def admitted(self, req_id: str) -> None:
        """A request arrived: its record leaves after those of every earlier arrival."""
        if self.disabled is not None:
            return
        if not self._sampled(req_id):
            self.counts["sampled_out"] += 1
            return
        self._pending[req_id] = None

    def finished(self, req_id: str, record: RecordedRequest | None) -> None:
        """The request finished (``record`` None: it never ran; it is left out). Records leave
        in admission order; a request that holds back more than :data:`MAX_WAITING` finished
        ones is passed, and its record is written when it finishes, flagged ``late``."""
        if req_id in self._late:
            self._late.discard(req_id)
            if record is not None:
                self.counts["late"] += 1
                self._put(("request", dataclasses.replace(record, late=True)))
            return
        if req_id not in self._pending:
            return
        if record is None:
            del self._pending[req_id]
        else:
            self._pending[req_id] = record
        pending = self._pending
        while pending:
            head, first = next(iter(pending.items()))
            if first is None:
                if len(pending) <= MAX_WAITING:
                    break
                self._late.add(head)  # running too long: the others go on without it
            else:
                self._put(("request", first))
            pending.popitem(last=False)

    def measured(self, counters: dict[str, Any]) -> None:
        """What the plugin measured since the recording started (cumulative counters)."""
        self._put(("measured", counters))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued and the last measurements; requests still running are left out."""
        self.counts["unfinished"] += sum(1 for r in self._pending.values() if r is None) + len(self._late)
        self._late.clear()
        for rec in self._pending.values():
            if rec is not None:
                self._put(("request", rec))
        self._pending.clear()
        if not self._thread.is_alive():  # never started (recording off)
            return
        try:
            self._queue.put(("stop", None), timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _sampled(self, req_id: str) -> bool:
        if self.cfg.sample >= 1.0:
            return True
        digest = hashlib.blake2b(req_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < self.cfg.sample * 2**64

    def _put(self, item: tuple[str, Any]) -> None:
        if self.disabled is not None:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.counts["dropped"] += item[0] == "request"

    # ------------------------------------------------------------ writer thread

    def _run(self) -> None:
        try:  # the first part at once: an unwritable directory is known at start-up
            self._rotate(self.clock())
        except OSError as exc:
            self._disable(exc)
        last_flush = time.monotonic()
        while True:
            try:
                kind, item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                kind, item = "flush", None
            if self.disabled is None:
                try:
                    if kind == "request":
                        self._write(self._line(item))
                        self.counts["recorded"] += 1
                    elif kind == "measured":
                        self._write_measured(item)
                    if kind in ("flush", "stop") or time.monotonic() - last_flush >= FLUSH_S:
                        if self._file is not None:
                            self._file.flush()
                        last_flush = time.monotonic()
                except OSError as exc:
                    self._disable(exc)
            if kind == "stop":
                break
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass

    def _disable(self, exc: OSError) -> None:
        self.disabled = f"{exc.filename or self.dir}: {exc.strerror or exc}"
        log.warning("kvstrata: request recording stopped (%s); serving goes on", self.disabled)
        try:
            if self._file is not None:
                self._file.close()
        except OSError:
            pass
        self._file = None

    def _line(self, r: RecordedRequest) -> str:
        ts = max(self._last_ts, round(r.arrival - self.started, 6))  # admission order, never decreasing
        self._last_ts = ts
        rec = {"timestamp": ts, "duration": round(max(0.0, r.finish - r.arrival), 6),
               "input_length": r.input_length, "output_length": r.output_length,
               "block_hashes": rekey(r.keys, self._secret), "output_block_hashes": rekey(r.output_keys, self._secret)}
        if r.late:
            rec["late"] = True  # its arrival was before that of lines above it
        if r.preemptions:
            rec["preemptions"] = [[round(max(0.0, p - r.arrival), 6), round(max(0.0, q - r.arrival), 6), n]
                                  for p, q, n in r.preemptions]
        return json.dumps(rec, separators=(",", ":")) + "\n"

    def _write(self, line: str) -> None:
        now = self.clock()
        if self._file is None or self._part_bytes >= self.cfg.rotate_bytes or \
                now - self._part_started >= self.cfg.rotate_seconds:
            self._rotate(now)
        data = line.encode()
        self._file.write(data)
        self._part_bytes += len(data)

    def _check_dir(self) -> None:
        """The recording directory (made 0700 when missing) must be this user's and writable
        by nobody else: whoever can write there could plant links where the recorder writes."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(self.dir)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(errno.EPERM, f"others can write to the directory (mode "
                                  f"{stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}); chmod 700 it", str(self.dir))

    def _create(self, path: Path) -> Any:
        """A new file of the recording, 0600, never through a link and never an existing file."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return os.fdopen(fd, "wb")

    def _rotate(self, now: float) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._part += 1
        if self._part == 0:
            self._check_dir()
        path = self.dir / f"{self.id}-{self._part:05d}.jsonl"
        header = {HEADER_KEY: TRACE_VERSION, "block_size": self.block_size,
                  "recording": {"id": self.id, "part": self._part, "started": self.started,
                                "sample": self.cfg.sample, "keyed": self._secret is not None},
                  "deployment": self.deployment}
        self._file = self._create(path)
        data = (json.dumps(header, separators=(",", ":")) + "\n").encode()
        self._file.write(data)
        self._part_bytes = len(data)
        self._part_started = now

    def _write_measured(self, counters: dict[str, Any]) -> None:
        """Replace the measurements file: written to a new file of an unpredictable name
        (``mkstemp``: 0600, never through a link), then renamed over it (a rename replaces a
        link planted there, never what it points to)."""
        path = self.dir / f"{self.id}{MEASURED_SUFFIX}"
        body = {"recording": self.id, "started": self.started, "updated": self.clock(), "parts": self._part + 1,
                "recorder": dict(self.counts), "measured": counters}
        fd, tmp = tempfile.mkstemp(prefix=f".{self.id}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(body, indent=1) + "\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
