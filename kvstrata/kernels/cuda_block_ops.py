"""CUDA launchers for copy_blocks, gather_blocks and scatter_blocks (arguments
already validated). Each layer is described to the kernel by a device table
[4, num_layers] int64 (base pointer, row stride bytes, page bytes, staging
offset), cached by content so repeated calls on the same pool copy nothing.

gather/scatter run a grid-stride loop over (job, chunk) work items, so the
number of thread blocks of one launch is free: ``thread_blocks`` picks it from
the caller's cap, or the default cap for the staging buffer's placement."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from kvstrata.kernels import specs
from kvstrata.kernels.reference_blocks import page_nbytes, stage_offsets
from kvstrata.kernels.runtime import arg, launch
from kvstrata.system.streams import to_device

THREADS = 256  # kCopyThreads in block_copy.cuh
CHUNK_BYTES = THREADS * 16 * 4  # kCopyChunkBytes
MAX_GRID_Y = 65535
MAX_GRID_X = 2**31 - 1
# Default cap on the thread blocks of a gather/scatter whose staging is pinned host
# memory. Such a copy is bound by the host link (PCIe Gen5 x16 ~55 GB/s), not by the
# SMs: 32 blocks keep 32 x 16 KiB = 512 KiB of loads in flight, several times the
# link's bandwidth-delay product (~55 GB/s x ~2-3 us), while leaving three quarters
# of an H100/H200's 132 SMs to the forward pass. Without a cap a long copy fills
# every SM with blocks that each wait on the link.
HOST_STAGING_THREAD_BLOCKS = 32


@lru_cache(maxsize=64)
def _table(device: torch.device, rows: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def drop_tables() -> None:
    """Forget every cached table (their pointers are about to be freed: vLLM's sleep).
    A table still read by a queued kernel stays allocated until that kernel ran
    (``record_stream``)."""
    _table.cache_clear()


def layer_table(caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Device table [4, L]: data_ptr, stride(0) in bytes, page bytes, staging offset.

    Cached, so it is used on whichever stream launches the copy: each use is recorded
    on that stream (``record_stream``), or a table dropped from the cache could have its
    memory handed out again while a queued kernel still reads it."""
    rows = (
        tuple(c.data_ptr() for c in caches),
        tuple(c.stride(0) * c.element_size() for c in caches),
        tuple(page_nbytes(c) for c in caches),
        tuple(stage_offsets(caches)),
    )
    table = _table(caches[0].device, rows)
    if table.is_cuda:
        table.record_stream(torch.cuda.current_stream(table.device))
    return table


def vectorisable(caches: Sequence[torch.Tensor], *extra: int) -> bool:
    """16-byte accesses are legal: every base address, row stride and page size
    (and each value in ``extra``) is a multiple of 16."""
    values = [v for c in caches for v in (c.data_ptr(), c.stride(0) * c.element_size(), page_nbytes(c))]
    return all(v % 16 == 0 for v in (*values, *extra))


def grid_y(caches: Sequence[torch.Tensor]) -> int:
    return max(1, -(-max(page_nbytes(c) for c in caches) // CHUNK_BYTES))


def copy_blocks_cuda(caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    if block_mapping.shape[0] == 0:
        return
    device = caches[0].device
    table = layer_table(caches)
    pairs = to_device(block_mapping, device).contiguous()
    spec = specs.copy_blocks(vectorisable(caches))
    args = (arg(table[0]), arg(table[1]), arg(table[2]), np.int32(len(caches)), arg(pairs))
    launch(spec, device, (pairs.shape[0] * len(caches), grid_y(caches), 1), THREADS, args)


def thread_blocks(num_items: int, max_thread_blocks: int | None, host_staging: bool) -> int:
    """Grid size of a gather/scatter launch over ``num_items`` (job, chunk) items:
    at most ``max_thread_blocks``; when None, at most HOST_STAGING_THREAD_BLOCKS
    for host staging and one block per item (up to the grid limit) for device
    staging, an HBM-bound copy that is over quickly."""
    cap = max_thread_blocks
    if cap is None:
        cap = HOST_STAGING_THREAD_BLOCKS if host_staging else MAX_GRID_X
    return max(1, min(num_items, cap, MAX_GRID_X))


def gather_scatter_cuda(caches: Sequence[torch.Tensor], block_ids: torch.Tensor, staging: torch.Tensor, gather: bool,
                        staging_rows: torch.Tensor | None = None, max_thread_blocks: int | None = None) -> None:
    """Pages -> staging rows (gather) or back (scatter). ``staging`` is on the
    caches' device or in pinned host memory (addressed directly by the kernel);
    block ``block_ids[i]`` pairs with row ``staging_rows[i]`` (row i when None)."""
    if block_ids.numel() == 0:
        return
    device = caches[0].device
    table = layer_table(caches)
    ids = to_device(block_ids, device).contiguous()
    rows = None if staging_rows is None else to_device(staging_rows, device).contiguous()
    row_bytes = staging.stride(0)
    spec = specs.gather_scatter(vectorisable(caches, staging.data_ptr(), row_bytes), gather)
    jobs, chunks = ids.shape[0] * len(caches), grid_y(caches)
    blocks = thread_blocks(jobs * chunks, max_thread_blocks, staging.device.type == "cpu")
    args = (
        arg(table[0]), arg(table[1]), arg(table[2]), arg(table[3]), np.int32(len(caches)),
        arg(ids), np.uint64(0 if rows is None else rows.data_ptr()), np.uint64(staging.data_ptr()),
        np.int64(row_bytes), np.int64(jobs), np.int64(chunks),
    )
    launch(spec, device, (blocks, 1, 1), THREADS, args)
