"""KVLayout: whole-block gather/scatter over engine KV tensors (torch only, no engine).

The tensors here are built the way vLLM builds its views (a logical ``[B, H, N, C]``
per layer over one buffer, physically permuted); ``tests/test_vllm_gpu_layouts.py``
builds them with vLLM's own functions for every GPU attention backend."""

from __future__ import annotations

import pytest
import torch

from kvstrata.connectors.kit.kv_layout import KVLayout, union_runs

NB, H, N, C, L = 6, 2, 4, 8, 3


def _views(order: tuple[int, ...], nb: int = NB, h: int = H, n: int = N, c: int = C, layers: int = L,
           ratio: int = 1) -> dict[str, torch.Tensor]:
    """Per-layer logical [B*ratio, H, N/ratio, C] views of one buffer whose physical
    axis order is ``order`` over logical (L, B, H, N, C), as vLLM's KVCacheLayout."""
    logical = (layers, nb, h, n, c)
    phys = torch.arange(layers * nb * h * n * c, dtype=torch.float32).view(*(logical[i] for i in order))
    view = phys.permute(*(order.index(i) for i in range(5)))  # back to logical axis order
    if ratio > 1:  # kernel blocks: each block's N tokens split into `ratio` kernel blocks
        view = view.unflatten(3, (ratio, n // ratio)).movedim(3, 2).flatten(1, 2)
    return {f"layer{i}": view[i] for i in range(layers)}


LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def _block(views: dict[str, torch.Tensor], b: int, ratio: int = 1) -> list[torch.Tensor]:
    return [v[b * ratio:(b + 1) * ratio].clone() for v in views.values()]


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("ratio", [1, 2])
def test_every_layout_round_trips_and_touches_no_other_block(name: str, ratio: int) -> None:
    src = _views(LAYOUTS[name], ratio=ratio)
    layout = KVLayout(src, NB)
    assert layout.block_nbytes == L * H * N * C * 4
    ids = torch.tensor([4, 1, 3])
    rows = torch.empty((3, layout.block_nbytes), dtype=torch.uint8)
    layout.gather(ids, rows)

    dst = _views(LAYOUTS[name], ratio=ratio)
    for v in dst.values():
        v.fill_(-1.0)
    KVLayout(dst, NB).scatter(torch.tensor([0, 2, 5]), rows)
    for s, d in ((4, 0), (1, 2), (3, 5)):
        for a, b in zip(_block(src, s, ratio), _block(dst, d, ratio)):
            assert torch.equal(a, b)
    for b in (1, 3, 4):  # blocks not loaded: not one byte changed
        assert all(bool((t == -1.0).all()) for t in _block(dst, b, ratio))


def test_runs_follow_the_physical_layout() -> None:
    """One run per layer when a layer's block is one page, one per layer and head for
    LHBNC, and a single run per block for the block-outermost layouts."""
    assert len(KVLayout(_views(LAYOUTS["LBNHC"]), NB).segments) == L
    assert KVLayout(_views(LAYOUTS["LBNHC"]), NB).fused
    assert len(KVLayout(_views(LAYOUTS["LHBNC"]), NB).segments) == L * H
    for name in ("BLHNC", "BLNHC", "BHLNC"):
        assert len(KVLayout(_views(LAYOUTS[name]), NB).segments) == 1, name


def test_block_count_equal_to_another_dimension_is_not_taken_for_the_block_axis() -> None:
    """64 blocks of 64 tokens (LBNHC): the block axis is dimension 0, whatever matches."""
    nb = n = 16
    src = _views(LAYOUTS["LBNHC"], nb=nb, n=n, layers=2)
    dst = _views(LAYOUTS["LBNHC"], nb=nb, n=n, layers=2)
    for v in dst.values():
        v.zero_()
    rows = torch.empty((1, KVLayout(src, nb).block_nbytes), dtype=torch.uint8)
    KVLayout(src, nb).gather(torch.tensor([7]), rows)
    KVLayout(dst, nb).scatter(torch.tensor([2]), rows)
    for name in src:
        assert torch.equal(src[name][7], dst[name][2])
        others = [b for b in range(nb) if b != 2]
        assert not dst[name][others].any()


def test_layers_sharing_storage_count_once() -> None:
    buf = torch.randn(NB, 2, 4, 8)
    layout = KVLayout({"a": buf, "b": buf.view(NB, 2, 4, 8)}, NB)
    assert len(layout.segments) == 1
    assert layout.block_nbytes == 2 * 4 * 8 * 4


def test_overlaid_groups_are_united() -> None:
    """Two groups over the same bytes (vLLM's hybrid allocator): a block is their union."""
    buf = torch.zeros(NB * 64, dtype=torch.uint8)
    group0 = buf.view(NB, 64)                # one page of 64 bytes per block
    group1 = buf.view(NB, 2, 32)             # the same bytes, seen as two pages
    layout = KVLayout({"full": group0, "swa": group1}, NB)
    assert layout.block_nbytes == 64 and len(layout.segments) == 1


def test_union_runs() -> None:
    assert union_runs([(10, 5), (0, 4), (4, 2), (12, 10)]) == [(0, 6), (10, 12)]


def test_rejects_a_block_axis_that_is_not_one() -> None:
    """[2, num_blocks, ...] (K/V outermost) read with dimension 0 as blocks would move
    the wrong bytes: refused, as is a tensor whose dimension 0 is not a multiple."""
    with pytest.raises(ValueError, match="dimension 0"):
        KVLayout({"x": torch.zeros(2, NB, 4, 8)}, NB)
    overlapping = torch.zeros(NB * 8 + 8).as_strided((NB, 16), (8, 1))  # blocks overlap by half
    with pytest.raises(ValueError, match="overlap"):
        KVLayout({"x": overlapping}, NB)
    buf = torch.zeros(NB * 8 + 4)
    shifted = {"a": buf[:NB * 8].view(NB, 8), "b": buf[4:].view(NB, 8)}  # b's block i is half of a's i+1
    with pytest.raises(ValueError, match="overlap"):
        KVLayout(shifted, NB)
    with pytest.raises(ValueError, match="num_blocks"):
        KVLayout({"x": torch.zeros(3, 4)}, NB)
