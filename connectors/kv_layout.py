"""Opaque-page view of an engine's paged KV tensors.

A tierkv block is the concatenation of every (layer, segment) page of one
engine block, as raw bytes. The layout is derived from the tensors the engine
hands over, not from one engine version's shape:

* the block dimension is the dimension whose size is ``num_blocks``;
* dimensions before it (e.g. the ``2`` of a ``[2, num_blocks, ...]`` K/V split)
  give separate segments; dimensions after it must be contiguous per block;
* layers that are views of the same bytes are counted once.

When all segments are equally sized, equally spaced views of one buffer (the
usual case: one allocation, per-layer views), the whole block is moved with a
single strided ``index_select`` / ``index_copy_``; otherwise one such copy per
segment. Never a Python loop over blocks.

:class:`LayoutRows` adapts a layout to the executor and the copier: whole
blocks as host rows, through tierkv's gather/scatter kernels on CUDA (one
launch per job over every segment, straight into pinned slab slots or
staging) and through the copies above on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from tierkv.executor import host_rows
from tierkv.transfer import copy_rows

if TYPE_CHECKING:
    import torch

__all__ = ["KVLayout", "LayoutRows", "Segment"]


@dataclass(frozen=True)
class Segment:
    """One contiguous run of bytes per block inside one storage."""

    storage_ptr: int
    offset: int         # bytes from the storage start to block 0's run
    block_stride: int   # bytes between consecutive blocks' runs
    nbytes: int         # bytes of the run


def _u8_base(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _contiguous_tail(t: "torch.Tensor") -> bool:
    """True if every dim of ``t`` after the first is laid out contiguously."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _segments_of(name: str, t: "torch.Tensor", num_blocks: int) -> list[tuple[Segment, "torch.Tensor"]]:
    dims = [d for d, size in enumerate(t.shape) if size == num_blocks]
    if not dims:
        raise ValueError(f"kv_caches[{name!r}]: no dimension of size num_blocks={num_blocks} "
                         f"in shape {tuple(t.shape)}")
    bdim = dims[0]
    itemsize = t.element_size()
    out = []
    for outer in _outer_indices(t.shape[:bdim]):
        sub = t[outer] if outer else t
        if not _contiguous_tail(sub):
            raise ValueError(f"kv_caches[{name!r}]: pages are not contiguous per block "
                             f"(shape {tuple(t.shape)}, strides {t.stride()})")
        seg = Segment(storage_ptr=t.untyped_storage().data_ptr(),
                      offset=sub.storage_offset() * itemsize,
                      block_stride=sub.stride(0) * itemsize,
                      nbytes=math.prod(sub.shape[1:]) * itemsize)
        out.append((seg, sub))
    return out


def _outer_indices(shape: Iterable[int]) -> list[tuple[int, ...]]:
    idx: list[tuple[int, ...]] = [()]
    for size in shape:
        idx = [i + (j,) for i in idx for j in range(size)]
    return idx


