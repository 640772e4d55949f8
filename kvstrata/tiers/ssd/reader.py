"""Reads of the SSD tier: look heads up, read bodies, verify, decode.

A batch is read in three steps: blocks still in the write queue are copied
from there; the heads of the others are looked up in one index snapshot and
their bodies read from the page file (the kernel asked for all of a batch's
pages at once), all inside a reclaim epoch so that no page a head points to
is reused meanwhile; then each record is decoded and its checksum verified,
on the codec threads. ``get_into`` reads raw records straight into the
caller's buffers and verifies them there.

A record that does not verify is reported to the writer, which deletes it,
and is a miss; so is any I/O or index error (counted, logged once). A hit is
reported as an access, persisted by the writer's next transaction.

Threads: any number of threads read at once. A reader holds no state of
its own between calls; it takes the write queue's condition to copy queued
blocks, the reclaim lock to enter and leave its epoch, and the health lock
to count. Nothing here writes to the index or the page file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstrata.tiers.ssd.index import IndexFailure, parse_head
from kvstrata.tiers.ssd.record import HEADER, RAW, Codec, CorruptRecord, Header, checksum

if TYPE_CHECKING:
    from kvstrata.tiers.ssd.coders import Coders
    from kvstrata.tiers.ssd.health import Health
    from kvstrata.tiers.ssd.reclaim import Reclaim
    from kvstrata.tiers.ssd.recovery import Files
    from kvstrata.tiers.ssd.writequeue import WriteQueue

__all__ = ["Reader"]

# A record as read, before verification: queued raw bytes, ``(header, payload)`` to
# verify (header None: the head does not verify), or None (absent, or unreadable).
Record = Any


class Reader:
    """Verified reads of one tier's records (keys carry their namespace prefix)."""

    def __init__(self, *, files: "Files", reclaim: "Reclaim", queue: "WriteQueue",
                 codec: Codec, coders: "Coders", health: "Health") -> None:
        self.files = files
        self.reclaim = reclaim
        self.queue = queue
        self.codec = codec
        self.coders = coders
        self.health = health

    def get_many(self, nskeys: list[bytes]) -> list[bytes | None]:
        """The verified block of every key, or None."""
        records = self._read_records(nskeys)
        return self.coders.map(lambda kr: kr[1] if isinstance(kr[1], bytes) else self._verify(*kr),
                               list(zip(nskeys, records)))

    def get_into(self, nskeys: list[bytes], views: list[memoryview]) -> list[bool]:
        """Read every key's block into ``views[i]``; True where it verified there."""
        records = self._read_records(nskeys, views)
        return self.coders.map(lambda krv: self._land(*krv), list(zip(nskeys, records, views)))

    # ================================================================== reading

    def _read_records(self, nskeys: list[bytes], into: list[memoryview] | None = None
                      ) -> list[Record]:
        """Per key, a :data:`Record`. With ``into``, a raw record of the right size is read
        into ``into[i]``, which then stands for the payload."""
        records: list[Record]
        records, look = self.queue.held(nskeys)
        if not any(look):
            return records
        with self.reclaim.reading():
            try:
                heads = self.files.index.heads(nskeys, look)
            except IndexFailure as exc:
                self.health.count("read_errors")
                self.health.log_once("read", "read failed, reporting misses: %s", exc)
                return records
            parsed = [None if h is None else parse_head(h) for h in heads]
            self.files.pages.prefetch([(h.page, h.pages) for h in parsed if h is not None])
            for i, (head, hdr) in enumerate(zip(heads, parsed)):
                if head is not None:
                    records[i] = (None, head) if hdr is None else self._read_payload(
                        hdr, head, None if into is None else into[i])
        return records

    def _read_payload(self, hdr: Header, head: bytes, into: memoryview | None = None
                      ) -> Record:
        """The payload a verified head points to (not decoded, not verified); None on an
        I/O error. A raw payload of ``len(into)`` bytes is read into ``into``."""
        tail = head[HEADER.size:]
        body_len = hdr.payload_len - hdr.tail_len
        if not body_len:
            return hdr, tail
        in_place = into is not None and hdr.codec == RAW and hdr.raw_len == len(into)
        try:
            if in_place:
                assert into is not None
                got = self.files.pages.read_into(into[:body_len], hdr.page)
            else:
                body = self.files.pages.read(hdr.page, body_len)
                got = len(body)
        except OSError as exc:
            self.health.count("read_errors")
            self.health.log_once("read", "reading %s failed, reporting misses: %s",
                                 self.files.pages.path.name, exc)
            return None
        if got != body_len:
            return (None, head)  # the page file ends inside this body
        if in_place:
            assert into is not None
            into[body_len:] = tail
            return hdr, into
        return hdr, body + tail if tail else body

    # ================================================================== verifying

    def _land(self, nskey: bytes, rec: Record, view: memoryview) -> bool:
        """Put a record into ``view`` (where a raw one already is), verified."""
        if isinstance(rec, bytes):  # queued
            if len(rec) != len(view):
                return False
            view[:] = rec
            return True
        if rec is None or (rec[0] is not None and rec[0].raw_len != len(view)):
            return False
        return self._verify(nskey, rec, view) is not None

    def _verify(self, nskey: bytes, rec: Record, into: memoryview | None = None) -> Any:
        """The decoded block (in ``into`` when given) if it verifies, else None."""
        if rec is None:
            return None
        hdr, payload = rec
        try:
            if hdr is None:
                raise CorruptRecord("header")
            raw = self.codec.decode(hdr.codec, payload, hdr.raw_len, into)
            if checksum(nskey, raw) != hdr.checksum:
                raise CorruptRecord("checksum mismatch")
        except CorruptRecord as exc:
            self.health.log_once("corrupt", "deleting a record that does not verify (%s); "
                                 "further ones are counted in stats()['corrupt_deleted']", exc)
            self.queue.report_bad(nskey)
            return None
        self.queue.touch(nskey)
        return raw
