"""A :class:`~kvstrata.pool.blocks.BlockManager` stepped as vLLM's scheduler steps a request alone.

The replay steps every pool the same way (:class:`~kvstrata.pool.protocol.SteppedPool`):
a request's prefill runs in chunks of ``max_num_batched_tokens`` tokens (``budget``;
None: the whole prompt at once), a step each (:meth:`KVGroups.chunk_end`). The
grouped pool (:class:`~kvstrata.pool.grouped.GroupedBlockManager`) chunks as vLLM does
with its groups; this is the same for one full-attention group over the plain pool:

* :meth:`SteppedBlockManager.allocate` without ``num_blocks`` holds the blocks of the
  prefill's first chunk (from the pool's hit on), with ``num_blocks`` (a load) those;
  then :meth:`~SteppedBlockManager.grow` holds the first chunk's after what the load served;
* :meth:`~SteppedBlockManager.commit` registers what the step computed;
* :meth:`~SteppedBlockManager.advance` holds the next chunk's blocks (False: the prefill
  is done). The last chunk takes every block of the request, the full blocks a recorded
  output completed too: they are computed with the prompt, so a plain request has no
  decode step that changes its pool (:meth:`~SteppedBlockManager.decode_steps` is empty).

Keys are the prompt's chain hashes (the one group's); ``key`` and ``stored`` are taken as
the grouped pool takes them, and not needed: every computed block is kept below.

Threads: owned by the driver's one thread.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvstrata.identity.groups import KVGroups
from kvstrata.identity.hashing import BlockHasher
from kvstrata.pool.blocks import Allocation, BlockManager, Prompt

__all__ = ["SteppedBlockManager"]

Key = Callable[[int, int], bytes]
Stored = Callable[[int, int], bool]


class SteppedBlockManager(BlockManager):
    """``num_blocks`` rows of ``groups`` (one full-attention group) prefilled in the chunks of
    ``budget`` tokens a step (see the module docstring)."""

    def __init__(self, num_blocks: int, groups: KVGroups, *, track_evictions: bool = False,
                 budget: int | None = None, hasher: BlockHasher | None = None) -> None:
        super().__init__(num_blocks, groups.block_size, hasher=hasher, track_evictions=track_evictions)
        self.groups = groups
        self.budget = budget
        self._steps: dict[str, list[int | None]] = {}  # request -> [tokens computed after this step (None: all), prefill]

    def lookup(self, prompt: Prompt, key: Key | None = None) -> int:  # type: ignore[override]
        return super().lookup(prompt)

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None, *,  # type: ignore[override]
                 prompt: Prompt | None = None, key: Key | None = None, num_external: int = 0,
                 num_blocks: int | None = None, prefill: int | None = None, stored: Stored | None = None,
                 **kwargs: object) -> Allocation:
        """The request's block table: the pool's hit, ``num_external`` blocks to load and up to
        ``num_blocks`` blocks (when None: the blocks of the prefill's first chunk, computed
        now). ``prefill``: the tokens the prefill computes (the prompt's by default)."""
        if prompt is None:
            prompt = self.prompt(token_ids, **kwargs)  # type: ignore[arg-type]
        prefill = min(prefill or prompt.num_tokens, prompt.num_tokens)
        upto: int | None = None
        if num_blocks is None:
            upto = self._chunk_end(super().lookup(prompt) * self.block_size, prefill)
            if upto is not None:
                num_blocks = -(-upto // self.block_size)
        alloc = super().allocate(request_id, prompt=prompt, num_external=num_external, num_blocks=num_blocks)
        self._steps[request_id] = [upto, prefill]
        return alloc

    def _chunk_end(self, start: int, prefill: int) -> int | None:
        """Where the prefill's chunk from token ``start`` ends; None for the last (every block)."""
        end = self.groups.chunk_end(start, prefill, budget=self.budget)
        return end if end < prefill else None

    def grow(self, request_id: str, num_tokens: int | None = None) -> list[int]:
        """After a load: the blocks of the prefill's first chunk after what the load served (or,
        given ``num_tokens``, :meth:`BlockManager.grow`'s)."""
        step = self._steps.get(request_id)
        if num_tokens is not None or step is None:
            return super().grow(request_id, num_tokens)
        upto = self._chunk_end(self._request(request_id).committed * self.block_size, step[1])  # type: ignore[arg-type]
        new = super().grow(request_id, upto)
        step[0] = upto
        return new

    def advance(self, request_id: str) -> bool:
        """The prefill's next chunk, a step of its own: False when the prefill is done. Raises
        :class:`OutOfBlocksError` with nothing changed."""
        step = self._steps[request_id]
        if step[0] is None:
            return False
        upto = self._chunk_end(step[0], step[1])  # type: ignore[arg-type]
        super().grow(request_id, upto)
        step[0] = upto
        return True

    def commit(self, request_id: str, num_tokens: int | None = None) -> list[tuple[int, bytes]]:
        """What the step computed (up to its chunk's end, or ``num_tokens``) is registered."""
        step = self._steps.get(request_id)
        return super().commit(request_id, num_tokens if num_tokens is not None or step is None else step[0])

    def decode_steps(self, request_id: str) -> list[int]:
        """None: a decode step leaves the plain pool as it is (the output's full blocks were
        committed with the prompt)."""
        return []

    def decode(self, request_id: str, t: int) -> list[tuple[int, bytes]]:
        return []

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._steps.pop(request_id, None)
