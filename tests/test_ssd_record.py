"""The SSD tier's record format: header, codecs, footprint, namespaces (no files)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.ssd.record import (HEADER, PAGE, PLANES, RAW, RECORD_VERSION, ZSTD, Codec,
                                     CorruptRecord, Encoded, Header, capacity_blocks,
                                     checksum, namespace_of, record_footprint, split_tail)


def kv_like(nbytes: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(nbytes // 2) * 0.7).astype(np.float16).tobytes()


def rand(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def test_header_round_trips_and_every_flipped_byte_is_caught():
    hdr = Header(PLANES, 65536, 40000, 3136, 0x1234_5678_9ABC_DEF0, 77, 12)
    packed = hdr.pack() + b"t" * 3136
    assert Header.unpack(packed) == hdr and len(hdr.pack()) == HEADER.size == 44
    assert Header.clock_of(packed) == 77 and Header.clock_of(hdr.with_clock(2**40).pack()) == 2**40
    for i in range(HEADER.size):
        bad = bytearray(packed)
        bad[i] ^= 0x01
        with pytest.raises(CorruptRecord):
            Header.unpack(bytes(bad))
    with pytest.raises(CorruptRecord, match="lengths"):
        Header.unpack(packed[:-1])          # the tail is one byte short
    assert hdr.with_clock(5).clock == 5 and hdr.at_page(9).page == 9 and hdr.pages == 9


def test_checksum_is_bound_to_the_key():
    data = rand(4096)
    assert checksum(b"a" * 48, data) != checksum(b"b" * 48, data)
    assert checksum(b"a" * 48, data) == checksum(b"a" * 48, bytearray(data))


def test_auto_stores_random_bytes_raw_and_kv_in_byte_planes():
    codec = Codec("auto")
    assert codec.encode(rand(65536))[0] == RAW
    assert codec.encode(kv_like(65536))[0] == PLANES
    assert Codec("zstd").encode(kv_like(8192) + b"\x01")[0] == ZSTD  # odd length
    assert Codec("none").encode(kv_like(65536)) == (RAW, kv_like(65536))


@pytest.mark.parametrize("compression", ["none", "zstd", "auto"])
def test_codec_decodes_into_a_buffer_as_it_decodes_to_bytes(compression):
    codec = Codec(compression)
    for data in (kv_like(65536, 1), rand(65536, 2), kv_like(8192, 3) + b"\x01"):  # odd: zstd
        kind, payload = codec.encode(data)
        out = bytearray(len(data))
        assert codec.decode(kind, payload, len(data), memoryview(out)) is not None
        assert bytes(out) == data == codec.decode(kind, payload, len(data))
        with pytest.raises(ValueError, match="^into"):
            codec.decode(kind, payload, len(data), memoryview(bytearray(len(data) - 1)))
        if kind != RAW:
            with pytest.raises(CorruptRecord):
                codec.decode(kind, payload[:-7], len(data), memoryview(out))


def test_codec_arguments_are_named():
    with pytest.raises(ValueError, match="^compression"):
        Codec("lz4")
    with pytest.raises(ValueError, match="^level"):
        Codec("zstd", level=99)


@pytest.mark.parametrize("payload,pages,tail", [
    (1000, 0, 1000), (4096, 1, 0), (65536, 16, 0), (65536 + 500, 16, 500),
    (65536 + 1024, 16, 1024), (65536 + 1025, 17, 0), (100_000, 25, 0)])
def test_footprint_is_whole_body_pages_plus_two_index_entries(payload, pages, tail):
    key = 48
    assert split_tail(payload) == tail
    index = (key + HEADER.size + tail + 10) + (8 + key + 10)
    assert record_footprint(key, payload) == pages * PAGE + index


def test_encoded_record_carries_its_footprint_and_a_verifiable_head():
    nskey = namespace_of(b"fp") + b"k" * 32
    data = rand(65536 + 500)
    e = Encoded(nskey, data, Codec("none"))
    assert e.pages == 16 and len(e.body) == 65536 and e.tail == data[65536:]
    assert e.footprint == record_footprint(48, len(data))
    head = e.head(clock=7)
    hdr = Header.unpack(head)
    assert hdr.clock == 7 and hdr.checksum == checksum(nskey, data) and head[HEADER.size:] == e.tail


def test_capacity_blocks_inverts_the_footprint_with_the_namespace_prefix():
    fp = record_footprint(16 + 32, 65536)
    assert capacity_blocks(10 * fp, 65536) == 10
    assert capacity_blocks(10 * fp - 1, 65536) == 9
    assert capacity_blocks(0, 65536) == 0
    assert capacity_blocks(10 * fp, 65536, key_len=8) == 10  # shorter keys, same page count
    with pytest.raises(ValueError):
        capacity_blocks(-1, 65536)


def test_namespace_depends_on_fingerprint_and_record_version():
    a, b = namespace_of(b"model-a"), namespace_of(b"model-b")
    assert len(a) == len(b) == 16 and a != b and a == namespace_of(b"model-a")
    assert RECORD_VERSION == 3  # a change here empties every existing tier at open
