"""Reading what the plugin's recorder wrote (:mod:`kvstrata.trace.recorder`): the parts of a
recording in a directory, in order, and what the plugin measured over it.

A directory may hold several recordings (one per server start): the latest is
read, and the others are named in the notes. Its parts are read in the order
of their part numbers (whatever their names sort like); a part that is
missing, a file of a newer format version, and a file that is not a
recording are skipped and named in the notes. Nothing readable at all is a
:class:`~kvstrata.trace.reader.TraceError`.

The measured counters (``<id>.measured.json``) describe the whole recording:
they are used only when every part of it is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvstrata.config.schema import plural
from kvstrata.system.files import NotRegular, open_regular, read_bounded
from kvstrata.trace.format import MEASURED_SUFFIX, TRACE_VERSION, TraceError, header_version, is_header

__all__ = ["recording_parts", "measured_of", "trace_header", "trace_measurements"]


def _first_header(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The kvstrata header a file starts with, or None and why it has none."""
    try:
        fd, _ = open_regular(path)  # a FIFO named *.jsonl is skipped, never waited on
        with os.fdopen(fd, "rb") as fh:
            first = fh.readline(1 << 20)
    except NotRegular:
        return None, "is not a regular file"
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    try:
        rec = json.loads(first.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        rec = None
    if not isinstance(rec, dict) or not is_header(rec):
        return None, "does not start with a kvstrata header"
    return rec, None


def _header(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A file's recording header, or None and why it is not a recording part."""
    rec, why = _first_header(path)
    if rec is None:
        return None, why
    version = header_version(rec)
    if type(version) is not int or version > TRACE_VERSION:
        return None, f"is written in kvstrata trace format {version!r}; this kvstrata reads {TRACE_VERSION} and older"
    recording = rec.get("recording")
    if not isinstance(recording, dict) or not isinstance(recording.get("id"), str) or \
            type(recording.get("part")) is not int:
        return None, "is not part of a recording (its header names no recording and part)"
    return rec, None


def recording_parts(directory: Path) -> tuple[list[Path], list[str], dict[str, Any] | None]:
    """The files of the latest recording in ``directory`` in part order, notes on what was
    skipped, and the recording's measured counters (None unless every part is there)."""
    notes: list[str] = []
    recordings: dict[str, list[tuple[int, Path, dict[str, Any]]]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        rec, why = _header(path)
        if rec is None:
            notes.append(f"{path}: {why}: skipped")
            continue
        r = rec["recording"]
        recordings.setdefault(r["id"], []).append((r["part"], path, rec))
    if not recordings:
        detail = f" ({notes[0]})" if notes else ""
        raise TraceError(f"{directory}: no recording to read: no .jsonl file starts with a recording's header{detail}")
    latest = max(recordings, key=lambda rid: (recordings[rid][0][2]["recording"].get("started", 0), rid))
    for rid, parts in recordings.items():
        if rid != latest:
            notes.append(f"{directory}: recording {rid} ({plural(len(parts), 'part')}) skipped: "
                         f"the latest, {latest}, is read")
    parts = sorted(recordings[latest], key=lambda p: p[0])
    numbers = [n for n, _, _ in parts]
    measured = _read_measured(directory / f"{latest}{MEASURED_SUFFIX}", latest)
    written = max(numbers) + 1
    if measured is not None and type(measured.get("parts")) is int:
        written = max(written, measured["parts"])  # the recorder's count: a missing last part shows too
    missing = sorted(set(range(written)) - set(numbers))
    if missing:
        notes.append(f"{directory}: recording {latest}: part{'s' if len(missing) > 1 else ''} "
                     f"{', '.join(map(str, missing))} missing: the requests they held are not replayed")
        measured = None
    return [p for _, p, _ in parts], notes, measured


def measured_of(path: Path, header: dict[str, Any] | None) -> dict[str, Any] | None:
    """The measured counters of the recording a single file belongs to, when that file
    is all of it (part 0, and no other part beside it)."""
    rec = (header or {}).get("recording")
    if not isinstance(rec, dict) or rec.get("part") != 0 or not isinstance(rec.get("id"), str):
        return None
    rid = rec["id"]
    if any(p != path for p in path.parent.glob(f"{rid}-*.jsonl")):
        return None
    body = _read_measured(path.parent / f"{rid}{MEASURED_SUFFIX}", rid)
    return body if body is not None and body.get("parts", 1) == 1 else None


MAX_MEASURED_BYTES = 16 * 1024**2  # a measurements file is a few KiB: a larger one is not the recorder's


def _read_measured(path: Path, rid: str) -> dict[str, Any] | None:
    try:
        body = json.loads(read_bounded(path, MAX_MEASURED_BYTES))
    except (OSError, ValueError):  # missing, not a regular file, too large, not JSON: no measurements
        return None
    if not isinstance(body, dict) or body.get("recording") != rid or not isinstance(body.get("measured"), dict):
        return None
    return body


def trace_measurements(path: Path) -> dict[str, Any] | None:
    """What the plugin measured over the recording at ``path`` (a file or a directory), None
    when there is none or it is not the whole recording's."""
    if path.is_dir():
        try:
            return (recording_parts(path)[2] or {}).get("measured")
        except TraceError:
            return None
    if not path.is_file():
        return None
    body = measured_of(path, _first_header(path)[0])
    return None if body is None else body["measured"]


def trace_header(path: Path) -> dict[str, Any] | None:
    """The kvstrata header a trace starts with (a directory: its latest recording's first
    part), None when there is none or it cannot be read here (errors come with the read)."""
    if path.is_dir():
        try:
            files, _, _ = recording_parts(path)
        except TraceError:
            return None
        path = files[0]
    elif not path.is_file():  # a pipe or FIFO is read once, by the analysis
        return None
    return _first_header(path)[0]
