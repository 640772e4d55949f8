"""Soak: minutes of payload replay through TieredKVCache, restarted and SIGKILLed, every block verified.

A child process (``soak.py --child``) drives one :class:`~kvstrata.TieredKVCache` on
the CPU (a torch CPU tensor as the device pool, as the library runs without
CUDA) over a seeded chat workload: a few system prompts shared by many
multi-turn conversations, each turn re-sending the whole history, so prefixes
hit in the device pool, the DRAM tier and the SSD tier. The pool is far smaller
than the traffic (it evicts on almost every request), and so are both tiers
below it (the SSD tier is full after the first minute and evicts from then on).

Every block's bytes are a function of its hash (SHAKE-128 of the hash, shaped
like fp16 K/V so that the SSD tier's compression is exercised), so any block
can be checked anywhere:

* each request: ``allocate``; every served block (pool hits and loads from
  below) is compared byte for byte with the bytes its hash gives; the other
  full blocks are written and committed; the output is appended (decode) in
  chunks, each newly full block written and committed; before ``free`` every
  full block of the request is checked again;
* each child, at start: every record the SSD tier lists is read back and
  compared.

The driver restarts the child every ``--restart-every`` seconds of work:
gracefully (``close()``; the child then lists the blocks it confirmed on SSD:
the tier policy's SSD holdings less what the tier reported lost) or, every
``--kill-every``-th time (and at the last restart if none was a kill yet),
with SIGKILL at a random moment of work. For a kill, the confirmed blocks are
those of the last checkpoint (``flush()``, then ``ssd.keys()``; at start and
every ``--checkpoint-every`` seconds) less those the cache discarded from the
tier or the tier reported lost since (journalled as they happen, before the
library acts on them). A confirmed block the next child cannot read back
byte-exact is a lost flushed block. After the last child closes, a verify-only
child checks its confirmed blocks the same way.

The driver samples the child's VmRSS (``/proc/<pid>/status``) every
``--sample-every`` seconds and prints one line per minute. RSS is judged per
child: from the end of its warm-up (``--warmup`` seconds after it is ready)
to its end, and between the steady levels (median after warm-up) of the first
and the last child. Exit status 1 when a block is wrong, a confirmed block is
lost, a hash chain differs, a child fails, no restart was a SIGKILL, or RSS
grows by 5% or more.

    python benchmarks/soak.py [--minutes 10] [--restart-every 150] [--kill-every 2]
                              [--json soak.json] [--dir DIR] [--seed 0]
"""
from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BS = 16                 # tokens per block
KEY_LEN = 32            # sha256 block hashes
VOCAB = 128_000
RSS_LIMIT = 0.05        # growth that fails the run
_TAG = b"kvstrata-soak/v1\x00"


# =====================================================================  block bytes

