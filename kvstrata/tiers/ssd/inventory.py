"""What an SSD tier directory holds, for operators (``kvstrata ssd stats | verify``).

Read-only, beside a running owner or without one: the index is opened as one
more LMDB reader (a slot in the owner's ``lock.mdb``; with no owner running, no
slot: not a byte changes) and ``blocks.dat`` with ``O_RDONLY``, in a child process (a damaged environment can fault the
process that maps it; the child's failure is reported as an error, never a
crash of the caller). Nothing on disk changes.

* :func:`inventory`: records, logical bytes (as the blocks are), stored bytes
  (compressed payloads), bytes on disk, the compression ratio, each
  namespace's fingerprint (model identity, layout, TP rank) with its record
  count, pages in use and the page file's slack; with ``verify`` every
  record is read, decoded and its checksum compared (what a read does), and
  the ones that do not verify are counted by reason.
* :func:`tier_dirs`: a tier directory, or an ``ssd.path`` that holds one ``rank-<r>``
  tier per worker (and, under SGLang, ``pool-<name>/rank-<r>`` for a hybrid model's
  extra pools).

A record carries its last access as a position in the tier's access order; the
writer's time marks (one a minute at most, see :mod:`~kvstrata.tiers.ssd.index`)
turn that into "unused for at least" this long, to the minute; records used
after the last mark count as used now. ``older_than``: also list the keys of
the records provably unused for that long (what ``purge --older-than`` deletes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd.owner import held_by

__all__ = ["inventory", "tier_dirs", "held_by", "MAX_LISTED"]

MAX_LISTED = 1_000_000  # bad keys listed per namespace (what ``verify --drop`` deletes in one run)


def _ranks(root: Path) -> list[Path]:
    """``root``'s ``rank-<r>`` subdirectories that hold a tier, in rank order."""
    return sorted((p for p in root.glob("rank-*") if (p / "data.mdb").is_file() and p.name[5:].isdigit()),
                  key=lambda p: int(p.name[5:]))


