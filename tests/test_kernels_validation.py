"""Bad input: a ValueError naming the argument, before anything runs."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import copy_blocks, gather_blocks, kv_cache_shapes, paged_attention, reshape_and_cache, scatter_blocks
from kvstrata.kernels.testing import make_paged_case


@pytest.fixture
def case():
    return make_paged_case([5, 20], 4, 2, 64, 8, torch.float16, torch.float16)


def _attn(c, **over):
    args = dict(query=c.query, key_cache=c.key_cache, value_cache=c.value_cache, block_tables=c.block_tables,
                seq_lens=c.seq_lens, scale=c.scale)
    args.update(over)
    return paged_attention(**args)


@pytest.mark.parametrize(
    "name,make",
    [
        ("key_cache", lambda c: dict(query=c.query.float())),  # dtype mismatch with the cache
        ("query", lambda c: dict(query=c.query.transpose(0, 1).contiguous().transpose(0, 1))),
        ("head_size", lambda c: dict(query=c.query[:, :, :48].contiguous())),
        ("key_cache", lambda c: dict(key_cache=c.key_cache.to(torch.bfloat16))),
        ("key_cache", lambda c: dict(key_cache=c.key_cache.transpose(0, 1).contiguous().transpose(0, 1))),
        ("value_cache", lambda c: dict(value_cache=c.value_cache.to(torch.float8_e5m2))),
        ("value_cache", lambda c: dict(value_cache=c.value_cache[:, :1])),
        ("block_size", lambda c: dict(key_cache=torch.zeros(4, 2, 8, 12, 8, dtype=torch.float16))),
        ("block_tables", lambda c: dict(block_tables=c.block_tables.long())),
        ("block_tables", lambda c: dict(block_tables=torch.full_like(c.block_tables, 10_000))),
        ("block_tables", lambda c: dict(block_tables=torch.full_like(c.block_tables, -1))),
        ("seq_lens", lambda c: dict(seq_lens=torch.tensor([5, -1], dtype=torch.int32))),
        ("max_seq_len", lambda c: dict(max_seq_len=19)),  # below seq_lens' 20: v1 would index past its logits
        ("max_seq_len", lambda c: dict(max_seq_len=-1)),
        ("max_seq_len", lambda c: dict(max_seq_len=20.0)),
        ("seq_lens", lambda c: dict(seq_lens=torch.tensor([5, 10_000], dtype=torch.int32))),
        ("seq_lens", lambda c: dict(seq_lens=c.seq_lens[:1])),
        ("query", lambda c: dict(query=c.query[:, :3].contiguous())),  # 3 heads over 2 KV heads
        ("scale", lambda c: dict(scale=float("nan"))),
        ("out", lambda c: dict(out=torch.empty(2, 4, 64))),
        ("version", lambda c: dict(version="v3")),
    ],
)
def test_paged_attention_rejects(case, name: str, make) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        _attn(case, **make(case))


def test_an_explicit_max_seq_len_at_or_above_every_length_is_taken(case) -> None:
    torch.testing.assert_close(_attn(case, max_seq_len=20), _attn(case), atol=0, rtol=0)
    torch.testing.assert_close(_attn(case, max_seq_len=64), _attn(case), atol=0, rtol=0)


def test_unused_table_entries_are_not_checked(case) -> None:
    # make_paged_case fills unused entries with an out-of-range id on purpose
    assert int(case.block_tables.max()) >= case.key_cache.shape[0]
    _attn(case)


def _cache(dtype=torch.float16, nb=4):
    k, v = kv_cache_shapes(nb, 2, 64, 8, dtype)
    return torch.zeros(k, dtype=dtype), torch.zeros(v, dtype=dtype)


@pytest.mark.parametrize(
    "name,over",
    [
        ("value", dict(key=torch.zeros(3, 2, 64, dtype=torch.float32))),  # dtype mismatch
        ("value", dict(value=torch.zeros(3, 1, 64, dtype=torch.float16))),
        ("key", dict(key=torch.zeros(3, 2, 64, dtype=torch.int32))),
        ("value", dict(value=torch.zeros(3, 2, 128, dtype=torch.float16)[:, :, ::2])),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1, 32]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1, 1]))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32))),
        ("k_scale", dict(k_scale=0.0)),
        ("value_cache", dict(value_cache=_cache(torch.bfloat16)[1])),
    ],
)
def test_reshape_and_cache_rejects(name: str, over: dict) -> None:
    kc, vc = _cache()
    args = dict(key=torch.zeros(3, 2, 64, dtype=torch.float16), value=torch.zeros(3, 2, 64, dtype=torch.float16),
                key_cache=kc, value_cache=vc, slot_mapping=torch.tensor([0, -1, 31]))
    reshape_and_cache(**args)
    args.update(over)
    with pytest.raises(ValueError, match=f"^{name}"):
        reshape_and_cache(**args)


def test_block_ops_reject() -> None:
    pool = torch.zeros(8, 64, dtype=torch.uint8)
    out = torch.empty(2, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^block_ids"):
        gather_blocks([pool], [1, 8], out)
    with pytest.raises(ValueError, match="^block_ids"):
        gather_blocks([pool], torch.tensor([1, 2], dtype=torch.int32), out)
    with pytest.raises(ValueError, match="^out"):
        gather_blocks([pool], [1, 2], torch.empty(2, 65, dtype=torch.uint8))
    with pytest.raises(ValueError, match="^out"):
        gather_blocks([pool], [1, 2], torch.empty(2, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="^out"):
        gather_blocks([pool], [1, 2], torch.empty(64, 2, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match=r"^caches\[0\]"):
        gather_blocks([torch.zeros(64, 8).t()], [1, 2], out)
    with pytest.raises(ValueError, match="^caches"):
        gather_blocks(pool, [1, 2], out)
    with pytest.raises(ValueError, match="^block_ids"):
        scatter_blocks(out, [pool], [3, 3])
    with pytest.raises(ValueError, match="^block_mapping"):
        copy_blocks([pool], [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="^block_mapping"):
        copy_blocks([pool], [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="^block_mapping"):
        copy_blocks([pool], [(0, 9)])
    with pytest.raises(ValueError, match="^block_mapping"):
        copy_blocks([pool], [(0, 1, 2)])
