"""The CUDA launchers' argument lists against the kernels' C++ signatures,
without a GPU: launch() and arg() are replaced by recorders, so a launcher
that passes the wrong number, order or width of arguments fails here."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvstrata.kernels import cuda_attention, cuda_block_ops, cuda_cache_ops
from kvstrata.kernels.sources import read_source
from kvstrata.kernels.testing import make_paged_case

SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32, "unsigned long long": np.uint64}


class Pointer:
    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t


def _params(spec) -> list[str]:
    """Parameter types of the kernel named by spec (template params stripped)."""
    name = spec.name.split("<")[0].split("::")[-1]
    src = read_source(spec.source)
    m = re.search(rf"\b{name}\s*\(([^)]*)\)", src)
    assert m, name
    params = [re.sub(r"//.*", "", p).strip() for p in m.group(1).split("\n")]
    flat = " ".join(params).split(",")
    return [re.sub(r"\s+\w+$", "", p.replace("__restrict__", "").replace("const", "")).strip() for p in flat if p.strip()]


@pytest.fixture
def launches(monkeypatch):
    calls = []
    for mod in (cuda_attention, cuda_cache_ops, cuda_block_ops):
        monkeypatch.setattr(mod, "arg", Pointer)
        monkeypatch.setattr(mod, "launch", lambda spec, device, grid, block, args, smem=0: calls.append((spec, grid, block, args, smem)))
    monkeypatch.setattr(cuda_block_ops, "_table", lambda device, rows: torch.tensor(rows, dtype=torch.int64))
    monkeypatch.setattr(cuda_attention, "max_shared_memory", lambda device: OPT_IN_SMEM)
    return calls


OPT_IN_SMEM = 227 * 1024  # sm_90's opt-in limit (what the device query answers on an H100/H200)


def _check(calls) -> None:
    assert calls
    for spec, grid, block, args, smem in calls:
        types = _params(spec)
        assert len(types) == len(args), f"{spec.name}: {len(args)} args for {len(types)} params"
        for ctype, a in zip(types, args):
            if ctype.endswith("*"):
                assert isinstance(a, Pointer), f"{spec.name}: {ctype} got {a!r}"
            else:
                assert type(a) is SCALARS[ctype], f"{spec.name}: {ctype} got {type(a).__name__}"
        assert len(grid) == 3 and all(g >= 1 for g in grid) and 1 <= block <= 1024
        assert smem <= OPT_IN_SMEM


@pytest.mark.parametrize("use_v1", [True, False])
def test_attention_launch_arguments(launches, use_v1: bool) -> None:
    c = make_paged_case([600, 3], 8, 2, 128, 16, torch.bfloat16, torch.float8_e4m3fn)
    out = torch.empty_like(c.query)
    cuda_attention.paged_attention_cuda(out, c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens,
                                        c.scale, c.k_scale, c.v_scale, 600, use_v1)
    _check(launches)
    assert [s.name.split("<")[0] for s, *_ in launches] == (
        ["tkv::paged_attention_v1_kernel"] if use_v1 else ["tkv::paged_attention_v2_kernel", "tkv::paged_attention_v2_reduce_kernel"]
    )
    if not use_v1:
        assert launches[0][1] == (8, 2, 2)  # heads, seqs, partitions of 512 tokens


def test_cache_and_block_launch_arguments(launches) -> None:
    c = make_paged_case([20], 4, 2, 64, 8, torch.float16, torch.float16)
    key = torch.zeros(5, 2, 64, dtype=torch.float16)
    cuda_cache_ops.reshape_and_cache_cuda(key, key, c.key_cache, c.value_cache, torch.arange(5), 1.0, 1.0)
    pools = [c.key_cache, c.value_cache]
    cuda_block_ops.copy_blocks_cuda(pools, torch.tensor([[0, 1]]))
    staging = torch.empty(2, sum(p[0].numel() * 2 for p in pools), dtype=torch.uint8)
    cuda_block_ops.gather_scatter_cuda(pools, torch.tensor([0, 1]), staging, gather=True)
    cuda_block_ops.gather_scatter_cuda(pools, torch.tensor([0, 1]), staging, gather=False)
    _check(launches)
    assert launches[1][1][0] == 1 * len(pools)  # one job per (pair, layer)


def test_choose_v1_policy() -> None:
    assert cuda_attention.choose_v1(64, 32, 4096)  # the benchmark shape: grid already full
    assert cuda_attention.choose_v1(1, 8, 512)  # one partition
    assert not cuda_attention.choose_v1(1, 8, 4096)  # few blocks, long context: split-K
    assert not cuda_attention.choose_v1(64, 32, 9000)


def _attention(c, max_seq_len: int, use_v1: bool) -> None:
    out = torch.empty_like(c.query)
    cuda_attention.paged_attention_cuda(out, c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens,
                                        c.scale, c.k_scale, c.v_scale, max_seq_len, use_v1)


def test_v1_past_the_shared_memory_limit_is_refused_before_launch(launches) -> None:
    """Forced v1 sizes its logits from max_seq_len: past the opt-in limit (~56K tokens at
    head size 128 on sm_90) the launch used to fail inside CUDA."""
    c = make_paged_case([20], 4, 2, 128, 16, torch.float16, torch.float16)
    fits = (OPT_IN_SMEM - cuda_attention.smem_bytes(128, 0)) // 4 // 16 * 16
    _attention(c, fits, True)
    assert launches[-1][4] == cuda_attention.smem_bytes(128, fits) <= OPT_IN_SMEM
    with pytest.raises(ValueError, match=r"^max_seq_len: v1 over \d+ tokens needs \d+ bytes"):
        _attention(c, fits + 16, True)
    assert len(launches) == 1


def test_v2_past_the_grid_limit_is_refused_before_launch(launches) -> None:
    c = make_paged_case([20], 4, 2, 64, 16, torch.float16, torch.float16)
    _attention(c, 65535 * 512, False)
    with pytest.raises(ValueError, match="^max_seq_len: .* 65536 partitions"):
        _attention(c, 65535 * 512 + 1, False)
    assert len(launches) == 2  # the kernel and its reduce, once


def test_bf16_kernels_need_sm80(monkeypatch) -> None:
    """Checked before the kernel is compiled or launched (cvt.rn.bf16.f32 needs sm_80)."""
    from kvstrata.kernels import runtime, specs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(runtime, "kernel", lambda spec, index: pytest.fail("compiled on sm_75"))
    with pytest.raises(ValueError, match="^dtype: bfloat16 kernels need compute capability 8.0 or newer"):
        runtime.launch(specs.attention_v1("bfloat16", "bfloat16", 128, 16), torch.device("cuda", 0),
                       (1, 1, 1), 128, ())
