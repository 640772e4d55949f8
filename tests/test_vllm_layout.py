"""KVLayout: whole-block gather/scatter over engine KV tensors (torch only, no engine)."""

from __future__ import annotations

import pytest
import torch

from tierkv.connectors.kv_layout import KVLayout

NB = 6


def _one_buffer_layers(layers: int = 3) -> dict[str, torch.Tensor]:
    """vLLM 0.32 CPU backend: one buffer, per-layer views [num_blocks, heads, block, 2*head]."""
    buf = torch.randn(layers, NB, 2, 4, 8)
    return {f"layer{i}": buf[i] for i in range(layers)}


def _split_kv_layers(layers: int = 2) -> dict[str, torch.Tensor]:
    """A GPU-style layout: per layer [2, num_blocks, block, heads, head] (K and V apart)."""
    return {f"layer{i}": torch.randn(2, NB, 4, 2, 8) for i in range(layers)}


@pytest.mark.parametrize("make, fused", [(_one_buffer_layers, True), (_split_kv_layers, False)])
def test_gather_scatter_round_trip(make, fused) -> None:  # type: ignore[no-untyped-def]
    src = make()
    layout = KVLayout(src, NB)
    assert layout.fused is fused
    assert layout.block_nbytes == sum(t.numel() * 4 for t in src.values()) // NB
    ids = torch.tensor([4, 1, 3])
    rows = torch.empty((3, layout.block_nbytes), dtype=torch.uint8)
    layout.gather(ids, rows)

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    KVLayout(dst, NB).scatter(torch.tensor([0, 2, 5]), rows)
    bdim = 1 if not fused else 0
    for name in src:
        for s, d in ((4, 0), (1, 2), (3, 5)):
            assert torch.equal(src[name].select(bdim, s), dst[name].select(bdim, d))
        untouched = [b for b in range(NB) if b not in (0, 2, 5)]
        assert not dst[name].index_select(bdim, torch.tensor(untouched)).any()


def test_layers_sharing_storage_count_once() -> None:
    buf = torch.randn(NB, 2, 4, 8)
    layout = KVLayout({"a": buf, "b": buf.view(NB, 2, 4, 8)}, NB)
    assert len(layout.segments) == 1
    assert layout.block_nbytes == 2 * 4 * 8 * 4


def test_rejects_tensors_without_a_block_dimension() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVLayout({"x": torch.zeros(3, 4)}, NB)
