"""Trace formats, auto-detection and bad-input errors (file:line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.trace.reader import TraceError, detect_format, load_trace

DATA = Path(__file__).parent / "data"


def write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_mooncake_detected_with_512_token_blocks_and_ms_timestamps() -> None:
    tr = load_trace(DATA / "small_mooncake.jsonl")
    assert tr.format == "mooncake" and tr.block_size == 512
    assert [r.timestamp for r in tr.requests] == [0.0, 1.0, 2.5, 4.0]
    assert tr.num_accesses == 10 and tr.num_distinct_blocks == 5
    a, b, _, d = tr.requests
    assert a.blocks[:2] == b.blocks[:2] and a.blocks == d.blocks and a.blocks[2] != b.blocks[2]
    assert a.hittable == 3 and a.input_length == 1500 and a.output_length == 10
    assert [r.line for r in tr.requests] == [1, 2, 4, 5]   # the blank line 3 is skipped


def test_qwen_bailian_detected_with_16_token_blocks_and_second_timestamps() -> None:
    tr = load_trace(DATA / "small_qwen.jsonl")
    assert tr.format == "qwen" and tr.block_size == 16
    assert [r.timestamp for r in tr.requests] == [0.0, 1.0, 2.5]
    assert tr.requests[1].blocks[:3] == tr.requests[0].blocks
    assert tr.num_distinct_blocks == 6


def test_kvstrata_tokens_are_chained_full_blocks_and_salt_separates_tenants() -> None:
    tr = load_trace(DATA / "small_kvstrata.jsonl", block_size=4)
    assert tr.format == "kvstrata" and tr.token_based
    r0, r1, r2, r3 = tr.requests
    assert len(r0.blocks) == 2 and r0.blocks == r1.blocks      # 9 and 10 tokens: 2 full blocks each
    assert r0.hittable == 2 and r1.hittable == 2
    assert set(r2.blocks).isdisjoint(r0.blocks)                 # cache_salt
    assert len(r3.blocks) == 2 and r3.input_length == 8
    assert tr.num_distinct_blocks == 6


def test_token_prompt_of_whole_blocks_leaves_last_block_unhittable(tmp_path: Path) -> None:
    p = write(tmp_path, [json.dumps({"timestamp": 0, "token_ids": list(range(8))})])
    (r,) = load_trace(p, block_size=4).requests
    assert len(r.blocks) == 2 and r.hittable == 1


def test_default_block_size_for_kvstrata_comes_from_caller(tmp_path: Path) -> None:
    p = write(tmp_path, [json.dumps({"timestamp": 0, "token_ids": list(range(40))})])
    assert len(load_trace(p, default_block_size=16).requests[0].blocks) == 2


def test_forced_format_and_detection() -> None:
    assert detect_format({"hash_ids": [1], "timestamp": 0}) == "mooncake"
    assert detect_format({"chat_id": 1, "hash_ids": [1]}) == "qwen"
    assert detect_format({"token_ids": [1]}) == "kvstrata"
    assert detect_format({"foo": 1}) is None
    with pytest.raises(TraceError, match="--format mooncake, but this is a qwen trace"):
        load_trace(DATA / "small_qwen.jsonl", "mooncake")  # would read seconds as ms, 16-token blocks as 512
    assert load_trace(DATA / "small_qwen.jsonl", "qwen").format == "qwen"


# a recorded request (kvstrata format, version 2) with ``%s`` among its keys
REC = ('{"timestamp": 0, "duration": 5, "input_length": 40, "output_length": 8, "block_hashes": [1, 2], '
       '"output_block_hashes": [3, 4], %s}')


@pytest.mark.parametrize("lines, line, words", [
    (['{"timestamp": 0, "hash_ids": [1]}', '{"timestamp": 5, "hash_ids": [1, 2'], 2, "truncated"),
    (['{"timestamp": 0, "hash_ids": [1]}', 'hello'], 2, "not valid JSON"),
    (['{"timestamp": 0, "hash_ids": [1]}', '{"timestamp": 1, "input_length": 5}'], 2, "missing 'hash_ids'"),
    (['{"timestamp": -3, "hash_ids": [1]}'], 1, "negative"),
    (['{"timestamp": 5, "hash_ids": [1]}', '{"timestamp": 4, "hash_ids": [2]}'], 2, "earlier than"),
    (['{"timestamp": 0, "hash_ids": [1, 1]}'], 1, "twice"),
    (['{"timestamp": 0, "hash_ids": [1.5]}'], 1, "integers"),
    (['[1, 2]'], 1, "JSON object"),
    (['{"foo": 1}'], 1, "--format"),
    ([REC % '"preemptions": {}'], 1, "'preemptions' must be a list"),
    ([REC % '"preemptions": [[1, 2]]'], 1, "[preempted_s, resumed_s, tokens]"),
    ([REC % '"preemptions": [[2, 1, 40]]'], 1, "out of order"),
    ([REC % '"preemptions": [[1, 2, 40], [1.5, 3, 40]]'], 1, "out of order"),
    ([REC % '"preemptions": [[1, 9, 40]]'], 1, "past the request's duration"),
    ([REC % '"preemptions": [[1, 2, -4]]'], 1, "'tokens' must be an integer"),
    ([REC % '"preemptions": [["a", 2, 4]]'], 1, "'preempted_s' must be a number"),
])
def test_bad_lines_name_file_and_line(tmp_path: Path, lines: list[str], line: int, words: str) -> None:
    p = write(tmp_path, lines)
    with pytest.raises(TraceError) as e:
        load_trace(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: ") and words in msg and "\n" not in msg


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match=r"empty\.jsonl:\d+: empty trace"):
        load_trace(write(tmp_path, [""], "empty.jsonl"))


def test_skip_bad_lines_counts_them(tmp_path: Path) -> None:
    p = write(tmp_path, ['{"timestamp": 0, "hash_ids": [1]}', 'garbage', '{"timestamp": 1, "hash_ids": [1, 2]}',
                         '{"timestamp": 0.5, "hash_ids": [3]}', '{"timestamp": 2, "hash_ids": [1, 2'])
    tr = load_trace(p, skip_bad_lines=True)
    assert len(tr.requests) == 2 and tr.skipped_lines == 3
    assert tr.first_skipped is not None and tr.first_skipped.startswith(f"{p}:2:")
    with pytest.raises(TraceError, match="empty trace.*2 bad lines"):
        load_trace(write(tmp_path, ["x", "y"], "bad.jsonl"), skip_bad_lines=True)


def write_bytes(tmp_path: Path, lines: list[bytes], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


GOOD = b'{"timestamp": 0, "hash_ids": [1]}'
TOKENS = b'{"timestamp": 0, "token_ids": [1, 2, 3, 4, 5]}'
DEEP = 5000
BAD_LINES = [   # (first line, bad line, words): the bad line is line 2
    (GOOD, b'{"timestamp": 1, "hash_ids": [1%s]}' % (b"0" * 5000), "more than 4300 digits"),
    (GOOD, b'{"timestamp": 1, "chat_id": 1%s}' % (b"0" * 5000), "more than 4300 digits"),
    (GOOD, b'{"timestamp": 1%s, "hash_ids": [1]}' % (b"0" * 400), "'timestamp' must be a finite number"),
    (GOOD, b'{"timestamp": 1e400, "hash_ids": [1]}', "'timestamp' must be a finite number"),
    (GOOD, b'{"timestamp": 1, "hash_ids": [1], "x": %s}' % (b"[" * DEEP + b"]" * DEEP), "nested too deeply"),
    (GOOD, b'{"timestamp": 1, "hash_ids": [1], "x": %s1%s}' % (b'{"a": ' * DEEP, b"}" * DEEP), "nested too deeply"),
    (GOOD, b'[' * DEEP + b']' * DEEP, "nested too deeply"),
    (GOOD, b'{"timestamp": 1, "hash_ids": [1], "output_length": 1%s}' % (b"0" * 30), "'output_length' must be"),
    (GOOD, b'{"timestamp": 1, "hash_ids": [%s]}' % (b"[" * 500 + b"]" * 500),
     "'hash_ids' must hold integers or hex strings, got [[[[...]]]]"),
    (GOOD, b'{"timestamp": 1, "hash_ids": [2], "x": "\xff"}', "not UTF-8 text"),
    (TOKENS, b'{"timestamp": 1, "token_ids": [1, 2], "cache_salt": [1]}', "'cache_salt' must be a string"),
    (TOKENS, b'{"timestamp": 1, "token_ids": [1, 2], "lora": {"a": 1}}', "'lora' must be a string or an integer"),
    (TOKENS, b'{"timestamp": 1, "block_hashes": [1, 2, 3], "input_length": 8}', "'input_length' 8 is too small"),
]


BAD_IDS = ["huge-id", "huge-chat-id", "huge-timestamp", "inf-timestamp", "deep-arrays", "deep-objects",
           "deep-top-level", "huge-output-length", "nested-id", "not-utf8", "list-salt", "object-lora",
           "short-input-length"]


@pytest.mark.parametrize("first, bad, words", BAD_LINES, ids=BAD_IDS)
def test_oversized_deep_and_mistyped_values_are_bad_lines(tmp_path: Path, first: bytes, bad: bytes,
                                                          words: str) -> None:
    p = write_bytes(tmp_path, [first, bad])
    with pytest.raises(TraceError) as e:
        load_trace(p, block_size=4)
    msg = str(e.value)
    assert msg.startswith(f"{p}:2: ") and words in msg and "\n" not in msg and len(msg) < len(str(p)) + 200


def test_skip_bad_lines_counts_every_kind_of_bad_line(tmp_path: Path) -> None:
    lines = [TOKENS]
    for i, (_, bad, _) in enumerate(BAD_LINES[-3:] * 2 + BAD_LINES[:-3]):
        lines += [bad, b'{"timestamp": %d, "token_ids": [1, 2, 3, 4, %d]}' % (i + 1, i)]
    p = write_bytes(tmp_path, lines)
    tr = load_trace(p, block_size=4, skip_bad_lines=True)
    bad = len(BAD_LINES) + 3
    assert tr.skipped_lines == bad and len(tr.requests) == 1 + bad
    assert [r.line for r in tr.requests] == list(range(1, len(lines) + 1, 2))
    assert tr.first_skipped is not None and tr.first_skipped.startswith(f"{p}:2: 'cache_salt'")


def test_block_hashes_may_end_in_a_partial_block(tmp_path: Path) -> None:
    p = write_bytes(tmp_path, [TOKENS, b'{"timestamp": 1, "block_hashes": [1, 2, 3], "input_length": 9}'])
    assert [r.input_length for r in load_trace(p, block_size=4).requests] == [5, 9]


def test_line_longer_than_the_limit_is_a_bad_line_and_the_rest_is_read(tmp_path: Path) -> None:
    long_line = b'{"timestamp": 1, "hash_ids": [%s]}' % b", ".join(b"%d" % i for i in range(2000))
    exact = b'{"timestamp": 2, "hash_ids": [1]%s}' % (b" " * (1000 - len(GOOD)))   # 1000 bytes and a newline
    assert len(exact) == 1000
    p = write_bytes(tmp_path, [GOOD, long_line, exact, exact + b" "])
    with pytest.raises(TraceError, match=rf"^{p}:2: line longer than 1000 bytes$"):
        load_trace(p, max_line_bytes=1000)
    tr = load_trace(p, max_line_bytes=1000, skip_bad_lines=True)
    assert [r.line for r in tr.requests] == [1, 3] and tr.skipped_lines == 2
    assert tr.first_skipped == f"{p}:2: line longer than 1000 bytes"
    assert len(load_trace(p, max_line_bytes=len(long_line)).requests) == 4


def test_byte_order_mark_is_accepted_at_the_start_only(tmp_path: Path) -> None:
    p = write_bytes(tmp_path, [b"\xef\xbb\xbf" + GOOD, b'{"timestamp": 1, "hash_ids": [1, 2]}'])
    tr = load_trace(p)
    assert tr.format == "mooncake" and [r.line for r in tr.requests] == [1, 2]
    p = write_bytes(tmp_path, [GOOD, b"\xef\xbb\xbf" + GOOD], "bom2.jsonl")
    with pytest.raises(TraceError, match=rf"^{p}:2: not valid JSON"):
        load_trace(p)


def test_not_utf8_names_the_line_it_is_on(tmp_path: Path) -> None:
    p = write_bytes(tmp_path, [GOOD] * 3000 + [b'{"timestamp": 1, "hash_ids": ["\xc3\x28"]}'])
    with pytest.raises(TraceError, match=rf"^{p}:3001: not UTF-8 text \(byte 0xc3 at column 32\)$"):
        load_trace(p)


def test_progress_reports_lines_and_bytes_read(tmp_path: Path) -> None:
    p = write_bytes(tmp_path, [GOOD] * 10_000)
    calls: list[tuple[int, int]] = []
    load_trace(p, progress=lambda lines, nbytes: calls.append((lines, nbytes)))
    assert calls[0] == (4096, 4096 * (len(GOOD) + 1)) and calls[-1] == (10_000, p.stat().st_size)
    assert calls == sorted(calls)


def test_reads_a_pipe_once(tmp_path: Path) -> None:
    import os
    import threading

    r, w = os.pipe()
    data = b"\n".join([GOOD] * 20_000) + b"\n"   # more than a pipe holds

    def feed() -> None:
        with os.fdopen(w, "wb") as fh:
            fh.write(data)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        tr = load_trace(f"/dev/fd/{r}")
    finally:
        writer.join()
        os.close(r)
    assert len(tr.requests) == 20_000


def test_bad_block_size_is_an_error() -> None:
    for bad in (0, -1):
        with pytest.raises(TraceError, match="--block-size: expected a positive integer"):
            load_trace(DATA / "small_mooncake.jsonl", block_size=bad)


def test_a_skipped_line_adds_no_blocks(tmp_path) -> None:
    """A line refused for a repeated hash used to intern its ids all the same: the trace
    then counted a thousand distinct blocks no request accessed."""
    path = tmp_path / "t.jsonl"
    bad = list(range(1000)) + [5]
    path.write_text('{"timestamp": 0, "hash_ids": [1, 2], "input_length": 1024, "output_length": 1}\n'
                    f'{{"timestamp": 1, "hash_ids": {bad}, "input_length": 1024, "output_length": 1}}\n')
    trace = load_trace(path, "mooncake", skip_bad_lines=True)
    assert trace.skipped_lines == 1 and trace.num_distinct_blocks == 2


def test_kvstrata_header_versions_the_format_and_gives_the_block_size(tmp_path: Path) -> None:
    """The kvstrata format's optional header line: its version (a newer one stops the read),
    and the block size its block hashes were cut with."""
    from kvstrata.trace.reader import TRACE_VERSION, TraceReader

    rows = ['{"timestamp": 0, "block_hashes": [1, 2, 3]}', '{"timestamp": 1, "block_hashes": [1, 2, 4]}']
    p = write(tmp_path, [json.dumps({"kvstrata_trace": TRACE_VERSION, "block_size": 64, "note": "ignored"}), *rows])
    tr = load_trace(p)
    assert tr.format == "kvstrata" and tr.block_size == 64 and len(tr.requests) == 2
    assert tr.requests[0].input_length == 3 * 64
    reader = TraceReader(p)
    assert sum(1 for _ in reader) == 2 and reader.block_size == 64
    with pytest.raises(TraceError, match=r":1: the header says 64-token blocks, --block-size says 16"):
        load_trace(p, block_size=16)
    with pytest.raises(TraceError, match=r":1: --format mooncake, but this is a kvstrata trace"):
        load_trace(p, "mooncake")
    newer = write(tmp_path, [json.dumps({"kvstrata_trace": TRACE_VERSION + 1}), *rows])
    with pytest.raises(TraceError, match=rf":1: written in kvstrata trace format {TRACE_VERSION + 1}; this kvstrata "
                                         rf"reads format {TRACE_VERSION} and older"):
        load_trace(newer, skip_bad_lines=True)  # not a bad line: nothing after it can be read right
    bad = write(tmp_path, [json.dumps({"kvstrata_trace": "1"}), *rows])
    with pytest.raises(TraceError, match="'kvstrata_trace': expected a format version"):
        load_trace(bad)


def test_the_readmes_example_trace_reads_as_it_says(tmp_path: Path) -> None:
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### The kvstrata trace format"):]
    example = re.search(r"^```\n(.*?)^```", section, re.M | re.S).group(1)
    tr = load_trace(write(tmp_path, example.strip().splitlines()))
    assert tr.format == "kvstrata" and tr.block_size == 16 and len(tr.requests) == 3
    assert tr.requests[1].blocks[:2] == tr.requests[0].blocks[:2]  # equal hashes: shared blocks
    assert tr.requests[0].input_length == 40 and tr.requests[1].output_length == 128


def test_one_huge_line_stops_at_the_distinct_block_limit_before_it_fills_the_map(tmp_path) -> None:
    """Regression: a single line's blocks were all interned before the limit was checked
    (one 56 MiB line reached 1.2 GiB first)."""
    import json as _json

    from kvstrata.trace.reader import TraceReader

    path = tmp_path / "huge.jsonl"
    path.write_text(_json.dumps({"timestamp": 0, "hash_ids": list(range(3)), "output_length": 1}) + "\n"
                    + _json.dumps({"timestamp": 1, "hash_ids": list(range(200_000)), "output_length": 1}) + "\n")
    reader = TraceReader(path, "mooncake", block_size=16, max_distinct_blocks=1000)
    with pytest.raises(TraceError, match=r"huge.jsonl:2: more than 1,000 distinct blocks"):
        list(reader)
    assert reader.info.num_distinct_blocks == 3  # nothing of line 2 was interned
