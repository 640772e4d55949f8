"""What an SSD record costs against the tier's capacity: the record format's space
arithmetic, without bytes (the policy sizes the SSD tier with :func:`capacity_blocks`).

:func:`record_footprint` is the one rule the writer enforces and
:func:`capacity_blocks` inverts; :mod:`~kvstrata.tiers.ssd.record` holds the rest
of the format.
"""

from __future__ import annotations

import struct

__all__ = ["HEADER", "PAGE", "NS_LEN", "CLOCK", "TAIL_MAX", "split_tail", "body_pages", "record_footprint",
           "capacity_blocks"]

# version, codec, reserved, raw_len, payload_len, tail_len, checksum, clock, page, header_check
HEADER = struct.Struct("<BBHIIIQQQI")
PAGE = 4096
TAIL_MAX = 1024         # longest tail moved into the small head record
NS_LEN = 16             # bytes of the namespace prefix on every stored key
CLOCK = struct.Struct(">Q")  # an access clock as an LRU key: big endian, key order == clock order
_NODE = 10              # index leaf node header + slot, per entry

def split_tail(payload_len: int) -> int:
    """Bytes to move from the end of the payload into the head record.

    The body takes whole pages of the block file, so a 65,536-byte payload
    takes 16 pages and 65,600 bytes would take 17. Moving the few bytes past
    the last whole page into the small head record saves that page; tails
    longer than ``TAIL_MAX`` stay in the body (the head record would crowd the
    B-tree leaves for little gain). Payloads up to ``TAIL_MAX`` bytes live in
    the head record alone.
    """
    tail = payload_len % PAGE
    return tail if tail <= TAIL_MAX else 0


def body_pages(payload_len: int, tail_len: int) -> int:
    """Pages of the page file that hold a payload's body."""
    return -(-(payload_len - tail_len) // PAGE)


def record_footprint(key_len: int, payload_len: int) -> int:
    """Bytes one record occupies, as counted against the capacity.

    ``key_len`` is the stored key's length, namespace prefix included. The
    body's whole pages in the page file, plus the head entry (header and
    tail) and the LRU entry in the index.
    """
    tail = split_tail(payload_len)
    return (body_pages(payload_len, tail) * PAGE + (key_len + HEADER.size + tail + _NODE)
            + (CLOCK.size + key_len + _NODE))


def capacity_blocks(capacity_bytes: int, block_nbytes: int, key_len: int = 32) -> int:
    """How many uncompressed blocks of ``block_nbytes`` under keys of ``key_len`` bytes
    a tier of ``capacity_bytes`` holds before its own LRU evicts one."""
    if block_nbytes < 1 or key_len < 0 or capacity_bytes < 0:
        raise ValueError(f"capacity_blocks: expected capacity_bytes >= 0, block_nbytes >= 1 "
                         f"and key_len >= 0, got {capacity_bytes}, {block_nbytes}, {key_len}")
    return capacity_bytes // record_footprint(NS_LEN + key_len, block_nbytes)
