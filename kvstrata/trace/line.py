"""One line of a trace: its JSON, each format's fields read and checked, and the request it adds.

Every check raises :class:`BadRecord` with a message naming the field (the reader adds
the file and line); :class:`TooManyBlocks` is fatal even when bad lines are skipped.

Threads: pure functions (the adders call the builder they are given).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable, Protocol

from kvstrata.config.schema import short_repr


class Builder(Protocol):
    """What an adder calls: :class:`kvstrata.trace.reader.TraceBuilder`."""

    block_size: int

    def add_ids(self, ts: float, raw_ids: list[Any], input_length: int, output_length: int, line: int = 0,
                namespace: Any = None, output_ids: list[Any] = ..., duration: float = -1.0,  # type: ignore[assignment]
                hittable: int | None = None, preemptions: list[tuple[float, float, int]] | None = None) -> None: ...

    def add_tokens(self, ts: float, tokens: list[int], output_length: int, line: int = 0,
                   namespace: Any = None) -> None: ...

__all__ = ["MAX_COUNT", "BadRecord", "TooManyBlocks", "ADDERS", "parse_line", "id_list", "number_field", "count_field"]

MAX_COUNT = 2**63 - 1
"""Largest ``input_length`` / ``output_length`` accepted."""


_ID_TYPES = {int, str}


class BadRecord(Exception):
    """A bad record; the loader adds file and line."""


class TooManyBlocks(Exception):
    """More distinct blocks than ``max_distinct_blocks``: fatal even when skipping bad lines."""


def number_field(rec: dict[str, Any], key: str, *, required: bool = True, default: float = 0) -> float:
    v = rec.get(key)
    if v is None:
        if required:
            raise BadRecord(f"missing '{key}'")
        return default
    if type(v) is bool or not isinstance(v, (int, float)):
        raise BadRecord(f"'{key}' must be a number, got {short_repr(v)}")
    try:
        value = float(v)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise BadRecord(f"'{key}' must be a finite number, got {short_repr(v)}")
    if value < 0:
        raise BadRecord(f"'{key}' must not be negative, got {short_repr(v)}")
    return value


def count_field(rec: dict[str, Any], key: str, default: int) -> int:
    v = rec.get(key)
    if v is None:
        return default
    if type(v) is not int or not 0 <= v <= MAX_COUNT:
        raise BadRecord(f"'{key}' must be an integer from 0 to 2**63 - 1, got {short_repr(v)}")
    return v


def id_list(rec: dict[str, Any], key: str) -> list[Any]:
    ids = rec.get(key)
    if not isinstance(ids, list):
        raise BadRecord(f"missing '{key}'" if ids is None else f"'{key}' must be a list, got {type(ids).__name__}")
    if not set(map(type, ids)) <= _ID_TYPES:
        bad = next(h for h in ids if type(h) not in _ID_TYPES)
        raise BadRecord(f"'{key}' must hold integers or hex strings, got {short_repr(bad)}")
    return ids


def preemptions(rec: dict[str, Any], duration: float) -> list[tuple[float, float, int]]:
    """A recorded request's ``preemptions``: ``[preempted, resumed, tokens]`` each, seconds
    after its arrival in order, within its ``duration``."""
    raw = rec.get("preemptions", [])
    if not isinstance(raw, list):
        raise BadRecord(f"'preemptions' must be a list, got {type(raw).__name__}")
    out: list[tuple[float, float, int]] = []
    last = 0.0
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3):
            raise BadRecord(f"'preemptions' holds [preempted_s, resumed_s, tokens] lists, got {short_repr(item)}")
        entry = dict(zip(("preempted_s", "resumed_s", "tokens"), item))
        preempted, resumed = number_field(entry, "preempted_s"), number_field(entry, "resumed_s")
        tokens = count_field(entry, "tokens", 0)
        if not last <= preempted <= resumed or (duration >= 0 and resumed > duration):
            raise BadRecord(f"'preemptions': {short_repr(item)} is out of order or past the request's duration")
        out.append((preempted, resumed, tokens))
        last = resumed
    return out


def namespace(rec: dict[str, Any]) -> tuple[str | None, str | int | None] | None:
    """``(cache_salt, lora)`` of a kvstrata record, None when it has neither."""
    salt, lora = rec.get("cache_salt"), rec.get("lora")
    if salt is not None and not isinstance(salt, str):
        raise BadRecord(f"'cache_salt' must be a string, got {short_repr(salt)}")
    if lora is not None and (type(lora) is bool or not isinstance(lora, (str, int))):
        raise BadRecord(f"'lora' must be a string or an integer, got {short_repr(lora)}")
    return (salt, lora) if salt is not None or lora is not None else None


def hashed_length(rec: dict[str, Any], ids: list[Any], block_size: int) -> int:
    """``input_length`` of a record given by block hashes: the last block may be partial, no more."""
    n = count_field(rec, "input_length", len(ids) * block_size)
    least = (len(ids) - 1) * block_size + 1
    if ids and n < least:
        raise BadRecord(f"'input_length' {n} is too small for {len(ids)} block hashes of {block_size} tokens "
                   f"(at least {least})")
    return n


def add_mooncake(b: Builder, rec: dict[str, Any], line: int) -> None:
    ids = id_list(rec, "hash_ids")
    ts = number_field(rec, "timestamp") / 1000.0
    b.add_ids(ts, ids, count_field(rec, "input_length", len(ids) * b.block_size),
              count_field(rec, "output_length", 0), line)


def add_qwen(b: Builder, rec: dict[str, Any], line: int) -> None:
    ids = id_list(rec, "hash_ids")
    ts = number_field(rec, "timestamp")
    b.add_ids(ts, ids, count_field(rec, "input_length", len(ids) * b.block_size),
              count_field(rec, "output_length", 0), line)


def add_kvstrata(b: Builder, rec: dict[str, Any], line: int) -> None:
    ts = number_field(rec, "timestamp")
    ns = namespace(rec)
    out = count_field(rec, "output_length", 0)
    if "token_ids" in rec:
        tokens = rec["token_ids"]
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise BadRecord("'token_ids' must be a list of integers")
        if not tokens:
            raise BadRecord("'token_ids' is empty")
        b.add_tokens(ts, tokens, out, line, ns)
    elif "output_block_hashes" in rec:  # a recorded request (kvstrata.trace.recorder): the plugin's rules
        ids = id_list(rec, "block_hashes")
        n = count_field(rec, "input_length", len(ids) * b.block_size)
        if n // b.block_size != len(ids):
            raise BadRecord(f"'input_length' {n} holds {n // b.block_size} full blocks of {b.block_size} tokens, "
                       f"but 'block_hashes' names {len(ids)}")
        duration = number_field(rec, "duration", required=False, default=-1.0)
        b.add_ids(ts, ids, n, out, line, ns, id_list(rec, "output_block_hashes"), duration,
                  hittable=min(len(ids), max(n - 1, 0) // b.block_size), preemptions=preemptions(rec, duration))
    elif "block_hashes" in rec:
        ids = id_list(rec, "block_hashes")
        b.add_ids(ts, ids, hashed_length(rec, ids, b.block_size), out, line, ns)
    else:
        raise BadRecord("missing 'token_ids' or 'block_hashes'")


ADDERS: dict[str, Callable[[Builder, dict[str, Any], int], None]] = {
    "mooncake": add_mooncake, "qwen": add_qwen, "kvstrata": add_kvstrata}


def parse_line(raw: bytes) -> Any:
    """The JSON value of one line's bytes, None for a blank line; raises :class:`BadRecord`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
    if not text or text.isspace():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        truncated = e.pos >= len(text.rstrip())
        raise BadRecord("truncated JSON record" if truncated else f"not valid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise BadRecord("JSON nested too deeply") from None
    except ValueError:  # int() refuses a number longer than the interpreter's digit limit
        raise BadRecord(f"a number has more than {sys.get_int_max_str_digits()} digits") from None
