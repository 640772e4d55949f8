"""Request traces: the formats ``kvstrata bench`` reads, auto-detected.

Every format becomes a :class:`Trace`: requests in arrival order, each with
its prompt as a list of dense block ids (equal id = reusable block, prefix
order). Formats (one JSON object per line):

``mooncake``
    ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``
    (prefix block hashes of 512-token blocks).
``qwen`` (Qwen-Bailian usage traces)
    ``chat_id``, ``parent_chat_id``, ``timestamp`` (s), ``input_length``,
    ``output_length``, ``type``, ``turn``, ``hash_ids`` (16-token blocks).
``kvstrata`` (format version :data:`TRACE_VERSION`; the README documents it; recordings of the
    plugin's recorder add ``recording`` and ``deployment`` to the header and
    ``output_block_hashes``, ``duration`` and, when vLLM preempted it, ``preemptions`` to each request)
    an optional first line, the header: ``kvstrata_trace`` (the format version)
    and optionally ``block_size`` (tokens per block of the ``block_hashes``);
    other header keys are ignored. Then per request: ``timestamp`` (s), and
    ``token_ids`` or ``block_hashes`` (ints or hex strings, prefix order);
    optional ``input_length``, ``output_length``, ``cache_salt``, ``lora``.
    Token ids are cut into full blocks of the block size and chained like the
    engine does, with ``cache_salt`` and ``lora`` in the chain's root. A
    header of a newer version stops the read.

The file is read once, line by line, so a pipe or FIFO works as well as a
file. Lines are UTF-8 (a byte order mark at the start is allowed) and at most
:data:`MAX_LINE_BYTES` long. Bad input raises :class:`TraceError` whose
message starts with ``file:line``. With ``skip_bad_lines`` a bad record is
skipped and counted instead.

:class:`TraceReader` hands out each request as its line is read and keeps
nothing per request: what it retains is the map from each distinct block
hash to its dense id (about 100 bytes per distinct block for integer
hashes), so a trace of any length streams through in memory that follows
its distinct blocks; ``max_distinct_blocks`` stops it with a
:class:`TraceError` before that map outgrows the memory it was given.
:func:`load_trace` keeps every request (a :class:`Trace`), for small traces
and tests.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional, Union

from kvstrata.config.schema import plural, short_repr
from kvstrata.trace.format import HEADER_KEY, TRACE_VERSION, TraceError, header_version, is_header
from kvstrata.trace.parts import measured_of, recording_parts
from kvstrata.trace.line import ADDERS, BadRecord, TooManyBlocks, parse_line
from kvstrata.trace.requests import Request, Trace, TraceInfo

__all__ = ["TRACE_VERSION", "HEADER_KEY", "header_version", "is_header", "FORMATS", "DistinctLimit", "Request", "Trace", "TraceBuilder",
           "TraceError", "TraceInfo", "TraceReader", "detect_format", "load_trace"]

FORMATS = ("mooncake", "qwen", "kvstrata")
_ALIASES = {"qwen-bailian": "qwen", "bailian": "qwen"}
DEFAULT_BLOCK_SIZE = {"mooncake": 512, "qwen": 16}
MAX_LINE_BYTES = 16 << 20  # a 1M-token prompt's token ids fit; parsed, a line costs ~10x its bytes
"""Longest trace line read (bytes); a longer one is a bad line."""
_BOM = b"\xef\xbb\xbf"
_PROGRESS_LINES, _PROGRESS_BYTES = 4096, 4 << 20


DistinctLimit = Optional[Union[int, Callable[[str, int], Optional[int]]]]
"""A limit on distinct blocks: a number, None (no limit), or a function of (format, block size)."""



def detect_format(record: Any) -> str | None:
    """The format a parsed JSON record belongs to, or None."""
    if not isinstance(record, dict):
        return None
    if "chat_id" in record or "parent_chat_id" in record:
        return "qwen"
    if "hash_ids" in record:
        return "mooncake"
    if "token_ids" in record or "block_hashes" in record or is_header(record):
        return "kvstrata"
    return None


class TraceBuilder:
    """Turns per-request prompts into dense block ids and checks arrival order.

    Used by the file loader and by the workload generators, so both produce
    identical :class:`Trace` objects. With ``keep=False`` no request is kept:
    ``last`` holds the latest one until a reader takes it. More than
    ``max_distinct_blocks`` distinct blocks is an error.
    """

    def __init__(self, name: str, fmt: str, block_size: int, *, keep: bool = True,
                 max_distinct_blocks: int | None = None) -> None:
        self.name, self.format, self.block_size = name, fmt, block_size
        self.ids: dict[Any, int] = {}
        self.requests: list[Request] = []
        self.keep, self.max_distinct_blocks = keep, max_distinct_blocks
        self.last: Request | None = None
        self.token_based = False
        self._last_ts = self._first_ts = 0.0
        self.num_requests = self.num_accesses = 0

    def check_time(self, ts: float) -> None:
        if ts < self._last_ts:
            raise BadRecord(f"timestamp {ts:g} s is earlier than the previous request's {self._last_ts:g} s "
                       "(the trace must be sorted by arrival time)")

    def add_ids(self, ts: float, raw_ids: list[Any], input_length: int, output_length: int,
                line: int = 0, namespace: Any = None, output_ids: list[Any] = (),  # type: ignore[assignment]
                duration: float = -1.0, hittable: int | None = None,
                preemptions: list[tuple[float, float, int]] | None = None) -> None:
        """A request given by block hash ids (equal id = same prefix block); ``output_ids``:
        the full blocks its output completed, continuing the chain."""
        self.check_time(ts)
        raw_ids = [*raw_ids, *output_ids]
        if namespace is not None:
            raw_ids = [(namespace, h) for h in raw_ids]
        if len(set(raw_ids)) != len(raw_ids):  # before interning: a bad line adds no blocks
            raise BadRecord("the same block hash appears twice in one request")
        ids = self.ids
        blocks = list(map(ids.get, raw_ids))
        if None in blocks:  # new blocks get the next ids (a request's hashes are distinct)
            self._room_for(blocks.count(None))
            for i, b in enumerate(blocks):
                if b is None:
                    blocks[i] = ids[raw_ids[i]] = len(ids)
        n = len(blocks) - len(output_ids)
        prompt, out = blocks[:n], blocks[n:]
        if hittable is not None:
            self.token_based = True
        self._append(Request(ts, prompt, input_length, output_length, n if hittable is None else hittable, line,
                             hittable is not None, out, duration, preemptions or []))

    def add_tokens(self, ts: float, tokens: list[int], output_length: int, line: int = 0,
                   namespace: Any = None) -> None:
        """A request given by token ids: full blocks chained to their parent."""
        self.check_time(ts)
        bs, n = self.block_size, len(tokens)
        parent: Any = ("root", namespace)
        ids = self.ids
        get = ids.get
        blocks = []
        for i in range(0, n - n % bs, bs):
            key = (parent, _token_key(tokens[i:i + bs]))
            parent = get(key)
            if parent is None:
                self._room_for(1)
                parent = ids[key] = len(ids)
            blocks.append(parent)
        self.token_based = True
        self._append(Request(ts, blocks, n, output_length, min(len(blocks), max(n - 1, 0) // bs), line, True))

    def intern(self, key: Any) -> int:
        """Dense id of ``key`` (new keys get the next id: ids are 0, 1, 2, ... in order of first use)."""
        ids = self.ids
        got = ids.get(key)
        if got is None:
            got = ids[key] = len(ids)
        return got

    def add_blocks(self, ts: float, blocks: list[int], input_length: int, output_length: int,
                   hittable: int) -> None:
        """A request whose blocks were interned by the caller (generators); token-based rules apply."""
        self.check_time(ts)
        self.token_based = True
        self._append(Request(ts, blocks, input_length, output_length, hittable, 0, True))

    def _room_for(self, new: int) -> None:
        """Refuse ``new`` more distinct blocks beyond ``max_distinct_blocks`` before they are
        interned: one huge line stops here, not after its blocks filled the map."""
        if self.max_distinct_blocks is not None and len(self.ids) + new > self.max_distinct_blocks:
            raise TooManyBlocks(f"more than {self.max_distinct_blocks:,} distinct blocks (--max-distinct-blocks): "
                                 "stopped before the analysis outgrows the memory it was given")

    def _append(self, req: Request) -> None:
        self._room_for(0)
        if not self.num_requests:
            self._first_ts = req.timestamp
        self._last_ts = req.timestamp
        self.num_requests += 1
        self.num_accesses += len(req.blocks)
        self.last = req
        if self.keep:
            self.requests.append(req)

    def info(self, skipped: int = 0, first_skipped: str | None = None, source: "_Loader | None" = None) -> TraceInfo:
        n = len(self.ids)
        return TraceInfo(self.name, self.format, self.block_size, self.num_requests, self.num_accesses, n, n,
                         self.token_based, self._first_ts, self._last_ts, skipped, first_skipped, *_read_by(source))

    def build(self, skipped: int = 0, first_skipped: str | None = None, source: "_Loader | None" = None) -> Trace:
        n = len(self.ids)
        return Trace(self.name, self.format, self.block_size, self.requests, n, n, self.token_based, skipped,
                     first_skipped, *_read_by(source))


def _read_by(source: "_Loader | None") -> tuple[dict[str, Any] | None, list[str], dict[str, Any] | None]:
    """What a loader found beside the requests: the header, notes on what it skipped, the
    recording's measured counters."""
    return (source.header_rec, list(source.notes), source.measured) if source is not None else (None, [], None)