def payload(key: bytes, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """The bytes of the block whose hash is ``key``: SHAKE-128 of the hash, with every
    odd (high) byte narrowed to 8 values, like the exponent byte of fp16 K/V."""
    raw = np.frombuffer(hashlib.shake_128(_TAG + key).digest(nbytes), dtype=np.uint8)
    if out is None:
        out = raw.copy()
    else:
        out[:] = raw
    hi = out[1::2]
    np.bitwise_and(hi, 0x07, out=hi)
    np.bitwise_or(hi, 0x38, out=hi)
    return out


def payloads(keys: list[bytes], nbytes: int) -> np.ndarray:
    out = np.empty((len(keys), nbytes), dtype=np.uint8)
    for i, k in enumerate(keys):
        payload(k, nbytes, out[i])
    return out


def write_keys(path: Path, keys: Any) -> None:
    """Keys as one binary file (``KEY_LEN`` bytes each), replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(keys))
    os.replace(tmp, path)


def read_keys(path: Path) -> set[bytes]:
    data = path.read_bytes()
    return {data[i:i + KEY_LEN] for i in range(0, len(data), KEY_LEN)}


# =====================================================================  workload

@dataclass
class Conv:
    """One conversation: a system prompt, then turns of (user message, output)."""

    cid: int
    sys_id: int
    turns: int
    ntokens: int
    lens: list[tuple[int, int]] = field(default_factory=list)   # (user, output) tokens per turn so far
    hist: array | None = None    # system prompt + every finished turn, built lazily
    hist_turns: int = 0


@dataclass
class Turn:
    index: int
    conv: Conv
    turn: int
    user_len: int
    out_len: int


class Workload:
    """Seeded chat traffic.

    The schedule (which conversation speaks next, how long each message is) comes
    from one ``random.Random(seed)`` and costs microseconds per request, so a child
    that restarts at request ``n`` replays it to ``n`` and continues the same
    conversations. Token ids are a function of (seed, conversation, turn), drawn
    only for the requests actually sent. The next conversation is a new one with
    probability ``new_prob`` (or while fewer than ``active`` are open), else the
    one at Zipf-distributed rank in most-recently-used order: short reuse distances
    hit the pool, longer ones the DRAM tier, longer still the SSD tier, the longest
    miss. A conversation ends after its drawn number of turns or when the next turn
    would pass ``max_tokens``; the least recently used one is abandoned when too
    many are open.
    """

    def __init__(self, seed: int, *, system_prompts: int, sys_blocks: tuple[int, int], active: int,
                 max_tokens: int, max_turns: int, zipf: float, new_prob: float,
                 user_tokens: tuple[int, int], out_tokens: tuple[int, int]) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.target = active
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.new_prob = new_prob
        self.user_tokens, self.out_tokens = user_tokens, out_tokens
        self.sys_len = [self.rng.randint(*sys_blocks) * BS + self.rng.randint(0, BS - 1)
                        for _ in range(system_prompts)]
        self.sys_tokens = [array("I", self._draw(0, i, 0, n)) for i, n in enumerate(self.sys_len)]
        self._sys_cum = _cumulative([1.0 / (i + 1) for i in range(system_prompts)])
        self._rank_cum = _cumulative([1.0 / (r + 1) ** zipf for r in range(active)])
        self.active: list[Conv] = []   # most recently used first
        self.next_cid = 0
        self.index = 0

    def _draw(self, kind: int, cid: int, turn: int, n: int) -> list[int]:
        rng = np.random.default_rng((self.seed, kind, cid, turn))
        return rng.integers(1, VOCAB, size=n, dtype=np.uint32).tolist()

    def next(self) -> Turn:
        rng = self.rng
        while True:
            conv = self._pick()
            user_len, out_len = rng.randint(*self.user_tokens), rng.randint(*self.out_tokens)
            if len(conv.lens) < conv.turns and conv.ntokens + user_len + out_len <= self.max_tokens:
                break
            self.active.remove(conv)   # finished: the next pick may start a new one
        turn = Turn(self.index, conv, len(conv.lens), user_len, out_len)
        conv.lens.append((user_len, out_len))
        conv.ntokens += user_len + out_len
        self.index += 1
        return turn

    def skip(self, n: int) -> None:
        while self.index < n:
            self.next()

    def _pick(self) -> Conv:
        rng = self.rng
        if len(self.active) < self.target or rng.random() < self.new_prob:
            sys_id = bisect.bisect_left(self._sys_cum, rng.random() * self._sys_cum[-1])
            conv = Conv(self.next_cid, sys_id, rng.randint(1, self.max_turns), self.sys_len[sys_id])
            self.next_cid += 1
            self.active.insert(0, conv)
            if len(self.active) > self.target:
                self.active.pop()
            return conv
        cum = self._rank_cum
        r = min(bisect.bisect_left(cum, rng.random() * cum[-1]), len(self.active) - 1)
        conv = self.active.pop(r)
        self.active.insert(0, conv)
        return conv

    def tokens(self, t: Turn) -> tuple[list[int], list[int]]:
        """(prompt, output) token ids of a turn: the prompt is the system prompt, every
        earlier turn's message and output, and this turn's message."""
        conv = t.conv
        if conv.hist is None or conv.hist_turns != t.turn:
            hist = array("I", self.sys_tokens[conv.sys_id])
            for k in range(t.turn):
                hist.extend(self._draw(1, conv.cid, k, conv.lens[k][0]))
                hist.extend(self._draw(2, conv.cid, k, conv.lens[k][1]))
            conv.hist, conv.hist_turns = hist, t.turn
        user = self._draw(1, conv.cid, t.turn, t.user_len)
        out = self._draw(2, conv.cid, t.turn, t.out_len)
        prompt = conv.hist.tolist() + user
        conv.hist.extend(user)
        conv.hist.extend(out)
        conv.hist_turns = t.turn + 1
        return prompt, out


def _cumulative(weights: list[float]) -> list[float]:
    out, s = [], 0.0
    for w in weights:
        s += w
        out.append(s)
    return out


def make_workload(p: dict[str, Any]) -> Workload:
    return Workload(p["seed"], system_prompts=p["system_prompts"], sys_blocks=tuple(p["sys_blocks"]),
                    active=p["active"], max_tokens=p["max_blocks"] * BS, max_turns=p["max_turns"],
                    zipf=p["zipf"], new_prob=p["new_prob"], user_tokens=tuple(p["user_tokens"]),
                    out_tokens=tuple(p["out_tokens"]))


def make_config(p: dict[str, Any]) -> Any:
    from kvstrata import KVStrataConfig
    from kvstrata.tiers.ssd.record import NS_LEN, record_footprint

    nbytes = p["block_kib"] * 1024
    cfg = {
        "block_size": BS,
        "model": {"name": "kvstrata-soak", "block_nbytes": nbytes},
        "gpu": {"num_blocks": p["gpu_blocks"], "device": "cpu"},
        "cpu": {"capacity": p["cpu_blocks"] * nbytes, "pin_memory": "false"},
        "ssd": {"path": p["ssd_path"], "capacity": p["ssd_blocks"] * record_footprint(NS_LEN + KEY_LEN, nbytes),
                "compression": p["compression"]},
    }
    return KVStrataConfig.from_dict(cfg, p.get("overrides", []))


# =====================================================================  child

class Journal:
    """What the library removed from the SSD tier since the last checkpoint, written
    with ``os.write`` as it happens (it survives a SIGKILL of the writer)."""

    def __init__(self, life_dir: Path) -> None:
        self.dir = life_dir
        self.seq = 0
        self.fd: int | None = None

    def write(self, tag: str, keys: list[bytes]) -> None:
        if self.fd is not None and keys:
            os.write(self.fd, (tag + " " + " ".join(k.hex() for k in keys) + "\n").encode())

    def checkpoint(self, keys: list[bytes]) -> None:
        """``keys``: what the tier holds right after a successful flush."""
        seq = self.seq + 1
        write_keys(self.dir / f"snapshot-{seq}.keys", keys)
        fd = os.open(self.dir / f"journal-{seq}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        old, self.fd, self.seq = self.fd, fd, seq
        if old is not None:
            os.close(old)
            for name in (f"snapshot-{seq - 1}.keys", f"journal-{seq - 1}"):
                (self.dir / name).unlink(missing_ok=True)


def confirmed_after_kill(life_dir: Path) -> tuple[set[bytes], dict[str, int]]:
    """The blocks a killed child had confirmed: its last complete checkpoint less the
    discards and losses journalled after it."""
    seqs = sorted(int(p.name.split("-")[1]) for p in life_dir.glob("journal-*"))
    seqs = [s for s in seqs if (life_dir / f"snapshot-{s}.keys").exists()]
    if not seqs:
        return set(), {"checkpoint": 0}
    seq = seqs[-1]
    keys = read_keys(life_dir / f"snapshot-{seq}.keys")
    n = {"checkpoint": seq, "snapshot": len(keys), "discarded_since": 0, "lost_since": 0}
    for line in (life_dir / f"journal-{seq}").read_text().splitlines():
        tag, *hexes = line.split()
        gone = {bytes.fromhex(h) for h in hexes}
        n["discarded_since" if tag == "D" else "lost_since"] += len(gone & keys)
        keys -= gone
    return keys, n


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Child:
    """One lifetime of the cache: open and verify the SSD tier, replay until told to stop."""

    def __init__(self, p: dict[str, Any]) -> None:
        self.p = p
        self.life_dir = Path(p["life_dir"])
        self.nbytes = p["block_kib"] * 1024
        self.stop = threading.Event()
        self.ckpt_asked = threading.Event()
        self.c = {"requests": 0, "prompt_blocks": 0, "written": 0, "checked": 0, "checked_gpu": 0,
                  "checked_below": 0, "hit_gpu": 0, "hit_cpu": 0, "hit_ssd": 0, "rechecked": 0, "wrong": 0,
                  "hash_mismatch": 0, "oob_retries": 0, "rejected": 0, "discarded": 0, "lost_reported": 0,
                  "flush_failures": 0, "checkpoints": 0, "checkpoint_s": 0.0}
        self.wrong_examples: list[dict[str, Any]] = []
        self.inflight: deque[str] = deque()

    # -------------------------------------------------------------- setup

    def run(self) -> None:
        import torch

        torch.set_num_threads(1)
        from kvstrata import OutOfBlocksError, TieredKVCache

        self.OOB = OutOfBlocksError
        threading.Thread(target=self._watch_stdin, daemon=True).start()
        t0 = time.monotonic()
        self.cache = cache = TieredKVCache(make_config(self.p))
        self.pool = cache.kv_pool
        self.journal = Journal(self.life_dir)
        self._instrument(cache.ssd)
        open_s = time.monotonic() - t0
        scan = self._scan()
        emit({"event": "ready", "pid": os.getpid(), "open_s": round(open_s, 3), **scan,
              "capacity": cache.policy.capacity(), "gpu_blocks": cache.manager.num_blocks})
        if self.p["verify_only"]:
            self._close()
            return
        self._checkpoint()
        wl = make_workload(self.p)
        t = time.monotonic()
        wl.skip(self.p["start_index"])
        skip_s = time.monotonic() - t
        emit({"event": "started", "start_index": self.p["start_index"], "skip_s": round(skip_s, 3)})
        now = time.monotonic()
        next_progress, next_ckpt, next_diag = now + 1, now + self.p["checkpoint_every"], now + 10
        while not self.stop.is_set():
            self._serve(wl, wl.next())
            if self.ckpt_asked.is_set():
                self.ckpt_asked.clear()
                self._checkpoint(announce=True)
            now = time.monotonic()
            if now >= next_progress:
                next_progress = now + 1
                self._progress(wl.index)
            if now >= next_ckpt:
                self._checkpoint()
                next_ckpt = time.monotonic() + self.p["checkpoint_every"]
            if now >= next_diag:
                next_diag = now + 10
                self._diag()
        self._retire_all()
        self._progress(wl.index)
        self._diag()
        self._close()

    def _watch_stdin(self) -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
            if line.strip() == "checkpoint":
                self.ckpt_asked.set()
        self.stop.set()   # "stop", or the driver went away

    def _instrument(self, ssd: Any) -> None:
        """Journal what the library removes from the SSD tier, before it happens."""
        self.ssd = ssd
        discard, take_lost, flush = ssd.discard_many, ssd.take_lost, ssd.flush

        def discard_many(keys: Any) -> None:
            keys = list(keys)
            self.journal.write("D", keys)
            self.c["discarded"] += len(keys)
            return discard(keys)

        def take_lost_() -> list[bytes]:
            out = take_lost()
            self.journal.write("L", out)
            self.c["lost_reported"] += len(out)
            return out

        def flush_(timeout: float | None = None) -> bool:
            ok = flush(timeout)
            if not ok:
                self.c["flush_failures"] += 1
            return ok

        ssd.discard_many, ssd.take_lost, ssd.flush = discard_many, take_lost_, flush_

    def _scan(self) -> dict[str, Any]:
        """Read back every record the SSD tier lists; keep the byte-exact ones."""
        t0 = time.monotonic()
        keys = list(self.cache.ssd.keys())
        exact: list[bytes] = []
        wrong = unreadable = 0
        examples = []
        for lo in range(0, len(keys), 128):
            chunk = keys[lo:lo + 128]
            for k, v in zip(chunk, self.cache.ssd.get_many(chunk)):
                if v is None:
                    unreadable += 1
                elif len(v) == self.nbytes and np.array_equal(np.frombuffer(v, np.uint8), payload(k, self.nbytes)):
                    exact.append(k)
                else:
                    wrong += 1
                    if len(examples) < 5:
                        examples.append(k.hex())
        write_keys(self.life_dir / "reopened-exact.keys", exact)
        policy_ssd = self.cache.policy.store
        return {"ssd_keys": len(keys), "scan_exact": len(exact), "scan_wrong": wrong,
                "scan_unreadable": unreadable, "scan_wrong_examples": examples,
                "not_in_policy": sum(1 for k in exact if k not in policy_ssd),
                "scan_s": round(time.monotonic() - t0, 3)}

    # -------------------------------------------------------------- requests

    def _serve(self, wl: Workload, t: Turn) -> None:
        cache, c, nbytes = self.cache, self.c, self.nbytes
        prompt, out = wl.tokens(t)
        rid = f"{self.p['life']}.{t.index}"
        hashes = cache.hasher.hash_blocks(prompt)
        a = self._allocate(rid, prompt)
        if a is None:
            return
        a.wait()
        cached = a.num_cached_tokens // BS
        ids = a.block_ids
        c["requests"] += 1
        c["prompt_blocks"] += len(hashes)
        for tier in ("gpu", "cpu", "ssd"):
            c["hit_" + tier] += a.hit_blocks[tier]
        if cached:
            self._check(rid, ids[:cached], hashes[:cached], a.hit_blocks["gpu"], "served")
        if len(hashes) > cached:
            self.pool[ids[cached:len(hashes)]] = _tensor(payloads(hashes[cached:], nbytes))
            c["written"] += len(hashes) - cached
        cache.commit(rid)
        full = len(hashes)
        pos = 0
        chunk = self.p["decode_chunk"]
        while pos < len(out):
            step = out[pos:pos + chunk]
            try:
                ops = cache.append(rid, step)
            except self.OOB:
                c["oob_retries"] += 1
                self._retire_all(keep=rid)
                try:
                    ops = cache.append(rid, step)
                except self.OOB:
                    break   # the output ends here
            pos += len(step)
            for src, dst in ops:
                self.pool[dst] = self.pool[src]
            hs = cache.manager.block_hashes(rid)
            if len(hs) > full:
                ids = cache.block_ids(rid)
                self.pool[ids[full:len(hs)]] = _tensor(payloads(hs[full:], nbytes))
                c["written"] += len(hs) - full
                full = len(hs)
            cache.commit(rid)
        if cache.manager.block_hashes(rid) != cache.hasher.hash_blocks(prompt + out[:pos]):
            c["hash_mismatch"] += 1
        self.inflight.append(rid)
        while len(self.inflight) > self.p["concurrency"]:
            self._retire(self.inflight.popleft())

    def _allocate(self, rid: str, prompt: list[int]) -> Any:
        try:
            return self.cache.allocate(rid, prompt)
        except self.OOB:
            self.c["oob_retries"] += 1
        self._retire_all()
        try:
            return self.cache.allocate(rid, prompt)
        except self.OOB:
            self.c["rejected"] += 1
            return None

    def _retire(self, rid: str) -> None:
        """Check every full block of a request once more, then free it."""
        hs = self.cache.manager.block_hashes(rid)
        ids = self.cache.block_ids(rid)[:len(hs)]
        self._check(rid, ids, hs, len(hs), "held")
        self.cache.free(rid)

    def _retire_all(self, keep: str | None = None) -> None:
        rest = deque()
        while self.inflight:
            rid = self.inflight.popleft()
            if rid == keep:
                rest.append(rid)
            else:
                self._retire(rid)
        self.inflight = rest

    def _check(self, rid: str, ids: list[int], hashes: list[bytes], gpu_hits: int, what: str) -> None:
        c = self.c
        rows = self.pool[ids].numpy()
        ok = np.all(rows == payloads(hashes, self.nbytes), axis=1)
        if what == "served":
            c["checked"] += len(ids)
            c["checked_gpu"] += min(gpu_hits, len(ids))
            c["checked_below"] += max(0, len(ids) - gpu_hits)
        else:
            c["rechecked"] += len(ids)
        if ok.all():
            return
        bad = [int(i) for i in np.flatnonzero(~ok)]
        c["wrong"] += len(bad)
        ex = {"request": rid, "what": what, "positions": bad[:8], "blocks": len(ids), "gpu_hits": gpu_hits,
              "hashes": [hashes[i].hex() for i in bad[:3]],
              "from": ["gpu" if i < gpu_hits else "below" for i in bad[:8]] if what == "served" else None}
        if len(self.wrong_examples) < 20:
            self.wrong_examples.append(ex)
        emit({"event": "wrong", **ex, "counters": dict(c)})

    # -------------------------------------------------------------- reports

    def _progress(self, next_index: int) -> None:
        emit({"event": "progress", "next_index": next_index, "counters": dict(self.c)})

    def _diag(self) -> None:
        cache = self.cache
        st = cache.stats()
        ssd = st.get("ssd", {})
        files = {k: ssd.get(k) for k in ("block_file_bytes", "index_file_bytes", "capacity_bytes")}
        files["slack_bytes"] = getattr(self.ssd, "slack_bytes", None)
        lc = {t: len(getattr(v, "_born", ())) for t, v in cache.lifecycle.items()}
        emit({"event": "diag", "occupancy": cache.policy.occupancy(), "gpu_cached": cache.manager.num_cached_blocks,
              "lifecycle_tracked": lc, "pending": len(cache._pending), "executor": st.get("executor"),
              "ssd": {k: ssd.get(k) for k in ("evictions", "discarded", "dropped_queue_full", "dropped_no_room",
                                              "dropped_write_error", "corrupt_deleted", "puts", "puts_present",
                                              "current_bytes", "file_bytes", "compression_ratio", "queued_bytes")},
              "files": files, "hits": st["hits"], "spills": st.get("spills"), "evictions": st.get("evictions")})

    def _checkpoint(self, announce: bool = False) -> None:
        """``flush()``, then the keys the tier lists are confirmed (unless the flush failed)."""
        t0 = time.monotonic()
        failures = self.c["flush_failures"]
        self.cache.flush()
        keys = list(self.cache.ssd.keys()) if self.c["flush_failures"] == failures else None
        if keys is not None:
            self.journal.checkpoint(keys)
        self.c["checkpoints"] += 1
        self.c["checkpoint_s"] += time.monotonic() - t0
        if announce:
            emit({"event": "checkpoint", "seq": self.journal.seq, "keys": None if keys is None else len(keys),
                  "seconds": round(time.monotonic() - t0, 3)})

    def _close(self) -> None:
        t0 = time.monotonic()
        cache, ssd = self.cache, self.ssd
        cache.close()
        lost = ssd.take_lost()   # dropped by the tier during the final flush
        confirmed = set(cache.policy.store) - set(lost)
        write_keys(self.life_dir / "confirmed.keys", sorted(confirmed))
        emit({"event": "closed", "confirmed": len(confirmed), "lost_at_close": len(lost),
              "close_s": round(time.monotonic() - t0, 3), "counters": dict(self.c),
              "wrong_examples": self.wrong_examples})


def _tensor(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(a)


def child_main(params: str) -> int:
    p = json.loads(params)
    try:
        Child(p).run()
    except BaseException:
        emit({"event": "error", "traceback": traceback.format_exc()})
        return 2
    return 0


# =====================================================================  driver

def read_rss(pid: int) -> dict[str, int] | None:
    """VmRSS and its parts in KiB, or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[k] = int(v.split()[0])
    return out if "VmRSS" in out else None


@dataclass
class Life:
    idx: int
    kind: str                    # "work" or "verify"
    start_index: int
    after: str                   # how the previous child ended: fresh, graceful, SIGKILL
    proc: Any = None
    pid: int = 0
    t_spawn: float = 0.0
    t_ready: float | None = None
    t_end: float | None = None
    ended: str | None = None     # graceful, SIGKILL, died
    ready: dict[str, Any] = field(default_factory=dict)
    closed: dict[str, Any] | None = None
    counters: dict[str, Any] = field(default_factory=dict)
    next_index: int = 0
    rss: list[tuple[float, float, dict[str, int]]] = field(default_factory=list)  # (run s, s since ready, kB)
    diag: dict[str, Any] | None = None
    check: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    eof: bool = False
    checkpoint: dict[str, Any] | None = None


COUNTERS = ("requests", "prompt_blocks", "written", "checked", "checked_gpu", "checked_below", "hit_gpu",
            "hit_cpu", "hit_ssd", "rechecked", "wrong", "hash_mismatch", "oob_retries", "rejected")


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed ^ 0x5EED)
        base = Path(args.dir) if args.dir else None
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="kvstrata-soak-", dir=base))
        self.params = {
            "seed": args.seed, "block_kib": args.block_kib, "gpu_blocks": args.gpu_blocks,
            "cpu_blocks": args.cpu_blocks, "ssd_blocks": args.ssd_blocks, "compression": args.compression,
            "ssd_path": str(self.work / "ssd"), "system_prompts": args.system_prompts,
            "sys_blocks": args.sys_blocks, "active": args.active, "max_blocks": args.max_blocks,
            "max_turns": args.max_turns, "zipf": args.zipf, "new_prob": args.new_prob,
            "user_tokens": args.user_tokens, "out_tokens": args.out_tokens, "decode_chunk": args.decode_chunk,
            "concurrency": args.concurrency, "checkpoint_every": args.checkpoint_every, "overrides": args.set}
        self.events: queue.Queue = queue.Queue()
        self.lives: list[Life] = []
        self.minutes: list[dict[str, Any]] = []
        self.log: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.minutes * 60
        self.next_sample = self.t0
        self.next_minute = self.t0 + 60
        self.minute_start_totals = {k: 0 for k in COUNTERS}
        self.minute_events: list[str] = []
        self.restarts = {"graceful": 0, "SIGKILL": 0}
        self.file_max: dict[str, int] = {}
        self.file_over: set[str] = set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ children

    def spawn(self, kind: str, after: str) -> Life:
        life = Life(len(self.lives), kind, self.lives[-1].next_index if self.lives else 0, after)
        life.next_index = life.start_index
        life_dir = self.work / f"life-{life.idx}"
        life_dir.mkdir()
        p = {**self.params, "life": life.idx, "life_dir": str(life_dir), "start_index": life.start_index,
             "verify_only": kind == "verify"}
        err = open(life_dir / "stderr.log", "w")
        life.proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "--child", json.dumps(p)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                     bufsize=1)
        err.close()
        life.pid = life.proc.pid
        life.t_spawn = self.now()
        self.lives.append(life)
        threading.Thread(target=self._read, args=(life,), daemon=True).start()
        self.note(f"child {life.idx} ({kind}) started, pid {life.pid}, after {after}, at request {life.start_index}")
        self.wait(lambda: life.t_ready is not None or life.eof, self.args.start_timeout, f"child {life.idx} start")
        if life.t_ready is None:
            self.fail(f"child {life.idx} did not become ready: {life.error or 'exited'}")
        return life

    def _read(self, life: Life) -> None:
        for line in life.proc.stdout:
            try:
                self.events.put((life, json.loads(line)))
            except json.JSONDecodeError:
                self.events.put((life, {"event": "noise", "line": line.rstrip()}))
        self.events.put((life, {"event": "eof"}))

    def handle(self, life: Life, ev: dict[str, Any]) -> None:
        kind = ev["event"]
        if kind == "ready":
            life.t_ready = self.now()
            life.ready = ev
            self.check_reopen(life)
        elif kind == "progress":
            life.counters = ev["counters"]
            life.next_index = ev["next_index"]
        elif kind == "wrong":
            life.counters = ev["counters"]
            self.note(f"WRONG block(s) in child {life.idx}: {json.dumps({k: v for k, v in ev.items() if k != 'counters'})}")
        elif kind == "diag":
            life.diag = ev
            f = ev.get("files") or {}
            if f.get("block_file_bytes") is not None and f.get("capacity_bytes") and f.get("slack_bytes") is not None:
                bound = f["capacity_bytes"] + f["slack_bytes"]
                self.file_max["bound"] = bound
                for name in ("block_file_bytes", "index_file_bytes"):
                    self.file_max[name] = max(self.file_max.get(name, 0), f[name] or 0)
                    if (f[name] or 0) > bound and name not in self.file_over:
                        self.file_over.add(name)
                        self.fail(f"child {life.idx}: SSD {name} = {f[name]:,} exceeds capacity + slack = {bound:,}")
        elif kind == "checkpoint":
            life.checkpoint = ev
        elif kind == "closed":
            life.closed = ev
            life.counters = ev["counters"]
        elif kind == "error":
            life.error = ev["traceback"]
            self.note(f"child {life.idx} raised:\n{ev['traceback']}")
        elif kind == "eof":
            life.eof = True
        elif kind == "noise":
            self.note(f"child {life.idx} printed: {ev['line']}")

    def check_reopen(self, life: Life) -> None:
        """Blocks the previous child confirmed that this one cannot read back byte-exact."""
        ready = life.ready
        chk: dict[str, Any] = {"ssd_keys": ready["ssd_keys"], "scan_exact": ready["scan_exact"],
                               "scan_wrong": ready["scan_wrong"], "scan_unreadable": ready["scan_unreadable"],
                               "not_in_policy": ready["not_in_policy"]}
        if ready["scan_wrong"]:
            self.note(f"child {life.idx}: {ready['scan_wrong']} SSD records read back with wrong bytes: "
                      f"{ready['scan_wrong_examples']}")
        if life.idx > 0:
            prev = self.lives[life.idx - 1]
            prev_dir = self.work / f"life-{prev.idx}"
            if prev.ended == "graceful":
                confirmed = read_keys(prev_dir / "confirmed.keys")
                chk["basis"] = "close"
            else:
                confirmed, info = confirmed_after_kill(prev_dir)
                chk["basis"] = f"checkpoint {info.get('checkpoint')}"
                chk.update({k: v for k, v in info.items() if k != "checkpoint"})
            exact = read_keys(self.work / f"life-{life.idx}" / "reopened-exact.keys")
            lost = confirmed - exact
            chk.update(confirmed=len(confirmed), lost=len(lost), lost_examples=[k.hex() for k in list(lost)[:5]])
            if lost:
                self.note(f"child {life.idx}: {len(lost)} of {len(confirmed)} blocks confirmed by child "
                          f"{prev.idx} ({prev.ended}) are not served back byte-exact")
        life.check = chk
        self.note(f"child {life.idx} ready in {life.t_ready - life.t_spawn:.1f} s: SSD lists {ready['ssd_keys']} "
                  f"blocks, {ready['scan_exact']} byte-exact, {ready['scan_wrong']} wrong, "
                  f"{ready['scan_unreadable']} unreadable"
                  + (f"; confirmed by child {life.idx - 1}: {chk['confirmed']}, lost {chk['lost']}"
                     if "confirmed" in chk else ""))

    def stop_graceful(self, life: Life) -> None:
        try:
            life.proc.stdin.write("stop\n")
            life.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self.wait(lambda: life.eof, self.args.close_timeout, f"child {life.idx} close")
        self.reap(life, "graceful")
        if life.closed is None:
            self.fail(f"child {life.idx} did not close cleanly (rc {life.proc.returncode})")
        else:
            c = life.closed
            self.note(f"child {life.idx} closed in {c['close_s']:.1f} s: {c['confirmed']} blocks confirmed on SSD"
                      + (f", {c['lost_at_close']} reported lost at close" if c["lost_at_close"] else ""))

    def kill(self, life: Life) -> None:
        """Ask for a checkpoint (so that the check after the kill covers many blocks), then
        SIGKILL the child at a random moment of the work that follows it."""
        life.checkpoint = None
        try:
            life.proc.stdin.write("checkpoint\n")
            life.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self.wait(lambda: life.checkpoint is not None or life.eof, 120, f"child {life.idx} checkpoint")
        delay = self.rng.uniform(0.2, 2.0)
        self.wait(lambda: False, delay, "")
        n = life.counters.get("requests", 0)
        os.kill(life.pid, signal.SIGKILL)
        self.wait(lambda: life.eof, 60, f"child {life.idx} kill")
        self.reap(life, "SIGKILL")
        ck = life.checkpoint or {}
        self.note(f"child {life.idx} SIGKILLed {delay:.2f} s after checkpoint {ck.get('seq')} "
                  f"({ck.get('keys')} blocks on SSD, flush took {ck.get('seconds')} s), "
                  f"after {n} requests (last report)")

    def reap(self, life: Life, how: str) -> None:
        try:
            life.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            life.proc.kill()
            life.proc.wait()
            self.fail(f"child {life.idx} did not exit")
        life.t_end = self.now()
        life.ended = how
        if life.proc.stdin:
            try:
                life.proc.stdin.close()
            except OSError:
                pass
        self.wait(lambda: life.eof, 5, "")
        self.drain()

    # ------------------------------------------------------------------ ticking

    def wait(self, done: Any, timeout: float, what: str) -> bool:
        end = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= end:
                if what:
                    self.fail(f"{what}: timed out after {timeout:.0f} s")
                return False
            self.tick(0.1)
        return True

    def drain(self) -> None:
        while True:
            try:
                life, ev = self.events.get_nowait()
            except queue.Empty:
                return
            self.handle(life, ev)

    def tick(self, sleep: float) -> None:
        try:
            life, ev = self.events.get(timeout=sleep)
            self.handle(life, ev)
        except queue.Empty:
            pass
        self.drain()
        mono = time.monotonic()
        if mono >= self.next_sample:
            self.next_sample = mono + self.args.sample_every
            self.sample()
        if mono >= self.next_minute:
            self.next_minute += 60
            self.minute_row()

    def sample(self) -> None:
        if not self.lives:
            return
        life = self.lives[-1]
        if life.t_end is not None or life.kind != "work":
            return
        rss = read_rss(life.pid)
        if rss is not None:
            since = self.now() - life.t_ready if life.t_ready is not None else -1.0
            life.rss.append((round(self.now(), 2), round(since, 2), rss))

    def totals(self) -> dict[str, int]:
        return {k: sum(l.counters.get(k, 0) for l in self.lives) for k in COUNTERS}

    def minute_row(self, final: bool = False) -> None:
        end = self.now()
        start = self.minutes[-1]["t_end"] if self.minutes else 0.0
        if final and end - start < 1:
            return
        tot = self.totals()
        d = {k: tot[k] - self.minute_start_totals[k] for k in COUNTERS}
        self.minute_start_totals = tot
        dt = end - start
        work = [l for l in self.lives if l.kind == "work"]
        live = work[-1] if work else None
        rss = live.rss[-1][2] if live and live.rss else {}
        row = {"minute": len(self.minutes) + 1, "t_end": round(end, 1), "seconds": round(dt, 1),
               "child": live.idx if live else None, "pid": live.pid if live else None,
               "rss_mib": round(rss.get("VmRSS", 0) / 1024, 1), "rss_anon_mib": round(rss.get("RssAnon", 0) / 1024, 1),
               "req_s": round(d["requests"] / dt, 1), "blocks_s": round(d["prompt_blocks"] / dt, 1),
               "written_s": round(d["written"] / dt, 1), **{k: d[k] for k in COUNTERS},
               "events": self.minute_events}
        self.minute_events = []
        self.minutes.append(row)
        if len(self.minutes) == 1:
            print(MINUTE_HEAD)
        print(fmt_minute(row), flush=True)

    def note(self, msg: str) -> None:
        t = self.now()
        self.log.append({"t": round(t, 1), "msg": msg})
        print(f"[{t:7.1f} s] {msg}", flush=True)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self.note("FAIL: " + msg)

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        a = self.args
        print(f"soak: {a.minutes:g} min, restart after {a.restart_every:g} s of work (restart k is a SIGKILL "
              f"when k % {a.kill_every} == 0), workdir {self.work}", flush=True)
        life = self.spawn("work", "fresh")
        est_start = 5.0
        while life.t_ready is not None and not life.eof:
            mono = time.monotonic()
            if mono >= self.deadline:
                break
            ran = self.now() - life.t_ready
            left = self.deadline - mono
            if ran >= a.restart_every and left >= a.restart_every / 2:
                k = sum(self.restarts.values()) + 1
                last = left - est_start - a.restart_every < a.restart_every / 2
                kill = a.kill_every > 0 and (k % a.kill_every == 0 or (last and not self.restarts["SIGKILL"]))
                how = "SIGKILL" if kill else "graceful"
                t = self.now()
                self.kill(life) if kill else self.stop_graceful(life)
                self.restarts[how] += 1
                self.minute_events.append(f"{how} restart of child {life.idx}")
                life = self.spawn("work", how)
                est_start = max(est_start, self.now() - t)
                continue
            self.tick(0.2)
        if life.eof and life.ended is None:
            self.reap(life, "died")
            self.fail(f"child {life.idx} died (rc {life.proc.returncode}): {life.error or 'see its stderr.log'}")
        else:
            self.stop_graceful(life)
        self.minute_row(final=True)
        verify = self.spawn("verify", life.ended or "died")
        if verify.t_ready is not None:
            self.stop_graceful(verify)
        return self.report()

    # ------------------------------------------------------------------ verdict

    def report(self) -> dict[str, Any]:
        a = self.args
        tot = self.totals()
        lives = []
        for l in self.lives:
            lives.append({"child": l.idx, "kind": l.kind, "pid": l.pid, "after": l.after,
                          "start_index": l.start_index, "next_index": l.next_index,
                          "spawned_s": round(l.t_spawn, 1), "ready_s": l.t_ready and round(l.t_ready, 1),
                          "end_s": l.t_end and round(l.t_end, 1), "ended": l.ended,
                          "open_s": l.ready.get("open_s"), "scan_s": l.ready.get("scan_s"),
                          "capacity": l.ready.get("capacity"),
                          "counters": l.counters, "reopen": l.check,
                          "closed": {k: v for k, v in (l.closed or {}).items() if k not in ("counters", "event")},
                          "rss": rss_summary(l, a.warmup) if l.kind == "work" else None,
                          "rss_samples": [(t, s, r["VmRSS"], r.get("RssAnon"), r.get("RssFile")) for t, s, r in l.rss],
                          "diag": l.diag, "error": l.error})
        wrong = tot["wrong"] + sum(l.check.get("scan_wrong", 0) for l in self.lives)
        lost = sum(l.check.get("lost", 0) for l in self.lives)
        levels = [(x["child"], x["rss"]["steady_mib"]) for x in lives if x["rss"] and x["rss"]["growth"] is not None]
        within = [x["rss"]["growth"] for x in lives if x["rss"] and x["rss"]["growth"] is not None]
        across = (levels[-1][1] - levels[0][1]) / levels[0][1] if len(levels) >= 2 else None
        rss_growth = max([g for g in within + [across] if g is not None], default=None)
        checks = {
            "wrong_blocks": wrong, "flushed_blocks_lost": lost, "hash_mismatches": tot["hash_mismatch"],
            "rss_growth_within_max": max(within) if within else None, "rss_growth_across": across,
            "sigkill_restarts": self.restarts["SIGKILL"], "graceful_restarts": self.restarts["graceful"],
            "rejected_requests": tot["rejected"], "ssd_files_max": self.file_max,
            # not failures: the SSD tier's own LRU backstop and what it reported lost (policy forgets them)
            "ssd_backstop_evictions": sum(((l.diag or {}).get("ssd") or {}).get("evictions") or 0 for l in self.lives),
            "ssd_reported_lost": sum(l.counters.get("lost_reported", 0) for l in self.lives),
            "ssd_dropped_puts": sum(((l.diag or {}).get("executor") or {}).get("store_failures_ssd") or 0
                                    for l in self.lives),
        }
        if wrong:
            self.failures.append(f"{wrong} wrong blocks")
        if lost:
            self.failures.append(f"{lost} confirmed (flushed) blocks lost")
        if tot["hash_mismatch"]:
            self.failures.append(f"{tot['hash_mismatch']} requests whose hash chain differed")
        if rss_growth is not None and rss_growth >= RSS_LIMIT:
            self.failures.append(f"RSS grew {rss_growth:.1%} (limit {RSS_LIMIT:.0%})")
        if rss_growth is None:
            checks["rss_note"] = (f"no child ran {a.warmup:g} s of warm-up plus 30 s: RSS growth not measured")
        if a.kill_every > 0 and not self.restarts["SIGKILL"]:
            self.failures.append("no restart was a SIGKILL (run longer than --restart-every, or lower it)")
        return {"params": {**self.params, "minutes": a.minutes, "restart_every": a.restart_every,
                           "kill_every": a.kill_every, "warmup": a.warmup, "sample_every": a.sample_every},
                "duration_s": round(self.now(), 1), "totals": tot, "checks": checks, "minutes": self.minutes,
                "children": lives, "log": self.log, "failures": self.failures, "ok": not self.failures}


