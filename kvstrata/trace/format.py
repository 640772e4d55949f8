"""kvstrata's trace format: what a header line says, and the names every part agrees on.

The reader (:mod:`~kvstrata.trace.reader`), the recorder that writes the format
(:mod:`~kvstrata.trace.recorder`) and the reader of recordings
(:mod:`~kvstrata.trace.parts`) import this module, and nothing imports them
back. The README's "trace format" section documents the keys.
"""

from __future__ import annotations

from typing import Any

from kvstrata.identity.fingerprint import PREVIOUS_NAME

__all__ = ["TRACE_VERSION", "HEADER_KEY", "PREVIOUS_HEADER_KEY", "HASH_BYTES", "MEASURED_SUFFIX", "TraceError",
           "header_version", "is_header"]

TRACE_VERSION = 3           # the kvstrata format's version this reader reads (and anything older);
                            # 2 added the recorder's keys (recording, deployment, output_block_hashes, duration,
                            # preemptions); 3 names the header key after kvstrata
HEADER_KEY = "kvstrata_trace"  # the kvstrata format's header line: {"kvstrata_trace": 3, "block_size": 16}
PREVIOUS_HEADER_KEY = f"{PREVIOUS_NAME}_trace"  # the header key of versions 1 and 2 (still read)
HASH_BYTES = 16                   # of each block hash in a recording (128 bits)
MEASURED_SUFFIX = ".measured.json"  # a recording's measured counters: <id>.measured.json


class TraceError(ValueError):
    """The trace file is missing or malformed; the message starts with ``file:line``."""


def header_version(record: dict[str, Any]) -> Any:
    """The format version a header line states (under either header key); None when the
    record is no header."""
    if HEADER_KEY in record:
        return record[HEADER_KEY]
    return record.get(PREVIOUS_HEADER_KEY)


def is_header(record: dict[str, Any]) -> bool:
    """Is ``record`` a header line of the kvstrata format (of any version)?"""
    return HEADER_KEY in record or PREVIOUS_HEADER_KEY in record