def _token_key(tokens: list[int]) -> bytes | tuple[int, ...]:
    """A block's tokens as a map key: their int64 bytes (8 bytes a token), a tuple if one does not fit."""
    try:
        return array("q", tokens).tobytes()
    except OverflowError:
        return tuple(tokens)


def normalize_format(fmt: str) -> str:
    fmt = _ALIASES.get(fmt, fmt)
    if fmt != "auto" and fmt not in FORMATS:
        raise TraceError(f"--format: expected auto, {', '.join(FORMATS)}; got {fmt!r}")
    return fmt


@dataclass
class _Loader:
    path: Path
    fmt: str
    block_size: int | None
    default_block_size: int
    skip_bad_lines: bool
    max_line_bytes: int = MAX_LINE_BYTES
    keep: bool = True
    max_distinct_blocks: DistinctLimit = None
    builder: TraceBuilder | None = None
    skipped: int = 0
    first_skipped: str | None = None
    lines: int = 0
    bytes_read: int = 0
    progress: Callable[[int, int], None] | None = field(default=None)
    _reported: tuple[int, int] = (0, 0)
    header_rec: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    measured: dict[str, Any] | None = None

    def fail(self, line: int, msg: str) -> None:
        where = f"{self.path}:{line}: {msg}"
        if not self.skip_bad_lines:
            raise TraceError(where)
        self.skipped += 1
        if self.first_skipped is None:
            self.first_skipped = where

    def start(self, rec: Any, line: int) -> TraceBuilder | None:
        detected = detect_format(rec)
        fmt = self.fmt if self.fmt != "auto" else detected
        if detected is not None and fmt != detected:  # read as another format: wrong block size, fields
            raise TraceError(f"{self.path}:{line}: --format {fmt}, but this is a {detected} trace; "
                             f"drop --format (detected) or pass --format {detected}")
        if fmt is None:
            self.fail(line, "cannot tell the trace format (expected 'hash_ids', 'token_ids' or "
                            "'block_hashes'); pass --format")
            return None
        bs = self.block_size or DEFAULT_BLOCK_SIZE.get(fmt, self.default_block_size)
        limit = self.max_distinct_blocks
        self.builder = TraceBuilder(self.path.name, fmt, bs, keep=self.keep,
                                    max_distinct_blocks=limit(fmt, bs) if callable(limit) else limit)
        return self.builder

    def header(self, rec: dict[str, Any], line: int) -> None:
        """The kvstrata format's header line: its version, and the trace's block size."""
        version = header_version(rec)
        if type(version) is not int or version < 1:
            raise TraceError(f"{self.path}:{line}: '{HEADER_KEY}': expected a format version (1, 2, ...), got "
                             f"{short_repr(version)}")
        if version > TRACE_VERSION:
            raise TraceError(f"{self.path}:{line}: written in kvstrata trace format {version}; this kvstrata reads "
                             f"format {TRACE_VERSION} and older: upgrade kvstrata")
        if self.fmt not in ("auto", "kvstrata"):
            raise TraceError(f"{self.path}:{line}: --format {self.fmt}, but this is a kvstrata trace; "
                             "drop --format (detected) or pass --format kvstrata")
        self.fmt = "kvstrata"
        self.header_rec = rec
        bs = rec.get("block_size")
        if bs is None:
            return
        if type(bs) is not int or bs < 1:
            raise TraceError(f"{self.path}:{line}: 'block_size': expected a positive integer, got {short_repr(bs)}")
        if self.block_size is not None and self.block_size != bs:
            raise TraceError(f"{self.path}:{line}: the header says {bs}-token blocks, --block-size says "
                             f"{self.block_size}")
        self.block_size = bs

    def feed(self, raw: bytes, line: int) -> None:
        if line == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        try:
            rec = parse_line(raw)
            if rec is None:
                return
            if not isinstance(rec, dict):
                raise BadRecord(f"expected a JSON object, got {type(rec).__name__}")
            if is_header(rec) and (self.builder is None or line == 1):  # a later part's header too
                self.header(rec, line)
                return
            b = self.builder or self.start(rec, line)
            if b is not None:
                ADDERS[b.format](b, rec, line)
        except BadRecord as e:
            if not raw.endswith(b"\n"):  # the last line, cut off: the writer was killed mid-line
                self.notes.append(f"{self.path}:{line}: the last line is cut off (the writer stopped while "
                                  "writing it): skipped")
                return
            self.fail(line, str(e))
        except TooManyBlocks as e:
            raise TraceError(f"{self.path}:{line}: {e}") from None

    def read_lines(self, fh: BinaryIO) -> Iterator[bytes | None]:
        """Each line's bytes; None for a line longer than ``max_line_bytes``, whose rest is
        then read and dropped in bounded pieces."""
        limit = self.max_line_bytes
        while raw := fh.readline(limit + 1):
            self.bytes_read += len(raw)
            if len(raw) <= limit or raw.endswith(b"\n"):
                yield raw
                continue
            yield None
            while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                self.bytes_read += len(rest)
            self.bytes_read += len(rest)

    def report(self) -> None:
        """Calls ``progress(lines, bytes)`` every few thousand lines or megabytes."""
        lines, nbytes = self._reported
        if self.progress is not None and (self.lines - lines >= _PROGRESS_LINES
                                          or self.bytes_read - nbytes >= _PROGRESS_BYTES):
            self._reported = (self.lines, self.bytes_read)
            self.progress(*self._reported)

    def read(self, fh: BinaryIO) -> Iterator[Request]:
        """Each request as its line is read."""
        lines = self.read_lines(fh)
        while True:
            try:
                raw = next(lines, False)
            except OSError as e:
                raise TraceError(f"{self.path}:{self.lines + 1}: cannot read trace: {e.strerror or e}") from None
            if raw is False:
                return
            self.lines += 1
            if raw is None:
                self.fail(self.lines, f"line longer than {self.max_line_bytes} bytes")
            else:
                self.feed(raw, self.lines)
            if self.progress is not None:
                self.report()
            b = self.builder
            if b is not None and b.last is not None:
                req, b.last = b.last, None
                yield req

    def requests(self) -> Iterator[Request]:
        """Open the file (every part of a recording, for a directory) and yield its requests;
        an empty trace is a :class:`TraceError` at the end."""
        root = self.path
        if root.is_dir():

            files, self.notes, measured = recording_parts(root)
        else:
            files, measured = [root], None
        for path in files:
            self.path, self.lines = path, 0
            try:  # a FIFO given as the trace is read as a stream (a recording's parts are regular files)
                fh = open(path, "rb", buffering=1 << 20)
            except FileNotFoundError:
                raise TraceError(f"{path}: trace file not found") from None
            except OSError as e:
                raise TraceError(f"{path}: cannot read trace: {e.strerror}") from None
            with fh:
                yield from self.read(fh)
        if self.progress is not None:
            self.progress(self.lines, self.bytes_read)
        if self.builder is None or not self.builder.num_requests:
            why = f" ({plural(self.skipped, 'bad line')} skipped)" if self.skipped else ""
            raise TraceError(f"{self.path}:{self.lines}: empty trace: no requests{why}")
        if not root.is_dir():

            measured = measured_of(files[0], self.header_rec)
        self.measured = measured
        self.path = root

    def info(self) -> TraceInfo:
        if self.builder is None:
            return TraceInfo(self.path.name, self.fmt, self.block_size or 0, skipped_lines=self.skipped,
                             first_skipped=self.first_skipped, header=self.header_rec, notes=list(self.notes))
        return self.builder.info(self.skipped, self.first_skipped, self)