def rss_summary(life: Life, warmup: float, window: float = 15.0) -> dict[str, Any]:
    """RSS at the end of warm-up and at the end of the child (medians over ``window``
    seconds), their growth, and the steady level (median after warm-up), in MiB."""
    post = [(s, r["VmRSS"] / 1024) for _, s, r in life.rss if s >= warmup]
    out: dict[str, Any] = {"peak_mib": round(max((r["VmRSS"] for _, _, r in life.rss), default=0) / 1024, 1),
                           "warm_mib": None, "end_mib": None, "growth": None, "steady_mib": None,
                           "measured_s": round(post[-1][0] - post[0][0], 1) if post else 0.0}
    if len(post) < 3 or post[-1][0] - post[0][0] < 30:
        return out
    warm = statistics.median(r for s, r in post if s <= post[0][0] + window)
    end = statistics.median(r for s, r in post if s >= post[-1][0] - window)
    out.update(warm_mib=round(warm, 1), end_mib=round(end, 1), growth=(end - warm) / warm,
               steady_mib=round(statistics.median(r for _, r in post), 1))
    return out


MINUTE_HEAD = (f"{'min':>4} {'child':>5} {'pid':>7} {'RSS MiB':>8} {'req/s':>7} {'blocks/s':>9} {'written/s':>9} "
               f"{'checked':>9} {'gpu':>8} {'cpu':>8} {'ssd':>8} {'wrong':>6}  events")


