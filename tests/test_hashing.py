from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from kvstrata import BlockHasher, ConfigError

ALGOS = ["sha256", "sha256_cbor", "xxh3_128"]


@pytest.mark.parametrize("algo", ALGOS)
def test_one_digest_per_full_block_and_chained(algo):
    h = BlockHasher(4, algo)
    toks = list(range(11))
    out = h.hash_blocks(toks)
    assert len(out) == 2 and len(set(out)) == 2
    assert all(len(d) == h.digest_size for d in out)
    # a prefix's hashes are a prefix of the longer prompt's hashes
    assert h.hash_blocks(toks[:8]) == out
    # changing a token in block 0 changes every later hash (the chain)
    toks2 = [99] + toks[1:]
    out2 = h.hash_blocks(toks2)
    assert out2[0] != out[0] and out2[1] != out[1]
    # the same tokens at a different position hash differently
    assert h.hash_blocks(toks[4:8] + toks[4:8])[1] != out[1] or h.hash_blocks(toks[4:8])[0] != out[1]


def test_sha256_chain_matches_the_documented_formula():
    h = BlockHasher(2, "sha256", namespace=b"model-x")
    root = hashlib.sha256(b"kvstrata.block-hash.v1\x00sha256\x00model-x").digest()
    h0 = hashlib.sha256(root + struct.pack("<2I", 5, 6)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<2I", 7, 8)).digest()
    assert h.hash_blocks([5, 6, 7, 8, 9]) == [h0, h1]


def test_namespace_changes_every_hash():
    a = BlockHasher(4, namespace=b"llama-8b|fp16|bs4").hash_blocks(list(range(16)))
    b = BlockHasher(4, namespace=b"llama-8b|fp8|bs4").hash_blocks(list(range(16)))
    assert not set(a) & set(b)


def test_cache_salt_enters_first_block_and_chain_carries_it():
    h = BlockHasher(4)
    toks = list(range(12))
    plain = h.hash_blocks(toks)
    a = h.hash_blocks(toks, cache_salt="tenant-a")
    b = h.hash_blocks(toks, cache_salt="tenant-b")
    assert not set(a) & set(b) and not set(a) & set(plain)
    # continuing a salted chain block by block gives the same digests
    chain: list[bytes] = []
    h.extend(chain, toks[:5], cache_salt="tenant-a")
    h.extend(chain, toks, cache_salt="tenant-a")
    assert chain == a


def test_lora_enters_every_block():
    h = BlockHasher(4)
    toks = list(range(12))
    base = h.hash_blocks(toks, lora_id="adapter-1")
    assert not set(base) & set(h.hash_blocks(toks, lora_id="adapter-2"))
    assert not set(base) & set(h.hash_blocks(toks))
    # lora applies even when continuing from the same parent
    chain = h.hash_blocks(toks[:4], lora_id="adapter-1")
    assert h.extend(list(chain), toks, lora_id="adapter-1") == base


def test_mm_hash_enters_only_overlapping_blocks():
    h = BlockHasher(4)
    toks = [0] * 16  # placeholder tokens look identical
    img_a = h.hash_blocks(toks, mm_hashes=[("img-a", 5, 6)])  # tokens 5..10 -> blocks 1, 2
    img_b = h.hash_blocks(toks, mm_hashes=[("img-b", 5, 6)])
    plain = h.hash_blocks(toks)
    assert img_a[0] == img_b[0] == plain[0]
    assert img_a[1] != img_b[1] and img_a[2] != img_b[2] and img_a[3] != img_b[3]


def test_deterministic_across_processes():
    code = ("from kvstrata import BlockHasher;"
            "print(BlockHasher(16, 'ALGO', namespace='ns').hash_blocks(list(range(100)), cache_salt='s')[-1].hex())")
    for algo in ALGOS:
        outs = {subprocess.run([sys.executable, "-c", code.replace("ALGO", algo)], capture_output=True, text=True,
                               env={"PYTHONHASHSEED": seed}, check=True).stdout for seed in ("1", "2")}
        assert len(outs) == 1
        assert next(iter(outs)).strip() == BlockHasher(16, algo, namespace="ns").hash_blocks(
            list(range(100)), cache_salt="s")[-1].hex()


def test_bad_input():
    with pytest.raises(ConfigError, match="hash: unknown algorithm 'md5'"):
        BlockHasher(16, "md5")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
    with pytest.raises(ValueError, match="token_ids"):
        BlockHasher(2).hash_blocks([1, -3])
    with pytest.raises(ValueError, match="cache_salt"):
        BlockHasher(2).hash_blocks([1, 2], cache_salt=1.5)  # type: ignore[arg-type]


def test_xxh3_warns(caplog):
    import kvstrata.identity.hashing as hashing

    hashing._warned_xxh3 = False
    with caplog.at_level("WARNING"):
        BlockHasher(16, "xxh3_128")
    assert "not collision-resistant" in caplog.text
