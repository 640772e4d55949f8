"""CPU reference of the whole-page copies: copy_blocks, gather, scatter.
Vectorised per layer (index_select / index_copy_); no loop over blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def page_view(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` as raw page bytes [num_blocks, page_bytes] (a view; dims 1.. contiguous)."""
    rows = cache.flatten(1) if cache.dim() > 1 else cache.unsqueeze(1)
    return rows.view(torch.uint8)


def page_nbytes(cache: torch.Tensor) -> int:
    """Bytes of one page (dim 0 slice) of ``cache``."""
    return cache[0].numel() * cache.element_size() if cache.shape[0] else 0


def stage_offsets(caches: Sequence[torch.Tensor]) -> list[int]:
    """Byte offset of each layer's page within a staging row (layers in order)."""
    offsets, total = [], 0
    for c in caches:
        offsets.append(total)
        total += page_nbytes(c)
    return offsets


def gather_blocks_ref(caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    for cache, off in zip(caches, stage_offsets(caches)):
        torch.index_select(page_view(cache), 0, block_ids, out=out[:, off : off + page_nbytes(cache)])
    return out


def scatter_blocks_ref(staging: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    for cache, off in zip(caches, stage_offsets(caches)):
        page_view(cache).index_copy_(0, block_ids, staging[:, off : off + page_nbytes(cache)])


def copy_blocks_ref(caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in caches:
        pages = page_view(cache)
        pages.index_copy_(0, dst, pages.index_select(0, src))