def tier_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The tier directories at ``path``: itself when it holds ``data.mdb``, else its
    ``rank-<r>`` subdirectories that do (an ``ssd.path`` under vLLM), in rank order, then
    those of each ``pool-<name>`` subdirectory (an extra pool of a hybrid model under
    SGLang), by pool name. Where they are, not whose: a command proves each one a tier
    before it changes it (:func:`~kvstrata.tiers.ssd.directory.check_environment`)."""
    root = Path(os.path.expanduser(os.fspath(path)))
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory")
    if (root / "data.mdb").is_file():
        return [root]
    found = _ranks(root)
    for pool in sorted(p for p in root.glob("pool-*") if p.is_dir() and not p.is_symlink()):
        found += [pool] if (pool / "data.mdb").is_file() else _ranks(pool)
    if not found:
        raise ConfigError(f"{root}: not an SSD tier (no data.mdb) nor an ssd.path holding rank-<r> tiers")
    return found


def inventory(path: Path, *, verify: bool = False, older_than: float | None = None,
              timeout: float = 3600.0) -> dict[str, Any]:
    """What the tier at ``path`` holds (see the module docstring). Raises ``ConfigError``
    for a directory that is not a tier or one written by a newer kvstrata, ``OSError`` when
    it cannot be read."""
    from kvstrata.tiers.ssd.directory import check_environment
    from kvstrata.tiers.ssd.walk import child_command

    check_environment(path, str(path))
    code = "from kvstrata.tiers.ssd.inventory import _main; _main()"
    try:
        proc = subprocess.run(child_command(code, str(path), "1" if verify else "0",
                                            repr(-1.0 if older_than is None else float(older_than))),
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OSError(f"{path}: reading the tier took over {timeout:g} s") from None
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(f"{path}: cannot read the tier: {why[-1] if why else f'exit {proc.returncode}'}")
    out = json.loads(proc.stdout)
    if out.get("newer"):
        raise ConfigError(f"{path}: written by a newer kvstrata (record format {out['format']}); this one reads "
                          f"format {out['reads']}: use that kvstrata, or a new directory")
    out["held_by"] = held_by(path)
    return out


# ---------------------------------------------------------------- the child

def _main() -> None:
    """Child entry: argv ``path verify older_than`` (-1: none); the inventory as JSON on stdout."""
    path, verify, older = Path(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3])
    json.dump(_survey(path, verify, older if older >= 0 else None), sys.stdout)


def _survey(path: Path, verify: bool, older_than: float | None = None) -> dict[str, Any]:
    import msgpack

    from kvstrata.tiers.ssd.index import MARK_PREFIX, STATE, TIME_MARK, Index
    from kvstrata.tiers.ssd.record import CLOCK
    from kvstrata.tiers.ssd.arguments import file_size
    from kvstrata.tiers.ssd.pagefile import BLOCKS
    from kvstrata.tiers.ssd.record import NS_LEN, PAGE, RECORD_VERSION

    index = Index(path, 0, readonly=True)  # (a reader slot only beside a running owner)
    try:
        names = index.names()
        if b"meta" in names:
            index.open_dbs(create=False)
        meta = index.meta_items()
        about = msgpack.unpackb(meta.get(b"kvstrata", b"\x80"), raw=False) if b"kvstrata" in meta else {}
        fmt = about.get("format") if isinstance(about, dict) else None
        state = meta.get(b"state", b"")
        out: dict[str, Any] = {"path": str(path), "format": fmt, "reads": RECORD_VERSION,
                               "used_bytes": STATE.unpack(state)[0] if len(state) == STATE.size else None,
                               "created_at": about.get("created_at") if isinstance(about, dict) else None,
                               "files": {n: file_size(path / n) for n in ("data.mdb", BLOCKS)}}
        if isinstance(fmt, int) and fmt > RECORD_VERSION:
            return {**out, "newer": True}
        nskeys, heads = index.all_heads() if b"head" in names else ([], [])
        namespaces = {k[3:]: _about(v) for k, v in meta.items() if k.startswith(b"ns:")}
        marks = sorted((CLOCK.unpack(k[len(MARK_PREFIX):])[0], TIME_MARK.unpack(v)[0])
                       for k, v in meta.items() if k.startswith(MARK_PREFIX) and len(v) == TIME_MARK.size)
        pages = _open_pages(path / BLOCKS) if verify else None
        if verify and pages is None and nskeys:
            raise SystemExit(f"cannot open {BLOCKS} for reading")  # (the caller reports it)
        try:
            out.update(_count(nskeys, heads, namespaces, NS_LEN, PAGE, pages, fmt == RECORD_VERSION,
                              Ages(marks, older_than)))
        finally:
            if pages is not None:
                os.close(pages)
        return out
    finally:
        index.close()


def _about(value: bytes) -> dict[str, Any]:
    import msgpack

    try:
        about = msgpack.unpackb(value, raw=False)
    except Exception:
        return {}
    if not isinstance(about, dict):
        return {}
    fp = about.get("fingerprint")
    if isinstance(fp, bytes):
        about["fingerprint"] = fp.decode("utf-8", "replace")
        about["fingerprint_hex"] = fp.hex()  # exactly (the namespace is derived from these bytes)
    return about


def _open_pages(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None


class Ages:
    """Records' idle time from the time marks: a record last used at clock ``c`` was used
    by the first mark at or after ``c``; ``older_than``: the clock up to which records are
    provably unused for that long (the newest mark at least that old)."""

    def __init__(self, marks: list[tuple[int, float]], older_than: float | None) -> None:
        import time

        self.now = time.time()
        self.clocks = [c for c, _ in marks]
        self.times = [t for _, t in marks]
        self.idle: list[float] = []
        self.older_than = older_than
        old = [c for c, t in marks if older_than is not None and t <= self.now - older_than]
        self.threshold = max(old) if old else -1
        self.old_keys: dict[str, list[str]] = {}

    def add(self, nskey: bytes, clock: int, ns_len: int) -> None:
        import bisect

        if self.clocks:  # (a tier written before time marks: unknown)
            i = bisect.bisect_left(self.clocks, clock)
            self.idle.append(max(0.0, self.now - self.times[i]) if i < len(self.times) else 0.0)
        if clock <= self.threshold:
            _note(self.old_keys, nskey, ns_len)

    def summary(self) -> dict[str, Any]:
        idle = sorted(self.idle)
        pick = (lambda q: round(idle[min(len(idle) - 1, int(q * len(idle)))], 1)) if idle else (lambda q: None)
        out: dict[str, Any] = {"idle_at_least_s": {"p50": pick(0.5), "p90": pick(0.9), "max": pick(1.0)},
                               "time_marks": len(self.clocks)}
        if self.older_than is not None:
            out["older_than_s"] = self.older_than
            out["old_keys"] = self.old_keys
            out["old"] = sum(len(v) for v in self.old_keys.values())
        return out


def _count(nskeys: list[bytes], heads: list[bytes], namespaces: dict[bytes, dict[str, Any]], ns_len: int,
           page: int, pages_fd: int | None, current: bool, ages: Ages) -> dict[str, Any]:
    from kvstrata.tiers.ssd.index import parse_head

    per_ns: dict[bytes, dict[str, Any]] = {}
    total = {"records": 0, "logical_bytes": 0, "stored_bytes": 0, "page_bytes": 0, "unreadable_heads": 0}
    bad: dict[str, int] = {}
    bad_keys: dict[str, list[str]] = {}  # namespace prefix (hex) -> keys that do not verify (hex, unprefixed)
    checked = 0
    for nskey, head in zip(nskeys, heads):
        ns = per_ns.setdefault(nskey[:ns_len], {"records": 0, "logical_bytes": 0, "stored_bytes": 0})
        ns["records"] += 1
        total["records"] += 1
        hdr = parse_head(head) if current else None
        if hdr is None:
            total["unreadable_heads"] += 1
            if pages_fd is not None and current:
                bad["header"] = bad.get("header", 0) + 1
                _note(bad_keys, nskey, ns_len)
            continue
        for d in (ns, total):
            d["logical_bytes"] += hdr.raw_len
            d["stored_bytes"] += hdr.payload_len
        ages.add(nskey, hdr.clock, ns_len)
        total["page_bytes"] += hdr.pages * page
        if pages_fd is not None:
            checked += 1
            why = _check(nskey, hdr, head, pages_fd, page)
            if why:
                bad[why] = bad.get(why, 0) + 1
                _note(bad_keys, nskey, ns_len)
    out: dict[str, Any] = {**total, "namespaces": [
        {"prefix": p.hex(), **{k: v for k, v in namespaces.get(p, {}).items()}, **counts}
        for p, counts in sorted(per_ns.items(), key=lambda kv: -kv[1]["records"])]}
    known = set(per_ns)
    out["namespaces"] += [{"prefix": p.hex(), **about, "records": 0, "logical_bytes": 0, "stored_bytes": 0}
                          for p, about in namespaces.items() if p not in known]
    out.update(ages.summary())
    if pages_fd is not None:
        out["verify"] = {"checked": checked, "bad": sum(bad.values()), "bad_by_reason": bad, "bad_keys": bad_keys}
    return out


def _note(bad_keys: dict[str, list[str]], nskey: bytes, ns_len: int) -> None:
    keys = bad_keys.setdefault(nskey[:ns_len].hex(), [])
    if len(keys) < MAX_LISTED:
        keys.append(nskey[ns_len:].hex())


def _check(nskey: bytes, hdr: Any, head: bytes, fd: int, page: int) -> str | None:
    """Why the record does not verify, or None: what a read checks (payload, decode, checksum)."""
    from kvstrata.tiers.ssd.record import HEADER, Codec, CorruptRecord, checksum

    tail = head[HEADER.size:]
    body_len = hdr.payload_len - hdr.tail_len
    try:
        body = os.pread(fd, body_len, hdr.page * page) if body_len else b""
    except OSError:
        return "read error"
    if len(body) != body_len:
        return "page file too short"
    try:
        raw = Codec().decode(hdr.codec, body + tail, hdr.raw_len)
    except CorruptRecord:
        return "payload"
    return None if checksum(nskey, raw) == hdr.checksum else "checksum"
