"""Trace formats, auto-detection and bad-input errors (file:line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.bench.traces import TraceError, detect_format, load_trace

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


def test_tierkv_tokens_are_chained_full_blocks_and_salt_separates_tenants() -> None:
    tr = load_trace(DATA / "small_tierkv.jsonl", block_size=4)
    assert tr.format == "tierkv" and tr.token_based
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


def test_default_block_size_for_tierkv_comes_from_caller(tmp_path: Path) -> None:
    p = write(tmp_path, [json.dumps({"timestamp": 0, "token_ids": list(range(40))})])
    assert len(load_trace(p, default_block_size=16).requests[0].blocks) == 2


def test_forced_format_and_detection() -> None:
    assert detect_format({"hash_ids": [1], "timestamp": 0}) == "mooncake"
    assert detect_format({"chat_id": 1, "hash_ids": [1]}) == "qwen"
    assert detect_format({"token_ids": [1]}) == "tierkv"
    assert detect_format({"foo": 1}) is None
    tr = load_trace(DATA / "small_qwen.jsonl", "mooncake")   # forced: timestamps read as ms
    assert tr.requests[1].timestamp == pytest.approx(0.001)


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