def fmt_minute(r: dict[str, Any]) -> str:
    return (f"{r['minute']:>4} {r['child'] if r['child'] is not None else '-':>5} {r['pid'] or '-':>7} "
            f"{r['rss_mib']:>8.1f} {r['req_s']:>7.1f} {r['blocks_s']:>9.1f} {r['written_s']:>9.1f} "
            f"{r['checked']:>9,} {r['hit_gpu']:>8,} {r['hit_cpu']:>8,} {r['hit_ssd']:>8,} {r['wrong']:>6}  "
            + "; ".join(r["events"]))


def print_report(rep: dict[str, Any]) -> None:
    tot, chk = rep["totals"], rep["checks"]
    print("\n== throughput per minute (served blocks checked, by tier they came from) ==")
    print(MINUTE_HEAD)
    for r in rep["minutes"]:
        print(fmt_minute(r))
    print("\n== children ==")
    print(f"{'child':>5} {'kind':>6} {'after':>8} {'ended':>8} {'run s':>6} {'requests':>9} {'warm MiB':>9} "
          f"{'end MiB':>8} {'growth':>7} {'steady':>7} {'SSD keys':>8} {'exact':>6} {'confirmed':>9} {'lost':>5}")
    for c in rep["children"]:
        rss = c["rss"] or {}
        ro = c["reopen"]
        run = (c["end_s"] or 0) - (c["ready_s"] or 0) if c["ready_s"] else 0
        g = rss.get("growth")
        print(f"{c['child']:>5} {c['kind']:>6} {c['after']:>8} {c['ended'] or '-':>8} {run:>6.0f} "
              f"{c['counters'].get('requests', 0):>9,} {_f(rss.get('warm_mib')):>9} {_f(rss.get('end_mib')):>8} "
              f"{(f'{g:+.1%}' if g is not None else '-'):>7} {_f(rss.get('steady_mib')):>7} "
              f"{ro.get('ssd_keys', 0):>8,} {ro.get('scan_exact', 0):>6,} "
              f"{(ro['confirmed'] if 'confirmed' in ro else '-'):>9} {(ro['lost'] if 'lost' in ro else '-'):>5}")
    print("\n== totals ==")
    print(f"requests {tot['requests']:,}; prompt blocks {tot['prompt_blocks']:,}; blocks written {tot['written']:,}")
    print(f"served blocks checked {tot['checked']:,} (gpu {tot['hit_gpu']:,}, cpu {tot['hit_cpu']:,}, "
          f"ssd {tot['hit_ssd']:,}); rechecked before free {tot['rechecked']:,}; "
          f"SSD records read back at start {sum(c['reopen'].get('ssd_keys', 0) for c in rep['children']):,}")
    g_in, g_x = chk["rss_growth_within_max"], chk["rss_growth_across"]
    print(f"wrong blocks {chk['wrong_blocks']}; flushed blocks lost {chk['flushed_blocks_lost']}; "
          f"hash chains differing {chk['hash_mismatches']}; restarts: {chk['graceful_restarts']} graceful, "
          f"{chk['sigkill_restarts']} SIGKILL")
    print(f"RSS growth after warm-up: max within a child {_pct(g_in)}, first -> last child {_pct(g_x)}"
          + (f" ({chk['rss_note']})" if "rss_note" in chk else ""))
    print(f"SSD tier: {chk['ssd_backstop_evictions']:,} records evicted by its own LRU backstop, "
          f"{chk['ssd_reported_lost']:,} blocks it reported lost, {chk['ssd_dropped_puts']:,} puts refused "
          f"(as of each child's last 10 s report)")
    fm = chk.get("ssd_files_max") or {}
    if fm:
        print(f"SSD files, largest seen: blocks.dat {fm['block_file_bytes'] / 2**20:.1f} MiB, data.mdb "
              f"{fm['index_file_bytes'] / 2**20:.1f} MiB (bound for each: capacity + slack = {fm['bound'] / 2**20:.1f} MiB)")
    print("RESULT: " + ("PASS" if rep["ok"] else "FAIL: " + "; ".join(rep["failures"])))


