"""KV-cache events for prefix-aware routers: what the tiers below vLLM's GPU pool hold.

A consumer of the tier policy's events, run by the scheduler half when vLLM's
``--kv-events-config`` enables KV-cache events. It hands vLLM's own
``BlockStored`` / ``BlockRemoved`` objects to ``take_events()``, so they travel
in vLLM's batches, on vLLM's publisher, in the installed vLLM's wire format,
beside vLLM's GPU events for the same blocks:

* block hashes are **vLLM's** (``request.block_hashes``, converted as vLLM
  converts its own), with the parent's hash, the token ids, the block size,
  the LoRA fields and vLLM's extra keys, so a router joins them with the GPU
  events or rebuilds its own keys from the tokens;
* one medium per tier, the one its declaration gives (``Tier.medium``,
  :func:`media_of`): ``CPU`` for the DRAM tier, ``STORAGE`` for the SSD tier
  (:data:`MEDIA`), a plug-in tier's own; the shared remote tier is not
  announced (every replica reads it alike, and the server evicts without
  telling: see :data:`MEDIA`);
* a ``BlockStored`` is sent once the copy that placed the block completed (a
  store every worker finished, a load's promotion, a fetch), never at the
  plan; a ``BlockRemoved`` for a medium once no tier of that medium holds a
  block announced there (evicted, found corrupt, cleared). Tiers of one medium
  are one place to a router: a block that moves between them (a DRAM tier's
  eviction cascading into a plug-in tier of medium ``CPU``) is announced once,
  and removed when the last of them lets it go;
* a block of a state group (Mamba, linear attention: vLLM's kind ``mamba``) is
  announced as vLLM's ``BlockPool`` announces a prompt's state (0.32 to 0.34 alike):
  one ``BlockStored`` whose ``token_ids`` run from the prompt's start through the
  block and whose parent is None, since the group keeps no block before it (vLLM's
  range of positions, of which only the state at the end is held); where a tag of
  a position before it was dropped, the block's own tokens under its parent's hash
  (the one-block range vLLM announces in a decode step);
* after a restart the blocks the SSD tier already holds are announced as
  ``STORAGE``, with their tokens, as soon as the policy holds them (the SSD
  tier keeps each block's :class:`BlockTag` beside its record, see
  :meth:`KVEvents.store_tags`), at most :data:`ANNOUNCE_PER_STEP` per step.

What a block's events need is kept in one :class:`BlockTag` per block (about
400 bytes), for at most as many blocks as the GPU pool and the tiers below
hold together; a block whose tag was dropped is not announced again (its
events are counted in ``untagged``). vLLM's hashes are rebuilt after a restart
with vLLM's hash function from the tags' tokens and extra keys, so they match
the GPU events of the new process. A tag also keeps what kvstrata's own key of
the block hashed beside its parent and tokens: at a restart, a tag whose parent,
tokens and extra bytes do not hash to the record's key (a damaged or tampered
tag) is not announced (counted in ``mismatched``), so a router is never told of
blocks under tokens they do not hold.

Threading: the scheduler thread owns everything here, like the policy.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import msgpack

from kvstrata.identity.groups import KVGroups
from kvstrata.policy.tiers import KNOWN, LOWER, PERSISTENT, SHARED, Tier

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvstrata.identity.hashing import BlockHasher
    from kvstrata.policy import TierPolicy

__all__ = ["MEDIA", "media_of", "BlockTag", "KVEvents", "ANNOUNCE_PER_STEP", "EVENT_COUNTS", "events_enabled",
           "event_kinds"]

log = logging.getLogger(__name__)

#: The medium of each built-in tier in vLLM's events. ``CPU`` is vLLM's own name for its DRAM
#: offloading tier; ``STORAGE`` is vLLM's constant for storage (llm-d lowercases media:
#: ``cpu``, ``storage``). The remote tier has none: any replica loads from it, so it says
#: nothing about where to route, and its server evicts without telling anyone.
MEDIA = {name: KNOWN[name].medium for name in (*LOWER, *SHARED) if KNOWN[name].medium}
_TAGGED = frozenset(PERSISTENT)  # the tiers whose records keep the tags beside them
EVENT_COUNTS = ("stored", "removed", "announced", "untagged", "mismatched")  # KVEvents.counts, per block
ANNOUNCE_PER_STEP = 4096  # restart announcements per engine step (a step's batch stays small)
STATE_KIND = "mamba"  # vLLM's KVCacheSpecKind of a state group (Mamba, linear attention)
_TAG_VERSION = 3  # 2: kvstrata's own extra bytes, to check the tag against the record's key; 3: the KV-cache group


def events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


class BlockTag:
    """What a block's events carry beyond its kvstrata key: vLLM's hash (None until rebuilt
    after a restart), its parent's, the token ids (int32), vLLM's extra keys for the block
    (tagged, as vLLM hashes them), the LoRA fields, the parent's kvstrata key (its chain key,
    as group 0 has it), the KV-cache group (:mod:`kvstrata.identity.groups`: vLLM's hash of a
    block is the same in every group, kvstrata's key is not), and the media announced as
    holding it."""

    __slots__ = ("vhash", "parent_vhash", "tokens", "extra", "lora_id", "lora_name", "parent_key", "kextra", "group",
                 "media")

    def __init__(self, vhash: bytes | None, parent_vhash: bytes | None, tokens: bytes, extra: Any,
                 lora_id: int | None, lora_name: str | None, parent_key: bytes | None, kextra: bytes = b"",
                 group: int = 0) -> None:
        self.vhash = vhash
        self.parent_vhash = parent_vhash
        self.tokens = tokens
        self.extra = extra
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.parent_key = parent_key
        self.kextra = kextra  # what kvstrata's key of the block hashed beside parent and tokens
        self.group = group
        self.media = 0  # a bit per medium (KVEvents' own): announced as held there

    def pack(self) -> bytes:
        """The tag kept beside the block's SSD record (rebuilds this tag after a restart)."""
        return msgpack.packb([_TAG_VERSION, self.parent_key, self.tokens, self.extra, self.lora_id,
                              self.lora_name, self.kextra, self.group], use_bin_type=True)

    def in_group(self, group: int) -> "BlockTag":
        """The tag of the same block position in KV-cache group ``group``."""
        return BlockTag(self.vhash, self.parent_vhash, self.tokens, self.extra, self.lora_id, self.lora_name,
                        self.parent_key, self.kextra, group)

    @classmethod
    def unpack(cls, data: bytes) -> "BlockTag | None":
        """A tag :meth:`pack` made (its hashes not yet rebuilt), or None for anything else."""
        try:
            version, parent, tokens, extra, lora_id, lora_name, kextra, *rest = msgpack.unpackb(data, raw=False)
        except Exception:
            return None
        group = rest[0] if version == _TAG_VERSION and len(rest) == 1 else 0 if version == 2 and not rest else None
        if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < 1 << 16:
            return None
        if not isinstance(tokens, bytes) or len(tokens) % 4 or not isinstance(kextra, bytes):
            return None
        if parent is not None and not isinstance(parent, bytes):
            return None
        return cls(None, None, tokens, _tuples(extra), lora_id, lora_name, parent, kextra, group)

    def token_ids(self) -> list[int]:
        return array("i", self.tokens).tolist()


def _tuples(value: Any) -> Any:
    """msgpack's lists back to the tuples vLLM hashes (its extra keys are tuples of tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def media_of(tiers: Iterable[Tier]) -> dict[str, str]:
    """The medium each of ``tiers`` announces its blocks under (those without one left out)."""
    return {t.name: t.medium for t in tiers if t.medium}


class KVEvents:
    """The scheduler's KV-event consumer (see the module docstring). ``capacity``: tags
    kept (the blocks the GPU pool and the lower tiers hold together)."""

    def __init__(self, policy: "TierPolicy", block_size: int, capacity: int, hash_fn: Callable[[Any], bytes],
                 hasher: "BlockHasher", extra_of: Callable[["Request", int], bytes],
                 kinds: Sequence[tuple[str, int | None]] = ()) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        self.policy = policy
        self.block_size = block_size
        self.capacity = max(1, capacity)
        self.hash_fn = hash_fn
        self.hasher = hasher      # kvstrata's: checks a tag read back against its record's key
        self.extra_of = extra_of  # (request, block index) -> what kvstrata's key hashed beside the tokens
        self._stored, self._removed = BlockStored, BlockRemoved
        assert policy.spec.tiers is not None
        self._media = media_of(policy.spec.tiers)  # tier -> medium
        self._bits = {m: 1 << i for i, m in enumerate(dict.fromkeys(self._media.values()))}  # medium -> bit
        self._of_medium = {m: tuple(t for t, tm in self._media.items() if tm == m) for m in self._bits}
        # vLLM (0.32 to 0.34) annotates each BlockStored with its group's kind and window
        # (KVCacheManager.take_events): kvstrata's events carry the same, per group
        self._kinds = list(kinds) if "kv_cache_spec_kind" in getattr(BlockStored, "__struct_fields__", ()) else []
        self.tags: OrderedDict[bytes, BlockTag] = OrderedDict()
        self._events: list[tuple[bool, str, BlockTag]] = []  # (stored?, medium, tag) since the last take
        self._leaving: list[tuple[str, bytes]] = []  # (tier, key) evicted or lost since the last take
        self._announce: list[bytes] | None = None     # keys read from the SSD tier, to announce
        self._announcing: Any = None                   # the future reading them
        self.counts = dict.fromkeys(EVENT_COUNTS, 0)
        policy.add_observer(self._observe)

    # ------------------------------------------------------------------ tags

    def record(self, request: "Request", keys: Sequence[bytes], lo: int, hi: int,
               group_key: Callable[[int, int], bytes] | None = None, groups: int = 1) -> None:
        """Tags of the request's blocks ``lo..hi`` (``keys``: its kvstrata hash chain), for
        those that have none yet; with ``groups`` KV-cache groups, in each group too
        (``group_key(g, i)``: block ``i``'s key in group ``g``)."""
        tags = self.tags
        vhashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        if len(vhashes) != len(tokens) // bs:  # vLLM hashes in blocks of another size (hybrid models)
            if not self.counts["untagged"]:
                log.warning("kvstrata: vLLM hashes blocks of %d tokens, not %d: the tiers below are "
                            "not announced", len(tokens) // max(1, len(vhashes)), bs)
            self.counts["untagged"] += max(0, hi - lo)
            return
        hi = min(hi, len(keys), len(vhashes))
        for i in range(lo, hi):
            key = keys[i]
            tag = tags.get(key)
            if tag is not None:
                tags.move_to_end(key)
            else:
                tag = tags[key] = BlockTag(vhashes[i], vhashes[i - 1] if i else None,
                                           array("i", tokens[i * bs:(i + 1) * bs]).tobytes(),
                                           _extra_keys(request, i, bs),
                                           request.lora_request.adapter_id if request.lora_request else None,
                                           request.lora_request.name if request.lora_request else None,
                                           keys[i - 1] if i else None, self.extra_of(request, i))
            for g in range(1, groups):  # the same position in the other groups
                assert group_key is not None
                gkey = group_key(g, i)
                tags[gkey] = tags.get(gkey) or tag.in_group(g)
                tags.move_to_end(gkey)
        while len(tags) > self.capacity:
            tags.popitem(last=False)

    def store_tags(self, plans: Iterable[Any]) -> dict[bytes, bytes]:
        """The packed tags of every block ``plans`` write to a persistent tier (the SSD tier:
        the workers keep them beside the records)."""
        out: dict[bytes, bytes] = {}
        for plan in plans:
            for tier, key in plan.placed():
                tag = self.tags.get(key) if tier in _TAGGED else None
                if tag is not None:
                    out[key] = tag.pack()
        return out

    # ------------------------------------------------------------------ completions

    def completed(self, plan: Any, done: int | None = None) -> None:
        """A plan's copies completed (``done``: blocks a load or fetch delivered): announce
        what it placed that its tier still holds."""
        held_in = self.policy.held_in
        for tier, key in plan.placed(done):
            if tier in self._media and held_in(tier, key):
                self._store(tier, key)

    def _store(self, tier: str, key: bytes) -> None:
        tag = self.tags.get(key)
        if tag is None or tag.vhash is None:
            self.counts["untagged"] += 1
            return
        medium = self._media[tier]
        bit = self._bits[medium]
        if tag.media & bit:
            return
        tag.media |= bit
        self._events.append((True, medium, tag))
        self.counts["stored"] += 1

    def _observe(self, kind: str, tier: str, keys: Sequence[bytes], now: float) -> None:
        if kind in ("evicted", "lost") and tier in self._media:
            self._leaving.extend((tier, k) for k in keys)

    def _held_on(self, medium: str, key: bytes) -> bool:
        """Does a tier of ``medium`` hold ``key``?"""
        held_in = self.policy.held_in
        return any(held_in(t, key) for t in self._of_medium[medium])

    # ------------------------------------------------------------------ restart

    def announce_from(self, read: Callable[[], dict[bytes, bytes]]) -> None:
        """Read the SSD tier's tags on a thread (``read``: key -> packed tag) and announce
        the blocks the policy holds once they are in."""
        import concurrent.futures
        import threading

        future: concurrent.futures.Future[dict[bytes, bytes]] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(read())
            except BaseException as exc:  # a broken tier costs announcements, never the engine
                future.set_exception(exc)

        threading.Thread(target=run, name="kvstrata-announce", daemon=True).start()
        self._announcing = future

    def _poll_announcement(self, pending: bool) -> None:
        """Take the read tags once in; announce held blocks (``pending``: the SSD tier's
        seeding is not over, so keys not held yet may still be)."""
        if self._announcing is not None and self._announcing.done():
            future, self._announcing = self._announcing, None
            try:
                self._announce = self._rebuild(future.result())
            except Exception as exc:
                log.warning("kvstrata: cannot read the SSD tier's block tags (%s); its blocks are "
                            "not announced", exc)
        if not self._announce:
            return
        held_in = self.policy.held_in
        todo, later, n = self._announce, [], 0
        for i, key in enumerate(todo):
            if n >= ANNOUNCE_PER_STEP:
                later.extend(todo[i:])
                break
            tier = next((t for t in _TAGGED if held_in(t, key)), None)
            if tier is not None:
                self._store(tier, key)
                n += 1
            elif pending:
                later.append(key)
        self.counts["announced"] += n
        self._announce = later or None

    def _rebuild(self, packed: dict[bytes, bytes]) -> list[bytes]:
        """Tags from the SSD tier, vLLM's hashes rebuilt along each chain; returns their keys,
        parents first. A chain runs by position: vLLM's hash of a block is the same in every
        KV-cache group, so a position is hashed from whichever group's block the SSD tier holds
        there (a window group keeps only some positions; a full-attention group, all). A block
        whose parent position is held in no group cannot be hashed, nor reached by a prefix:
        skipped."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        tags = {k: t for k, t in ((k, BlockTag.unpack(v)) for k, v in packed.items()) if t is not None}
        at: dict[bytes, list[bytes]] = {}  # a position's chain key -> its tags' keys, in every group
        for k, t in tags.items():
            chain_key = self._chain_key(k, t)
            if chain_key is not None:
                at.setdefault(chain_key, []).append(k)
        self.counts["mismatched"] += len(tags) - sum(map(len, at.values()))
        vhash: dict[bytes, bytes] = {}  # chain key -> vLLM's hash (b"": unreachable)
        order: list[bytes] = []
        for start in at:
            chain: list[bytes] = []
            on_chain: set[bytes] = set()  # (damaged tags may form a cycle)
            c: bytes | None = start
            while c is not None and c in at and c not in vhash and c not in on_chain:
                chain.append(c)
                on_chain.add(c)
                c = tags[at[c][0]].parent_key
            parent = vhash.get(c) if c is not None else None
            if c is not None and not parent:  # an orphan chain (or a cycle): unreachable
                vhash.update(dict.fromkeys(chain, b""))
                continue
            for c in reversed(chain):
                first = tags[at[c][0]]
                vhash[c] = h = hash_block_tokens(self.hash_fn, parent, first.token_ids(), first.extra)
                for k in at[c]:
                    tags[k].parent_vhash, tags[k].vhash = parent, h
                    order.append(k)
                parent = h
        for key in order:
            if key not in self.tags:
                self.tags[key] = tags[key]
        while len(self.tags) > self.capacity:
            self.tags.popitem(last=False)
        return [k for k in order if k in self.tags]

    def _chain_key(self, key: bytes, tag: BlockTag) -> bytes | None:
        """The chain key of the tag's position, if its parent, tokens and extra bytes hash to
        ``key`` (the record's own, in the tag's group); None when they do not."""
        try:
            chain_key = self.hasher.block_key(tag.parent_key, tag.token_ids(), tag.kextra)
        except (ValueError, TypeError):  # tokens of another block size, or not token ids
            return None
        return chain_key if KVGroups.key(tag.group, chain_key) == key else None

    # ------------------------------------------------------------------ vLLM's hook

    def take(self, seeding_pending: bool = False) -> list[Any]:
        """The events since the last call (``take_events()``)."""
        self._poll_announcement(seeding_pending)
        if self._leaving:
            for tier, key in self._leaving:
                tag = self.tags.get(key)
                medium = self._media[tier]
                bit = self._bits[medium]
                if tag is None or not tag.media & bit or self._held_on(medium, key):
                    continue
                tag.media &= ~bit
                self._events.append((False, medium, tag))
                self.counts["removed"] += 1
            self._leaving = []
        out, self._events = self._events, []
        return self._build(out)

    def _build(self, changes: list[tuple[bool, str, BlockTag]]) -> list[Any]:
        """vLLM's event objects for ``(stored?, medium, tag)`` in order, as few as possible: a
        run of stores of one medium that continue a chain (each the child of the one before,
        one LoRA) is one ``BlockStored``, a run of removals of one medium one ``BlockRemoved``."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, to_event_extra_keys

        out: list[Any] = []
        last: Any = None
        prev: BlockTag | None = None
        for stored, medium, tag in changes:
            vhash = maybe_convert_block_hash(tag.vhash)
            if not stored:
                if isinstance(last, self._removed) and last.medium == medium and last.group_idx == tag.group:
                    last.block_hashes.append(vhash)
                else:
                    last = self._removed(block_hashes=[vhash], medium=medium, group_idx=tag.group)
                    out.append(last)
                continue
            extra = to_event_extra_keys([tag.extra])
            state = tag.group < len(self._kinds) and self._kinds[tag.group][0] == STATE_KIND
            if (not state and isinstance(last, self._stored) and last.medium == medium and prev is not None
                    and tag.parent_vhash == prev.vhash and tag.lora_name == prev.lora_name and tag.group == prev.group):
                last.block_hashes.append(vhash)
                last.token_ids.extend(tag.token_ids())
                last.extra_keys.extend(extra)
            else:
                parent, tokens = self._state_range(tag) if state else (tag.parent_vhash, tag.token_ids())
                last = self._stored(
                    block_hashes=[vhash],
                    parent_block_hash=maybe_convert_block_hash(parent) if parent else None,
                    token_ids=tokens, block_size=self.block_size, lora_id=tag.lora_id,
                    medium=medium, lora_name=tag.lora_name, extra_keys=extra, group_idx=tag.group)
                if tag.group < len(self._kinds):
                    last.kv_cache_spec_kind, last.kv_cache_spec_sliding_window = self._kinds[tag.group]
                out.append(last)
            prev = tag
        return out


    def _state_range(self, tag: BlockTag) -> tuple[bytes | None, list[int]]:
        """A state block's parent hash and tokens in vLLM's form (see the module docstring):
        (None, the tokens from the prompt's start through the block), walking the tags of
        the positions before it (group 0's, by their chain keys); (its parent's hash, its own
        tokens) when one of those tags is gone or does not continue the chain."""
        parts, at = [tag.tokens], tag
        for _ in range(len(self.tags)):  # (a bound: a chain of tags has no cycle)
            if at.parent_key is None:
                return None, array("i", b"".join(reversed(parts))).tolist()
            before = self.tags.get(at.parent_key)
            if before is None or before.vhash is None or before.vhash != at.parent_vhash:
                break
            parts.append(before.tokens)
            at = before
        return tag.parent_vhash, tag.token_ids()


def event_kinds(kv_cache_config: "KVCacheConfig") -> list[tuple[str, int | None]]:
    """Per KV-cache group, the kind and sliding window vLLM puts on its own ``BlockStored``
    events (0.32 to 0.34); empty where vLLM does not name kinds."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:
        return []
    return [(get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups]


def _extra_keys(request: "Request", i: int, bs: int) -> Any:
    """vLLM's extra keys of block ``i`` (multimodal inputs, LoRA, cache salt, prompt embeds)."""
    if request.lora_request is None and not request.cache_salt and not getattr(request, "mm_features", None) \
            and getattr(request, "prompt_embeds", None) is None:
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    return generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)[0]
