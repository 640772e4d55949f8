"""KV-cache groups: what a prefix hit needs from each kind of attention layer.

A hybrid model's layers fall into groups that keep different parts of a
prefix (vLLM's hybrid allocator gives each group a block table of its own):

* ``full`` attention keeps every block: a hit of ``n`` blocks needs blocks
  ``0 .. n-1``;
* ``sliding`` window attention (``tokens``: the window) needs only the blocks
  holding the last ``window - 1`` tokens before the hit point;
* ``chunked`` local attention (``tokens``: the chunk) needs only the blocks of
  the chunk the hit point falls in;
* ``state`` layers (Mamba, Gated DeltaNet, short convolutions in vLLM's
  ``align`` prefix-caching mode) keep one state per block position: block
  ``i`` holds the state after ``i + 1`` blocks, so a hit of ``n`` blocks needs
  block ``n - 1`` alone. Only the blocks the engine cached as states hold one.

The rule is vLLM's ``get_num_skipped_tokens`` (its managers pad the skipped
blocks of a request's table with the null block); ``tests/test_groups.py``
checks it against vLLM's own managers. A hit of ``n`` blocks is only offered
when every group holds what it needs at ``n`` (:meth:`KVGroups.hit_end`).

What the tiers below keep of a windowed group follows vLLM's
``prefix_cache_retention_interval`` (``retention``, in tokens; vLLM's default 0):
a later hit can only end where the window before it was kept, so a sliding or
chunked group's block is stored only when it lies in what a hit at one of the
request's reachable ends needs (:meth:`KVGroups.stored`): the prompt's last hit
point, how far its full-attention prefix reaches (a shared-prefix junction),
and with ``retention > 0`` every ``retention``-token boundary. ``None`` keeps
every block (dense). Full-attention blocks are all kept; so is every state the
engine cached. For a model whose layers are mostly sliding (Gemma 3: five in
six) this stores a prompt's windowed groups in a few blocks each instead of
all of them.

Keys are per group: the same tokens give different bytes in different groups.
Group 0 keeps the position's chain key; group ``g > 0`` hashes it with ``g``
(:meth:`KVGroups.key`). The group structure is part of the fingerprint
(:meth:`KVGroups.describe`), so keys of one structure never meet another's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

__all__ = ["FULL", "SLIDING", "CHUNKED", "STATE", "KINDS", "MAX_GROUPS", "Group", "KVGroups", "parse_groups"]

FULL = "full"
SLIDING = "sliding"
CHUNKED = "chunked"
STATE = "state"
KINDS = (FULL, SLIDING, CHUNKED, STATE)

#: the most KV-cache groups a deployment may declare. Real models have a handful (Gemma 3: 7,
#: Qwen3-Next: 4, Nemotron-H: 7); vLLM's hybrid allocator gives at most one group per layer
#: (a lone layer of one kind makes every group one layer), and the deepest served models have
#: ~126 layers. Every group multiplies what a block costs a replay's memory.
MAX_GROUPS = 128

T = TypeVar("T")
Run = Callable[[int, int, int], int]  # (group, lo, hi) -> how many of its blocks lo .. hi - 1 are held, from lo


@dataclass(frozen=True)
class Group:
    """One KV-cache group: its ``kind`` and, for the windowed kinds, the window or chunk
    in ``tokens``."""

    kind: str
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KV-cache group kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if (self.kind in (SLIDING, CHUNKED)) != (self.tokens > 0):
            raise ValueError(f"KV-cache group {self.kind}: tokens {self.tokens} (a window or chunk size "
                             "for sliding and chunked groups, none for full attention and state groups)")

    def skipped_tokens(self, computed: int) -> int:
        """Tokens before ``computed`` that the next token does not need (vLLM's
        ``get_num_skipped_tokens``): a state layer needs only the state after the last one."""
        if self.kind == SLIDING:
            return max(0, computed - self.tokens + 1)
        if self.kind == CHUNKED:
            return computed // self.tokens * self.tokens
        if self.kind == STATE:
            return max(0, computed - 1)
        return 0

    def describe(self) -> str:
        return f"{self.kind}:{self.tokens}" if self.tokens else self.kind


class KVGroups:
    """The groups of one deployment, in the engine's order (``block_size`` tokens a block)."""

    def __init__(self, groups: Sequence[Group], block_size: int, retention: int | None = 0) -> None:
        if not groups:
            raise ValueError("a model has at least one KV-cache group")
        if retention is not None and (isinstance(retention, bool) or not isinstance(retention, int) or retention < 0):
            raise ValueError(f"retention: {retention!r}: expected None (dense), 0 (the reachable ends only) or "
                             "an interval in tokens")
        self.groups = tuple(groups)
        self.block_size = int(block_size)
        self.retention = retention
        self._every = max(1, retention // self.block_size) if retention else 0  # blocks between kept ends
        self._sparse = retention is not None and any(g.kind in (SLIDING, CHUNKED) for g in self.groups)
        self._full = tuple(g for g, group in enumerate(self.groups) if group.kind == FULL)
        self._windowed = tuple(g for g, group in enumerate(self.groups) if group.kind != FULL)
        # one full-attention group: a position is one entry (its chain key), every prefix of a hit is a hit
        self._prefix = len(self.groups) == 1 and not self._windowed

    @classmethod
    def one(cls, block_size: int) -> "KVGroups":
        """A model whose layers are all full attention: one group, keys the chain's."""
        return cls((Group(FULL),), block_size)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def plain(self) -> bool:
        """One full-attention group: every block of a prefix is needed, keys are the chain's."""
        return len(self.groups) == 1 and self.groups[0].kind == FULL

    def describe(self) -> str:
        """The structure as the fingerprint carries it ("" for one full-attention group)."""
        return "" if self.plain else ",".join(g.describe() for g in self.groups)

    def needed_from(self, g: int, n: int) -> int:
        """The first block of group ``g`` a hit of ``n`` blocks needs (earlier ones are skipped)."""
        return self.groups[g].skipped_tokens(n * self.block_size) // self.block_size

    def stored(self, g: int, i: int, ends: Sequence[int]) -> bool:
        """Do the tiers below keep block ``i`` of group ``g`` of a request whose later hits can
        end at ``ends`` (block counts)? Every block of a full-attention or state group; of a
        windowed group, the blocks a hit at one of ``ends`` needs (with ``retention``, also
        at every retention boundary); every block when ``ends`` is empty (not looked up) or
        the retention is dense."""
        if not self._sparse or not ends or self.groups[g].kind not in (SLIDING, CHUNKED):
            return True
        for end in ends:
            if self.needed_from(g, end) <= i < end:
                return True
        every = self._every
        if every:  # the next boundary after i, if a hit there needs i
            end = (i // every + 1) * every
            return self.needed_from(g, end) <= i
        return False

    def state_cached(self, i: int, ends: Sequence[int]) -> bool:
        """Does the engine cache the state a state group holds at block ``i`` (the state after
        ``i + 1`` blocks) of a request whose later hits can end at ``ends``? vLLM's
        ``reachable_block_mask`` for Mamba: every state when the retention is dense, else the
        states a hit at one of ``ends`` needs, and with ``retention > 0`` those ending a
        retention interval. Only a state the engine computed there is cached: one at a chunk's
        end (:meth:`chunk_end`), or the running state of a decode step."""
        every = self._every
        return self.retention is None or every == 1 or (i + 1) in ends or bool(every and (i + 1) % every == 0)

    def chunk_end(self, start: int, prefill: int, junction: int = 0, budget: int | None = None) -> int:
        """Where vLLM's scheduler ends the prefill chunk that starts at token ``start`` of a
        prompt of ``prefill`` tokens, the request alone in the step: ``budget`` tokens on
        (``max_num_batched_tokens``; None: the rest of the prompt). With state groups the
        state is written at a chunk's end, so vLLM's ``align`` mode
        (``_mamba_block_aligned_split``) ends a chunk that stops short of the prompt at a block
        boundary (or, for a block wider than the budget, at the next one), and stops a chunk
        at the shared-prefix ``junction`` (tokens, 0 for none) and at the prompt's last block
        boundary before its last token, where a later hit can end."""
        end = prefill if budget is None else min(prefill, start + budget)
        if not self.states:
            return end
        bs = self.block_size
        if end < prefill:
            aligned = end // bs * bs
            if aligned > start or budget is None or bs <= budget:
                end = aligned
        stops = ((start // bs + 1) * bs if start % bs else 0, max(prefill - 1, 0) // bs * bs, junction)
        return min((s for s in stops if start < s < end), default=end)

    @property
    def states(self) -> list[int]:
        """The state groups: a block of theirs is stored only once the engine cached it as a state."""
        return [g for g, group in enumerate(self.groups) if group.kind == STATE]

    @staticmethod
    def key(g: int, key: bytes) -> bytes:
        """Group ``g``'s key for the block whose chain key is ``key``."""
        if g == 0:
            return key
        return hashlib.blake2b(key, digest_size=len(key), person=b"kvstrata-group", salt=g.to_bytes(8, "little")
                               ).digest()

    def hit_end(self, first: int, last: int, held: Callable[[int, int], bool], run: Run | None = None) -> int:
        """The longest hit ``n`` (``first <= n <= last`` blocks) such that every group holds
        what it needs at ``n`` beyond the device prefix ``first``; ``held(g, i)``: the tiers
        below hold block ``i`` of group ``g`` (``run``: see :meth:`full_end`). ``first`` when
        there is none."""
        return self.window_end(first, self.full_end(first, last, held, run), held)

    def full_end(self, first: int, last: int, held: Callable[[int, int], bool], run: Run | None = None) -> int:
        """How far (``<= last``) every full-attention group holds every block from ``first``:
        the hit before the windows cut it, ``last`` without full-attention groups. ``run(g, lo,
        hi)``, when given: how many of group ``g``'s blocks ``lo .. hi - 1`` are held, from the
        first (what ``held`` says of them one by one, asked at once)."""
        end = last
        for g in self._full:
            if run is not None:
                end = first + run(g, first, end) if end > first else first
                continue
            i = first
            while i < end and held(g, i):
                i += 1
            end = i
        return end

    def window_end(self, first: int, end: int, held: Callable[[int, int], bool]) -> int:
        """The longest hit ``n`` (``first <= n <= end``) at which every windowed group holds
        what it needs, ``end`` being what the full-attention groups hold (:meth:`full_end`)."""
        if end <= first:
            return first
        windowed = self._windowed
        if not windowed:
            return end
        # From the longest candidate down: a group missing block m in what n needs rules out
        # every n' in (m, n] too (what they need starts no later), so the next candidate is m.
        # Each block is asked about once: usually only the windows at the end are.
        known: dict[tuple[int, int], bool] = {}
        n = end
        while n > first:
            miss = -1
            for g in windowed:
                for i in range(n - 1, max(first, self.needed_from(g, n)) - 1, -1):
                    ok = known.get((g, i))
                    if ok is None:
                        ok = known[(g, i)] = held(g, i)
                    if not ok:
                        miss = max(miss, i)
                        break
            if miss < 0:
                return n
            n = miss
        return first

    def blocks(self, first: int, n: int, block_ids: Sequence[Sequence[int]], null: int = 0
               ) -> list[tuple[int, int, int]]:
        """``(position, group, device block)`` of a hit ``[first, n)`` that must be loaded:
        every block the engine allocated from what each group needs (a window's or a state's
        ``null`` block is none: a full-attention group's table holds none), in position order."""
        if self._prefix:
            ids = block_ids[0]
            return [(i, 0, ids[i]) for i in range(first, min(n, len(ids)))]
        starts = [self.needed_from(g, n) for g in range(len(block_ids))]
        nulls = [null if self.groups[g].kind != FULL else None for g in range(len(block_ids))]
        out = []
        for i in range(first, n):
            for g, ids in enumerate(block_ids):
                if i >= starts[g] and i < len(ids) and ids[i] != nulls[g]:
                    out.append((i, g, ids[i]))
        return out

    def entries(self, first: int, end: int) -> list[tuple[int, int]]:
        """``(group, first block)`` of what a hit ``[first, end)`` needs of each group: its
        blocks from there to ``end``, in group order."""
        return [(g, max(first, self.needed_from(g, end))) for g in range(len(self.groups))]

    @staticmethod
    def interleave(columns: Sequence[Sequence[T]]) -> list[T]:
        """Equal columns (one per group) position by position: every group's item of the first
        position, then of the next."""
        if len(columns) == 1:
            return list(columns[0])
        return [x for row in zip(*columns) for x in row]

    def cut(self, tiers: Sequence[str], blocks: int, prefix: Callable[[Sequence[str]], int],
            whole: Callable[[Sequence[str]], bool]) -> tuple[int, int]:
        """How much of a hit of ``blocks`` positions to load rather than compute, its entries
        read from ``tiers`` (:meth:`entries`' blocks, group by group): ``(positions, entries)``.
        With one full-attention group every prefix of a hit is one, so the hit is cut where
        loading stops paying (``prefix(tiers)``: how many leading entries); otherwise it is
        loaded whole or not at all (``whole(tiers)``)."""
        if self._prefix:
            k = prefix(tiers)
            return k, k
        return (blocks, len(tiers)) if whole(tiers) else (0, 0)

    def served(self, arrived: int, entries: int, positions: int) -> int:
        """Positions of a load (``entries`` entries over ``positions`` positions) that serve a
        hit once its first ``arrived`` entries arrived: each that arrived with one
        full-attention group; otherwise the whole hit or none."""
        if self._prefix:
            return arrived
        return positions if arrived == entries else 0

    def arrived(self, positions: int, entries: int) -> int:
        """Entries of a load of ``entries`` that are in the device pool once ``positions`` of
        its hit were served (:meth:`served`)."""
        if self._prefix:
            return positions
        return entries if positions else 0

    def position_tiers(self, first: int, end: int, positions: Sequence[int], tiers: Sequence[str],
                       order: Sequence[str]) -> list[str]:
        """The tier each position of a hit ``[first, end)`` is served from, its entries (at
        ``positions``) read from ``tiers``: the slowest (latest in ``order``) any group reads
        it from; a position no group needs counts with the next one loaded."""
        if self._prefix:
            return list(tiers)
        rank = {t: i for i, t in enumerate(order)}
        slowest: dict[int, str] = {}
        for i, tier in zip(positions, tiers):
            if i not in slowest or rank.get(tier, len(rank)) > rank.get(slowest[i], len(rank)):
                slowest[i] = tier
        out: list[str] = []
        fill = slowest.get(max(slowest), order[1]) if slowest else order[1]
        for i in range(end - 1, first - 1, -1):
            fill = slowest.get(i, fill)
            out.append(fill)
        return out[::-1]

    @property
    def each(self) -> bool:
        """Does a hit need to know of each key a remote probe asks about (some keys of each
        position), rather than how many lead (one full-attention group's chain)?"""
        return not self._prefix


def parse_groups(value: object, path: str) -> tuple[Group, ...]:
    """Groups as a config gives them: ``"full,sliding:1024"`` or ``["full", "sliding:1024"]``
    (kinds, in the engine's order, a window or chunk in tokens after a colon); ``""`` or
    none: one full-attention group; at most :data:`MAX_GROUPS`. Raises ``ValueError`` naming ``path``."""
    if value is None or value == "" or value == []:
        return (Group(FULL),)
    if isinstance(value, (str, list, tuple)):
        count = value.count(",") + 1 if isinstance(value, str) else len(value)
        if count > MAX_GROUPS:
            raise ValueError(f"{path}: {count:,} KV-cache groups, more than {MAX_GROUPS} (at most one a layer; real "
                             "models have a few)")
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ValueError(f"{path}: expected a list of group kinds or a comma-separated string, got {value!r:.100}")
    out = []
    for n, item in enumerate(items):
        kind, _, tokens = item.strip().partition(":")
        if tokens and not tokens.strip().isdigit():
            raise ValueError(f"{path}[{n}]: {item!r:.60}: expected a window or chunk in tokens after the colon")
        try:
            out.append(Group(kind, int(tokens) if tokens else 0))
        except ValueError as exc:
            raise ValueError(f"{path}[{n}]: {item!r:.60}: {exc}") from None
    return tuple(out)
