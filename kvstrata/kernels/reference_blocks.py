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


def gather_blocks_ref(caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor,
                      out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out[out_rows[i]]`` (``out[i]`` when None) = the pages ``block_ids[i]`` of all layers."""
    rows = out if out_rows is None else torch.empty((block_ids.shape[0], out.shape[1]), dtype=out.dtype)
    for cache, off in zip(caches, stage_offsets(caches)):
        torch.index_select(page_view(cache), 0, block_ids, out=rows[:, off : off + page_nbytes(cache)])
    if out_rows is not None:
        index_copy_rows(out, out_rows, rows)
    return out


def scatter_blocks_ref(staging: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: torch.Tensor,
                       staging_rows: torch.Tensor | None = None) -> None:
    """Page ``block_ids[i]`` of every layer = its part of ``staging[staging_rows[i]]``."""
    rows = staging if staging_rows is None else staging.index_select(0, staging_rows)
    for cache, off in zip(caches, stage_offsets(caches)):
        index_copy_rows(page_view(cache), block_ids, rows[:, off : off + page_nbytes(cache)])


def index_copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index[i]] = src[i]`` for uint8 rows, moved as int64 words when both
    sides allow it (index_copy_ is several times faster per 8-byte element)."""
    if _widens(dst) and _widens(src):
        dst, src = dst.view(torch.int64), src.view(torch.int64)
    dst.index_copy_(0, index, src)


def _widens(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.shape[-1] % 8 == 0 and t.storage_offset() % 8 == 0 and t.stride(0) % 8 == 0


def copy_blocks_ref(caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in caches:
        pages = page_view(cache)
        index_copy_rows(pages, dst, pages.index_select(0, src))
