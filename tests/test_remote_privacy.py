"""What an account that can only read the shared server learns from kvstrata's values,
against a real Valkey server (tests/valkey_server.py) and a real (tiny, random-weight,
fixed-seed) Llama computed by transformers.

The attack: layer 0's K row of a token is ``rope(k_proj(norm(embed[token])), position)``,
and the checkpoint of an open-weight model is public. An ACL user limited to ``+@read``
reads every value, takes the payload where kvstrata's public format puts it, and matches
each K row against that expression for every vocabulary id at every position. On a
signed-only value (the format before values were encrypted) it recovers the prompt's
tokens with their positions; on a sealed value it sees ciphertext and recovers none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvstrata.config.remote import RemoteConfig
from kvstrata.tiers.remote import RemoteTier, key_prefix
from kvstrata.tiers.remote.value import Auth

sys.path.insert(0, str(Path(__file__).parent))
from valkey_server import ValkeyServer  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BLOCK, BLOCKS, VOCAB = 16, 6, 512
SECRET = b"Zp4-Rw8_Kq2mXv7Ld3Nb9Tc6Hy1Gf5Js0Ua"


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def layer0_blocks(model, tokens: list[int]) -> np.ndarray:
    """Layer 0's K and V of each block of ``tokens``, as the bytes a connector stores
    (fp32 ``[K heads, block, head dim]`` then V), one row per block."""
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    layer = cache.layers[0] if hasattr(cache, "layers") else None
    k, v = (layer.keys, layer.values) if layer is not None else cache[0]
    rows = [torch.cat([k[0, :, b * BLOCK:(b + 1) * BLOCK].reshape(-1), v[0, :, b * BLOCK:(b + 1) * BLOCK].reshape(-1)])
            for b in range(len(tokens) // BLOCK)]
    return torch.stack(rows).float().numpy().view(np.uint8)


def candidates(model, positions: int) -> torch.Tensor:
    """``rope(k_proj(norm(embed[v])), p)`` for every id v and position p: ``[p, V, heads * dim]``,
    from the public checkpoint alone."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn, norm = model.model.layers[0].self_attn, model.model.layers[0].input_layernorm
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        k = attn.k_proj(norm(model.model.embed_tokens.weight)).view(1, VOCAB, heads, dim).transpose(1, 2)
        out = []
        for p in range(positions):
            pos = torch.full((1, VOCAB), p)
            cos, sin = model.model.rotary_emb(k, pos)
            rotated, _ = apply_rotary_pos_emb(k, k, cos, sin)
            out.append(rotated[0].transpose(0, 1).reshape(VOCAB, heads * dim))
    return torch.stack(out)


def recover(values: list[bytes], cands: torch.Tensor, nbytes: int, heads: int, dim: int) -> dict[int, int]:
    """Position -> token id, for every K row that matches a candidate almost exactly. The
    payload is where kvstrata's formats put it (at the end, or before a 16-byte tag); the
    block's position is found by trying each."""
    found: dict[int, int] = {}
    for value in values:
        best: dict[int, int] = {}
        for tail in (0, 16):
            payload = value[len(value) - tail - nbytes:len(value) - tail]
            floats = np.frombuffer(payload, dtype=np.float32).copy()
            kk = torch.from_numpy(floats[:heads * BLOCK * dim]).view(heads, BLOCK, dim).transpose(0, 1).reshape(BLOCK, -1)
            for b in range(BLOCKS):
                c = cands[b * BLOCK:(b + 1) * BLOCK]                           # [16, V, heads * dim]
                dist = (c - kk[:, None, :]).norm(dim=-1) / c.norm(dim=-1).clamp_min(1e-6)
                d, ids = torch.nan_to_num(dist, nan=np.inf).min(dim=-1)
                got = {b * BLOCK + i: int(ids[i]) for i in range(BLOCK) if float(d[i]) < 1e-3}
                if len(got) > len(best):
                    best = got
        found.update(best)
    return found


@pytest.fixture(scope="module")
def server():
    with ValkeyServer() as s:
        s.client().execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw", "~*", "+@read")
        yield s


def attack(server: ValkeyServer, auth: Auth) -> tuple[int, int]:
    """Store a 96-token prompt's layer 0 through a RemoteTier sealing with ``auth``, then run
    the attack as the ``+@read`` user: (tokens recovered at their position, tokens)."""
    import redis

    model = tiny_llama()
    tokens = [int(t) for t in np.random.default_rng(7).integers(2, VOCAB, BLOCK * BLOCKS)]
    rows = layer0_blocks(model, tokens)
    prefix = key_prefix(f"tiny-llama-privacy-{getattr(auth, 'encrypt', False)}")
    t = RemoteTier(RemoteConfig(url=server.url, compression="none", timeout=2.0), prefix, rows.shape[1], auth=auth)
    keys = [np.random.default_rng(b).bytes(32) for b in range(BLOCKS)]
    for k, r in zip(keys, rows):
        assert t.put(k, r)
    assert t.flush(10)
    t.close()
    reader = redis.Redis(host="127.0.0.1", port=server.port, username="reader", password="reader-pw")
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.set(b"x", b"y")  # read only
    values = [reader.get(k) for k in reader.scan_iter(match=prefix + b"*")]
    assert len(values) == BLOCKS
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    found = recover(values, candidates(model, BLOCK * BLOCKS), rows.shape[1], heads, dim)
    return sum(found.get(p) == tok for p, tok in enumerate(tokens)), len(tokens)


@pytest.mark.slow
def test_a_read_only_account_recovers_no_token_of_a_stored_prompt(server) -> None:
    recovered, total = attack(server, Auth([SECRET]))
    assert recovered == 0, f"{recovered}/{total} tokens recovered from the server's values"


@pytest.mark.slow
def test_the_same_attack_recovers_the_prompt_from_signed_only_values(server) -> None:
    """The attack works: on values that are only signed (``remote.encrypt: false``, and
    every value before encryption) it recovers nearly the whole prompt with positions."""
    recovered, total = attack(server, Auth([SECRET], encrypt=False))
    assert recovered >= 0.9 * total, f"only {recovered}/{total}"
