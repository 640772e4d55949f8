"""copy_blocks / gather_blocks / scatter_blocks (reference path) against plain indexing."""

from __future__ import annotations

import torch

from tierkv.kernels import copy_blocks, gather_blocks, scatter_blocks


def _layers(nb: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(nb, 2, 4, 8, generator=g)  # K and V halves: rows strided
    return [
        torch.randn(nb, 2, 3, 8, generator=g).to(torch.bfloat16),
        fused[:, 0],
        fused[:, 1],
        torch.randint(0, 256, (nb, 48), generator=g, dtype=torch.uint8),
        torch.randn(nb, 16, generator=g).to(torch.float8_e4m3fn),
    ]


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def test_gather_concatenates_layer_pages_in_order() -> None:
    layers = _layers()
    ids = torch.tensor([4, 0, 4, 8])
    total = sum(c[0].numel() * c.element_size() for c in layers)
    out = torch.empty(len(ids), total, dtype=torch.uint8)
    assert gather_blocks(layers, ids, out) is out
    for i, b in enumerate(ids.tolist()):
        expected = torch.cat([_row_bytes(c[b]) for c in layers])
        assert torch.equal(out[i], expected)


def test_scatter_inverts_gather_and_touches_nothing_else() -> None:
    src, dst = _layers(), [torch.zeros_like(c) for c in _layers()]
    ids = [7, 1, 3]
    total = sum(c[0].numel() * c.element_size() for c in src)
    staging = torch.empty(3, total, dtype=torch.uint8)
    gather_blocks(src, ids, staging)
    scatter_blocks(staging, dst, ids)
    for s, d in zip(src, dst):
        sb, db = s.view(torch.uint8) if s.dim() > 1 else s, d.view(torch.uint8)
        assert torch.equal(sb[ids], db[ids])
        others = [b for b in range(s.shape[0]) if b not in ids]
        assert not db[others].any()


def test_uint8_pool_is_the_one_layer_case() -> None:
    pool = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
    ids = torch.tensor([15, 2])
    out = gather_blocks([pool], ids, torch.empty(2, 4096, dtype=torch.uint8))
    assert torch.equal(out, pool[ids])
    scatter_blocks(out.flip(0), [pool], ids)
    assert torch.equal(pool[15], out[1]) and torch.equal(pool[2], out[0])


def test_copy_blocks_all_layers() -> None:
    layers = _layers()
    before = [c.clone() for c in layers]
    copy_blocks(layers, [(1, 5), (1, 6), (2, 0)])
    for b, a in zip(before, layers):
        bb, ab = b.view(torch.uint8), a.view(torch.uint8)
        assert torch.equal(ab[5], bb[1]) and torch.equal(ab[6], bb[1]) and torch.equal(ab[0], bb[2])
        assert torch.equal(ab[[1, 2, 3, 4, 7, 8]], bb[[1, 2, 3, 4, 7, 8]])


def test_empty_lists_are_no_ops() -> None:
    layers = _layers()
    copy_blocks(layers, [])
    total = sum(c[0].numel() * c.element_size() for c in layers)
    gather_blocks(layers, [], torch.empty(0, total, dtype=torch.uint8))
    scatter_blocks(torch.empty(0, total, dtype=torch.uint8), layers, torch.empty(0, dtype=torch.int64))