def _f(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def _pct(v: Any) -> str:
    return f"{v:+.2%}" if v is not None else "n/a"


def _pair(s: str) -> list[int]:
    lo, _, hi = s.partition(",")
    return [int(lo), int(hi or lo)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock length of the replay")
    ap.add_argument("--restart-every", type=float, default=150.0, help="seconds of work per child")
    ap.add_argument("--kill-every", type=int, default=2,
                    help="every Nth restart is a SIGKILL (and the last if none was); 0: never")
    ap.add_argument("--checkpoint-every", type=float, default=20.0, help="seconds between flush checkpoints")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds after a child is ready before RSS counts")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--dir", help="parent directory of the work directory (SSD tier, journals); default: TMPDIR")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-kib", type=int, default=8, help="bytes of one block (KiB)")
    ap.add_argument("--gpu-blocks", type=int, default=320)
    ap.add_argument("--cpu-blocks", type=int, default=1024)
    ap.add_argument("--ssd-blocks", type=int, default=8192)
    ap.add_argument("--compression", default="auto", choices=("auto", "zstd", "none"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (e.g. spill.admission=on_evict); repeatable")
    ap.add_argument("--system-prompts", type=int, default=6)
    ap.add_argument("--sys-blocks", type=_pair, default=[8, 48], help="system prompt length in blocks: lo,hi")
    ap.add_argument("--active", type=int, default=200, help="open conversations")
    ap.add_argument("--max-blocks", type=int, default=128, help="longest prompt + output, in blocks")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.0, help="exponent over recency ranks")
    ap.add_argument("--new-prob", type=float, default=0.05)
    ap.add_argument("--user-tokens", type=_pair, default=[8, 256])
    ap.add_argument("--out-tokens", type=_pair, default=[8, 192])
    ap.add_argument("--decode-chunk", type=int, default=48, help="tokens appended per decode step")
    ap.add_argument("--concurrency", type=int, default=2, help="requests held at once")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--close-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if (args.concurrency + 1) * args.max_blocks > args.gpu_blocks + args.max_blocks // 2:
        ap.error("--gpu-blocks must hold about --concurrency + 1 requests of --max-blocks")
    drv = Driver(args)
    try:
        rep = drv.run()
    finally:
        for l in drv.lives:
            if l.proc is not None and l.proc.poll() is None:
                l.proc.kill()
                l.proc.wait()
    print_report(rep)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
        print(f"report written to {args.json}")
    if args.keep:
        print(f"work directory kept: {drv.work}")
    else:
        shutil.rmtree(drv.work, ignore_errors=True)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