class KVLayout:
    """Gather/scatter whole tierkv blocks (all layers) between an engine's KV
    tensors and ``[n, block_nbytes]`` uint8 row tensors."""

    def __init__(self, kv_caches: Mapping[str, "torch.Tensor"], num_blocks: int) -> None:
        import torch

        if not kv_caches:
            raise ValueError("kv_caches: empty")
        segs: dict[Segment, torch.Tensor] = {}
        for name, t in kv_caches.items():
            for seg, sub in _segments_of(name, t, num_blocks):
                segs.setdefault(seg, sub)  # layers sharing storage count once
        self.num_blocks = num_blocks
        # Page order inside a tierkv block: layers in the order given, then the
        # outer index; never memory addresses, which differ between processes.
        self.segments = list(segs)
        self.block_nbytes = sum(s.nbytes for s in self.segments)
        self.device = next(iter(kv_caches.values())).device
        base = {s.storage_ptr: _u8_base(segs[s]) for s in self.segments}
        self._fused = self._fused_view(base)
        self._views = [torch.as_strided(base[s.storage_ptr], (num_blocks, s.nbytes),
                                        (s.block_stride, 1), s.offset) for s in self.segments]
        self._offsets = [0]
        for s in self.segments[:-1]:
            self._offsets.append(self._offsets[-1] + s.nbytes)

    def _fused_view(self, base: Mapping[int, "torch.Tensor"]) -> "torch.Tensor | None":
        import torch

        s0 = self.segments[0]
        same = all(s.storage_ptr == s0.storage_ptr and s.nbytes == s0.nbytes
                   and s.block_stride == s0.block_stride for s in self.segments)
        if not same:
            return None
        n = len(self.segments)
        step = self.segments[1].offset - s0.offset if n > 1 else s0.nbytes
        if any(s.offset != s0.offset + i * step for i, s in enumerate(self.segments)):
            return None
        return torch.as_strided(base[s0.storage_ptr], (self.num_blocks, n, s0.nbytes),
                                (s0.block_stride, step, 1), s0.offset)

    @property
    def pages(self) -> list["torch.Tensor"]:
        """Per segment, a ``[num_blocks, page bytes]`` uint8 view (rows strided): the
        caches tierkv's gather/scatter kernels take, in tierkv block order."""
        return list(self._views)

    @property
    def fused(self) -> bool:
        return self._fused is not None

    def gather(self, block_ids: "torch.Tensor", out: "torch.Tensor") -> None:
        """``out[i] = bytes of engine block block_ids[i]``; ``out`` is ``[n, block_nbytes]`` uint8."""
        import torch

        if self._fused is not None:
            torch.index_select(self._fused, 0, block_ids, out=out.view(len(block_ids), *self._fused.shape[1:]))
            return
        for view, off in zip(self._views, self._offsets):
            out[:, off:off + view.shape[1]].copy_(torch.index_select(view, 0, block_ids))

    def scatter(self, block_ids: "torch.Tensor", rows: "torch.Tensor") -> None:
        """Write ``rows[i]`` (``[n, block_nbytes]`` uint8) into engine block ``block_ids[i]``."""
        if self._fused is not None:
            self._fused.index_copy_(0, block_ids, rows.view(len(block_ids), *self._fused.shape[1:]))
            return
        for view, off in zip(self._views, self._offsets):
            view.index_copy_(0, block_ids, rows[:, off:off + view.shape[1]])


class LayoutRows:
    """vLLM's KV tensors as whole tierkv blocks: :class:`~tierkv.executor.DeviceRows`
    (synchronous, for the shutdown store) and :class:`~tierkv.copier.CopyRows` (work the
    copier submits on its streams: tierkv's kernels on CUDA, one launch per job across
    every layer; row memcpys on the CPU backend)."""

    def __init__(self, layout: KVLayout) -> None:
        import torch

        self.layout = layout
        self.block_nbytes = layout.block_nbytes
        self.cuda = torch.device(layout.device).type == "cuda"

    def _index(self, block_ids: Sequence[int]) -> "torch.Tensor":
        import torch

        return torch.tensor(list(block_ids), dtype=torch.long, device=self.layout.device)

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        rows = self.staging(len(block_ids))
        self.gather(block_ids, rows, range(len(block_ids)))
        if self.cuda:
            import torch

            torch.cuda.current_stream(self.layout.device).synchronize()  # a synchronous store (shutdown)
        return rows

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        self.scatter(rows, range(len(block_ids)), block_ids)
        return None

    def gather(self, block_ids: Sequence[int], dst: np.ndarray, dst_rows: Sequence[int]) -> None:
        import torch

        host = torch.from_numpy(dst)
        if self.cuda and host.is_pinned():
            from tierkv.kernels import gather_blocks

            gather_blocks(self.layout.pages, list(block_ids), host, out_rows=list(dst_rows), check_indices=False)
            return
        n = len(block_ids)  # the CPU backend, or pageable host memory (HostSlab warned: ~10x slower)
        rows = torch.empty((n, self.block_nbytes), dtype=torch.uint8, device=self.layout.device)
        self.layout.gather(self._index(block_ids), rows)
        copy_rows(rows.cpu().numpy(), range(n), dst, dst_rows)

    def scatter(self, src: np.ndarray, src_rows: Sequence[int], block_ids: Sequence[int]) -> None:
        import torch

        host = torch.from_numpy(src)
        if self.cuda and host.is_pinned():
            from tierkv.kernels import scatter_blocks

            scatter_blocks(host, self.layout.pages, list(block_ids), staging_rows=list(src_rows),
                           check_indices=False)
            return
        n = len(block_ids)
        rows = np.empty((n, self.block_nbytes), dtype=np.uint8)
        copy_rows(src, src_rows, rows, range(n))
        self.layout.scatter(self._index(block_ids), torch.from_numpy(rows).to(self.layout.device))

    def staging(self, n: int) -> np.ndarray:
        return host_rows(n, self.block_nbytes, pinned=self.cuda)
