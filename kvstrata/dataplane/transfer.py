"""Batched block movement between the device KV pool and host memory.

The pool is a 2-D ``uint8`` tensor ``[num_blocks, block_nbytes]``, or an
engine's per-layer caches (tensors whose dim 0 is the block id, e.g. each
layer's K and V cache): then a block's row is the concatenation of its page
in every cache, in order (the kernels' staging-row layout). On CPU the moves
are single vectorised gathers/scatters per cache. On CUDA they run on a dedicated
copy stream through pinned host buffers and return events instead of
synchronising the device:

* :meth:`TransferEngine.read_rows` (spill, device -> host) orders itself after
  the work already queued on the compute stream, and returns once the bytes are
  on the host (it waits on its own copy event only, never on the whole device);
* :meth:`TransferEngine.write_rows` (promotion, host -> device) returns an event
  that the consumer must wait on before attention reads the rows
  (:meth:`wait_event` makes the compute stream wait, the host never blocks).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from kvstrata.system.streams import to_device
from kvstrata.tiers.buffers import copy_rows

__all__ = ["TransferEngine"]


# Copies between the device pool and host memory (``d2h``: stores, ``h2d``: loads), the
# labels of ``kvstrata:transfer_bytes``/``_seconds`` in the library's metrics and in vLLM's.
# What a load read from each tier is counted by the tier policy (``promotions{tier}``).
DIRECTIONS = ("d2h", "h2d")


class TransferEngine:
    """Moves whole blocks (rows of ``kv_pool``) in batches and counts bytes/seconds per direction."""

    def __init__(self, kv_pool: Any) -> None:
        import torch

        self.caches = _caches(kv_pool)
        self.pool = self.caches[0]  # the device the caches live on
        self.offsets, self.block_nbytes = _page_offsets(self.caches)
        self.cuda = self.pool.is_cuda
        # CPU copies go through numpy: single-threaded row memcpys. torch's intra-op
        # threads collapse (10-100x) when another thread or process competes for the cores.
        self._np = None if self.cuda else [_page_rows(c).numpy() for c in self.caches]
        self.stream = torch.cuda.Stream(device=self.pool.device) if self.cuda else None
        self._inflight: list[tuple[Any, Any]] = []  # (event, host buffer kept alive until the copy is done)
        self.moved = {d: {"bytes": 0, "seconds": 0.0} for d in DIRECTIONS}

    def count(self, direction: str, nbytes: int, seconds: float) -> None:
        m = self.moved[direction]
        m["bytes"] += nbytes
        m["seconds"] += seconds

    # ------------------------------------------------------------- device -> host

    def read_rows(self, rows: Sequence[int]) -> Any:
        """Copy pool rows into a new host tensor ``[len(rows), block_nbytes]``; returns when done."""
        import torch

        t0 = time.perf_counter()
        if not self.cuda:
            out_np = np.empty((len(rows), self.block_nbytes), dtype=np.uint8)
            for pages, (lo, hi) in zip(self._np, self.offsets):
                copy_rows(pages, rows, out_np[:, lo:hi], range(len(rows)))
            out = torch.from_numpy(out_np)
        else:
            out = torch.empty((len(rows), self.block_nbytes), dtype=torch.uint8, pin_memory=True)
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(self.stream):
                staged = _gather_device(self.caches, to_device(list(rows), self.pool.device), self.block_nbytes)
                out.copy_(staged, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            done.synchronize()  # this copy only: the bytes must be on the host before the row is reused
        self.count("d2h", out.numel(), time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------- host -> device

    def write_rows(self, rows: Sequence[int], data: Any) -> Any | None:
        """Copy host rows ``data`` (``[len(rows), block_nbytes]`` uint8) into pool rows.

        Returns None when the copy is complete (CPU pool), else a CUDA event
        recorded after it on the copy stream.
        """
        import torch

        t0 = time.perf_counter()
        if not self.cuda:
            src_np = data.numpy() if isinstance(data, torch.Tensor) else data
            for pages, (lo, hi) in zip(self._np, self.offsets):
                copy_rows(src_np[:, lo:hi], range(len(rows)), pages, rows)
            self.count("h2d", len(rows) * self.block_nbytes, time.perf_counter() - t0)
            return None
        src = data if isinstance(data, torch.Tensor) else torch.from_numpy(data)
        if not src.is_pinned():
            src = src.pin_memory()
        assert self.stream is not None
        # The rows' previous owner may still be read or written by work queued on the
        # compute stream (as in read_rows): the scatter runs after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self.stream):
            dev = src.to(self.pool.device, non_blocking=True)
            _scatter_device(self.caches, to_device(list(rows), self.pool.device), dev)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._inflight.append((done, src))
        self._reap()
        self.count("h2d", src.numel(), time.perf_counter() - t0)
        return done

    @staticmethod
    def wait_event(event: Any | None) -> None:
        """Make the current (compute) stream wait for ``event``; the host does not block."""
        if event is None:
            return
        import torch

        torch.cuda.current_stream().wait_event(event)

    @staticmethod
    def is_done(event: Any | None) -> bool:
        return event is None or bool(event.query())

    def synchronize(self) -> None:
        """Wait for every copy this engine queued (used by flush/close, not the hot path)."""
        if self.stream is not None:
            self.stream.synchronize()
        self._inflight.clear()

    def _reap(self) -> None:
        self._inflight = [(e, buf) for e, buf in self._inflight if not e.query()]


def _caches(kv_pool: Any) -> list[Any]:
    """The caches of ``kv_pool``: ``[kv_pool]`` for a 2-D uint8 pool, else its per-layer caches."""
    import torch

    if isinstance(kv_pool, torch.Tensor):
        if kv_pool.dtype != torch.uint8 or kv_pool.dim() != 2 or not kv_pool.is_contiguous():
            raise ValueError(f"kv_pool: expected a contiguous 2-D uint8 tensor [num_blocks, block_nbytes] or a "
                             f"list of per-layer caches, got {tuple(kv_pool.shape)} {kv_pool.dtype}")
        return [kv_pool]
    caches = list(kv_pool)
    if not caches or not all(isinstance(c, torch.Tensor) for c in caches):
        raise ValueError("kv_pool: expected a 2-D uint8 tensor or a non-empty list of per-layer cache tensors")
    first = caches[0]
    for i, c in enumerate(caches):
        if c.dim() < 2 or not c.is_contiguous():
            raise ValueError(f"kv_pool[{i}]: expected a contiguous tensor [num_blocks, ...], got "
                             f"{tuple(c.shape)} (contiguous: {c.is_contiguous()})")
        if c.shape[0] != first.shape[0] or c.device != first.device:
            raise ValueError(f"kv_pool[{i}]: {c.shape[0]} blocks on {c.device}, but kv_pool[0] has "
                             f"{first.shape[0]} blocks on {first.device}")
    return caches


def _page_rows(cache: Any) -> Any:
    """``cache`` as uint8 rows ``[num_blocks, page_bytes]`` (a view)."""
    import torch

    return cache.reshape(cache.shape[0], -1).view(torch.uint8)


def _page_offsets(caches: list[Any]) -> tuple[list[tuple[int, int]], int]:
    """The byte range of each cache's page within a block's row, and the row's size."""
    out, total = [], 0
    for c in caches:
        n = c[0].numel() * c.element_size()
        out.append((total, total + n))
        total += n
    return out, total


def _gather_device(caches: list[Any], idx: Any, block_nbytes: int) -> Any:
    """Blocks ``idx`` of CUDA caches as contiguous device rows (gather kernel when available)."""
    import torch

    try:
        from kvstrata.kernels import gather_blocks
    except ImportError:
        return torch.cat([_page_rows(c).index_select(0, idx) for c in caches], dim=1)
    out = torch.empty((idx.numel(), block_nbytes), dtype=torch.uint8, device=caches[0].device)
    gather_blocks(caches, idx, out)
    return out


def _scatter_device(caches: list[Any], idx: Any, data: Any) -> None:
    try:
        from kvstrata.kernels import scatter_blocks
    except ImportError:
        lo = 0
        for c in caches:
            rows = _page_rows(c)
            rows.index_copy_(0, idx, data[:, lo:lo + rows.shape[1]])
            lo += rows.shape[1]
        return
    scatter_blocks(data, caches, idx)