def _check_block_size(block_size: int | None) -> None:
    if block_size is not None and (type(block_size) is not int or block_size < 1):
        raise TraceError(f"--block-size: expected a positive integer, got {block_size!r}")


class TraceReader:
    """A JSONL trace read once, request by request, as it is iterated (a pipe or FIFO works).

    Nothing is kept per request; :attr:`info` counts what has been read so far
    (all of it once the iteration ends). :attr:`block_size` is known once the
    first request has been read. Arguments as :func:`load_trace`, plus
    ``max_distinct_blocks``: more distinct blocks than this is a
    :class:`TraceError`; None: no limit; a function of (format, block size)
    returning the limit, called once the format is known.
    """

    def __init__(self, path: str | Path, fmt: str = "auto", *, block_size: int | None = None,
                 default_block_size: int = 16, skip_bad_lines: bool = False,
                 progress: Callable[[int, int], None] | None = None, max_line_bytes: int = MAX_LINE_BYTES,
                 max_distinct_blocks: DistinctLimit = None) -> None:
        _check_block_size(block_size)
        self._loader = _Loader(Path(path), normalize_format(fmt), block_size, default_block_size, skip_bad_lines,
                               max_line_bytes, keep=False, max_distinct_blocks=max_distinct_blocks,
                               progress=progress)
        self._iterated = False

    def __iter__(self) -> Iterator[Request]:
        if self._iterated:
            raise TraceError(f"{self._loader.path}: a trace is read once (it may be a pipe)")
        self._iterated = True
        return self._loader.requests()

    @property
    def block_size(self) -> int:
        b = self._loader.builder
        if b is None:
            raise ValueError("TraceReader.block_size: known once the first request has been read")
        return b.block_size

    @property
    def info(self) -> TraceInfo:
        return self._loader.info()


def load_trace(path: str | Path, fmt: str = "auto", *, block_size: int | None = None,
               default_block_size: int = 16, skip_bad_lines: bool = False,
               progress: Callable[[int, int], None] | None = None,
               max_line_bytes: int = MAX_LINE_BYTES) -> Trace:
    """Read a whole JSONL trace into memory in one pass (a pipe or FIFO works).

    ``fmt``: ``auto`` (decided by the first record), ``mooncake``, ``qwen`` or
    ``kvstrata``. ``block_size``: tokens per block id; defaults to 512 for
    Mooncake, 16 for Qwen-Bailian and ``default_block_size`` (the config's)
    for kvstrata traces. ``progress(lines, bytes)`` is called now and then with
    what has been read so far. A line longer than ``max_line_bytes`` is a bad
    line. Raises :class:`TraceError` naming file and line. Keeps every
    request: use :class:`TraceReader` for traces of any size.
    """
    _check_block_size(block_size)
    loader = _Loader(Path(path), normalize_format(fmt), block_size, default_block_size, skip_bad_lines,
                     max_line_bytes, progress=progress)
    for _ in loader.requests():
        pass
    assert loader.builder is not None
    return loader.builder.build(loader.skipped, loader.first_skipped, loader)
