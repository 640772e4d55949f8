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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    import torch

__all__ = ["KVLayout", "Segment"]


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
