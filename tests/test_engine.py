"""kvstrata.engine against transformers, token for token. On CPU tensors the engine runs
the kernels' torch references; the same tests with CUDA tensors (marked ``gpu``, run by
benchmarks/gpu_check.sh) run the CUDA kernels, the copy stream and the pinned slab.
transformers' reference runs on the CPU in float32. The model is a real checkpoint
written by transformers (random weights); the tiers are real (the CPU slab, an
LMDB-backed SSD tier on disk)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engine_util import build_engine_model, engine_config, hf_greedy, random_prompt
from kvstrata.errors import ConfigError

transformers = pytest.importorskip("transformers")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the kernels)")])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def engine(model_dir: Path, tmp: Path, **kw):
    from kvstrata.engine import LLMEngine

    opts = {k: kw.pop(k) for k in ("dtype", "kv_cache_dtype", "k_scale", "v_scale") if k in kw}
    return LLMEngine(model_dir, engine_config(tmp, **kw), **opts)


def test_the_model_depends_on_early_context(hf) -> None:
    """Guard: the identity tests below would pass for a model that ignores all but the
    last few tokens, without proving attention reads the right blocks."""
    prompt = random_prompt(60, seed=1)
    changed = [prompt[0] + 1] + prompt[1:]
    assert hf_greedy(hf, prompt, 8) != hf_greedy(hf, changed, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_single_prompts_match_transformers(model_dir: Path, hf, tmp_path: Path, device: str) -> None:
    with engine(model_dir, tmp_path, device=device) as eng:
        for seed, length in ((2, 1), (3, 15), (4, 16), (5, 33), (6, 100)):
            prompt = random_prompt(length, seed)
            assert eng.generate([prompt], 24) == [[hf_greedy(hf, prompt, 24)]], (length, seed)


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_of_mixed_lengths_matches_transformers(model_dir: Path, hf, tmp_path: Path, device: str) -> None:
    prompts = [random_prompt(n, seed) for seed, n in enumerate((7, 64, 31, 1, 90, 16))]
    with engine(model_dir, tmp_path, device=device) as eng:
        outs = eng.generate(prompts, 20)
        stats = eng.stats()
    assert outs == [[hf_greedy(hf, p, 20)] for p in prompts]
    assert stats["prefill_steps"] == 1  # one batched prefill
    assert stats["decode_steps"] == 19  # one batched decode per further token


@pytest.mark.parametrize("device", DEVICES)
def test_multi_turn_chat_served_from_pool_cpu_and_ssd_matches_transformers(model_dir: Path, hf,
                                                                           tmp_path: Path, device: str) -> None:
    """Turn 2 right after turn 1: the pool. Turn 3 after other conversations filled the
    pool: the CPU tier. Turn 4 after a restart: the SSD tier. Every turn's tokens are
    transformers' for the whole conversation so far."""
    kw = {"gpu_blocks": 24, "cpu": "2MiB", "ssd": "16MiB", "device": device}
    chat = random_prompt(40, seed=10)
    served: list[dict[str, int]] = []

    def turn(eng, user_seed: int) -> None:
        nonlocal chat
        chat = chat + random_prompt(9, user_seed)
        out = eng.run([chat], 12)[0]
        assert out.samples == [hf_greedy(hf, chat, 12)]
        served.append(out.hit_tokens)
        chat = chat + out.samples[0]

    with engine(model_dir, tmp_path, **kw) as eng:
        turn(eng, 11)
        turn(eng, 12)
        eng.generate([random_prompt(150, s) for s in (20, 21, 22)], 4)  # other conversations evict it
        turn(eng, 13)
    with engine(model_dir, tmp_path, **kw) as eng:  # a restart: the pool and the CPU tier are empty
        turn(eng, 14)
        ssd_stats = eng.stats()["cache"]
    assert served[0] == {"gpu": 0, "cpu": 0, "ssd": 0}
    assert served[1]["gpu"] >= 48 and served[1]["cpu"] == served[1]["ssd"] == 0
    assert served[2]["cpu"] >= 48 and served[2]["gpu"] == 0
    assert served[3]["ssd"] >= 96 and served[3]["gpu"] == served[3]["cpu"] == 0
    assert ssd_stats["hits"]["ssd"]["tokens"] == served[3]["ssd"]


@pytest.mark.parametrize("device", DEVICES)
def test_n_samples_share_the_prompt_and_copy_on_write_as_the_seed_describes(model_dir: Path, hf,
                                                                           tmp_path: Path, device: str) -> None:
    """The seed's example: a 40-token prompt in 3 blocks of 16 (the last 8/16 full), n=4.
    After the fork the four samples share the 3 blocks (ref_cnt 4, one copy in the pool);
    the first decode step writes slot 9 of the shared last block: seq0, seq1 and seq2
    each copy it to a fresh block (ref_cnt 4 -> 3 -> 2 -> 1), seq3 writes it in place;
    the two full blocks stay shared."""
    prompt = random_prompt(40, seed=30)
    with engine(model_dir, tmp_path, gpu_blocks=32, device=device) as eng:
        rid = eng.add_request(prompt, 6, n=4)
        seqs = [rid] + [f"{rid}#{i}" for i in (1, 2, 3)]
        eng.step()  # prefill, fork
        pool = eng.cache.manager
        tables = [eng.cache.block_ids(s) for s in seqs]
        b7, b3, b12 = tables[0]
        assert tables == [[b7, b3, b12]] * 4
        assert [pool.blocks[b].ref_cnt for b in (b7, b3, b12)] == [4, 4, 4]
        assert pool.num_blocks - pool.num_free_blocks == 3  # one copy of the prompt, not four
        before = [c[b12].clone() for c in eng.kv.caches]

        eng.step()  # the first decode step
        tables = [eng.cache.block_ids(s) for s in seqs]
        assert eng.stats()["cow_copies"] == 3
        fresh = [t[2] for t in tables[:3]]
        assert len(set(fresh)) == 3 and b12 not in fresh
        assert [t[:2] for t in tables] == [[b7, b3]] * 4
        assert tables[3][2] == b12 and pool.blocks[b12].ref_cnt == 1
        assert [pool.blocks[b].ref_cnt for b in (b7, b3)] == [4, 4]
        assert pool.num_blocks - pool.num_free_blocks == 6
        for c, old in zip(eng.kv.caches, before):  # each copy holds the prompt's 8 tokens of b12
            for b in fresh:
                assert torch.equal(c[b][..., :8, :] if c.dim() == 5 else c[b][..., :8],
                                   old[..., :8, :] if c.dim() == 5 else old[..., :8])
        while eng.has_unfinished():
            done = eng.step()
        out = done[0]
    assert out.samples == [hf_greedy(hf, prompt, 6)] * 4


def test_cache_salt_separates_prefixes(model_dir: Path, tmp_path: Path) -> None:
    prompt = random_prompt(64, seed=40)
    with engine(model_dir, tmp_path) as eng:
        eng.generate([prompt], 2, cache_salt="alice")
        bob = eng.run([prompt], 2, cache_salt="bob")[0]
        alice = eng.run([prompt], 2, cache_salt="alice")[0]
    assert bob.hit_tokens["gpu"] == 0 and bob.samples == alice.samples
    assert alice.hit_tokens["gpu"] == 48


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache_quantises_and_costs_little_accuracy(model_dir: Path, hf, tmp_path: Path, device: str) -> None:
    """FP8 caches hold the K/V at a quarter of the bytes; the logits move, e5m2 (2 mantissa
    bits) more than e4m3 (3), and the blocks never meet the full-precision ones."""
    prompts = [random_prompt(n, seed) for seed, n in enumerate((50, 70, 90), start=50)]
    errors = {}
    (tmp_path / "full").mkdir()
    with engine(model_dir, tmp_path / "full", device=device) as eng:
        ref = eng.run(prompts, 8, return_logits=True)
        full_nbytes = eng.kv.block_nbytes()
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        with engine(model_dir, tmp_path / "full", kv_cache_dtype=kv, device=device) as eng:
            assert eng.kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            assert eng.kv.block_nbytes() * 4 == full_nbytes
            outs = eng.run(prompts, 8, return_logits=True)
            assert eng.stats()["hits"]["ssd"] == 0  # another namespace than the float32 blocks
        # the largest error of the first token's logits, relative to their spread
        errors[kv] = max(float((o.logits[0] - r.logits[0]).abs().max() / r.logits[0].std())
                         for o, r in zip(outs, ref))
        assert [o.samples[0][0] for o in outs] == [r.samples[0][0] for r in ref]
    assert 0 < errors["fp8_e4m3"] < errors["fp8_e5m2"] < 1.5, errors


def test_restart_with_other_scales_does_not_serve_old_fp8_blocks(model_dir: Path, tmp_path: Path) -> None:
    prompt = random_prompt(64, seed=60)
    with engine(model_dir, tmp_path, kv_cache_dtype="fp8", k_scale=0.5) as eng:
        eng.generate([prompt], 2)
    with engine(model_dir, tmp_path, kv_cache_dtype="fp8", k_scale=0.5) as eng:
        assert eng.run([prompt], 2)[0].hit_tokens["ssd"] == 48
    with engine(model_dir, tmp_path, kv_cache_dtype="fp8", k_scale=0.25) as eng:
        assert eng.run([prompt], 2)[0].hit_tokens["ssd"] == 0


# ------------------------------------------------------------------ bad input


def _write_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 256, "vocab_size": 512}
    base.update(fields)
    (path / "config.json").write_text(json.dumps(base))
    return path


@pytest.mark.parametrize("fields, message", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got '0'"),
    ({"vocab_size": 511.5}, "vocab_size must be a positive integer, got '511.5'"),
    ({"hidden_size": 250}, "hidden_size 250 is not a multiple of num_attention_heads 4"),
    ({"model_type": "gemma3_text"}, "model_type 'gemma3_text' is not a Llama-family model"),
    ({"hidden_size": 128}, "head size 32 is not supported by the paged-attention kernels"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
])
def test_a_checkpoint_the_engine_cannot_run_is_refused_before_loading_weights(tmp_path: Path, fields,
                                                                              message: str) -> None:
    from kvstrata.engine import LLMEngine

    ckpt = _write_config(tmp_path / "ckpt", **fields)  # no weights at all: nothing may be loaded
    with pytest.raises(ConfigError, match=message):
        LLMEngine(ckpt, engine_config(tmp_path))


def test_a_directory_without_a_config_is_named(tmp_path: Path) -> None:
    from kvstrata.engine import LLMEngine

    with pytest.raises(ConfigError, match=r"config.json"):
        LLMEngine(tmp_path, engine_config(tmp_path))


@pytest.mark.parametrize("kw, extra, message", [
    ({}, {"block_size": 64}, r"^block_size: 64 is not supported by the paged-attention kernels \(8, 16, 32\)"),
    ({"kv_cache_dtype": "fp16"}, {}, r"^kv_cache_dtype: fp16 cannot hold the model's float32 activations"),
    ({"kv_cache_dtype": "int4"}, {}, r"^kv_cache_dtype: 'int4' is not one of"),
    ({"kv_cache_dtype": "fp8", "k_scale": 0.0}, {}, r"^k_scale: expected a positive finite number"),
    ({"dtype": "float64"}, {}, r"^dtype: 'float64' is not one of"),
    ({}, {"model": {"layers": 3}}, r"^model.layers: 3 in the config, but the checkpoint has 2"),
    ({"kv_cache_dtype": "fp8_e5m2"}, {"model": {"kv_dtype": "fp8_e4m3"}}, r"^model.kv_dtype: fp8_e4m3 in the config"),
])
def test_engine_options_the_kernels_cannot_serve_are_refused(model_dir: Path, tmp_path: Path, kw, extra,
                                                             message: str) -> None:
    from kvstrata.engine import LLMEngine

    with pytest.raises(ConfigError, match=message):
        LLMEngine(model_dir, engine_config(tmp_path, **extra), **kw)
    assert not (tmp_path / "ssd").exists()  # refused before any tier was opened


def test_a_prompt_longer_than_the_pool_is_refused_before_any_work(model_dir: Path, tmp_path: Path) -> None:
    with engine(model_dir, tmp_path, gpu_blocks=8) as eng:
        ok = random_prompt(20, seed=70)
        with pytest.raises(ConfigError, match=r"^prompts\[1\]: 200 tokens \+ 4 new \(n=1\) need 13 blocks of 16 "
                                              r"tokens; the pool holds 8 \(gpu.num_blocks\)"):
            eng.generate([ok, random_prompt(200, seed=71)], 4)
        with pytest.raises(ConfigError, match=r"^prompts\[0\]: token 512 is not an id in \[0, 512\)"):
            eng.generate([[5, 512]], 4)
        with pytest.raises(ConfigError, match=r"^n: expected a positive integer"):
            eng.generate([ok], 4, n=0)
        stats = eng.stats()
        assert stats["prompt_tokens"] == 0 and stats["generated_tokens"] == 0  # nothing ran
        assert eng.generate([ok], 4)[0][0]  # and the engine still serves


# ------------------------------------------------------------------ kvstrata generate


def _cli(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from kvstrata.cli.commands import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_generate_prints_tokens_and_where_each_prefix_came_from(model_dir: Path, hf, tmp_path: Path) -> None:
    prompt = random_prompt(40, seed=80)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(prompt) + "\n\n" + json.dumps({"prompt": "the cat sat on the mat"}) + "\n")
    (tmp_path / "kvstrata.yaml").write_text(
        f"gpu: {{num_blocks: 32, device: cpu}}\ncpu: {{capacity: 1MiB}}\n"
        f"ssd: {{path: {tmp_path / 'ssd'}, capacity: 16MiB}}\n")
    argv = ("generate", "--model", str(model_dir), "--prompt-file", str(prompts), "--config",
            str(tmp_path / "kvstrata.yaml"), "--n", "4", "--max-new-tokens", "6")
    code, out, err = _cli(*argv)
    assert code == 0, err
    expected = " ".join(map(str, hf_greedy(hf, prompt, 6)))
    assert "prompt 0: 40 tokens; prefix: 0 GPU pool, 0 CPU, 0 SSD, 40 computed" in out
    assert out.count(f"sample 0: {expected}\n") == 1 and out.count(f": {expected}\n") == 4
    assert "6 blocks copied on write" in out  # 3 per prompt: the seed's example, twice
    code, out, err = _cli(*argv, "--json", str(tmp_path / "out.json"))  # a restart: the SSD tier serves
    assert code == 0, err
    assert "prompt 0: 40 tokens; prefix: 0 GPU pool, 0 CPU, 32 SSD, 8 computed" in out
    record = json.loads((tmp_path / "out.json").read_text())["outputs"][0]
    assert record["hit_tokens"]["ssd"] == 32 and record["samples"] == [hf_greedy(hf, prompt, 6)] * 4


@pytest.mark.parametrize("content, message", [
    ("[1, 2]\n{\"prompt_token_ids\": \"x\"}\n", r"prompts.jsonl:2: expected a non-empty list of token ids"),
    ("[1, 2\n", r"prompts.jsonl:1: not JSON"),
    ("\n", r"prompts.jsonl holds no prompt"),
    ("[5, 9999]\n", r"prompts\[0\]: token 9999 is not an id in \[0, 512\)"),
])
def test_generate_names_a_bad_prompt_file_line(model_dir: Path, tmp_path: Path, content: str, message: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    code, out, err = _cli("generate", "--model", str(model_dir), "--prompt-file", str(prompts),
                          "--set", "ssd.path=null", "--set", "cpu.capacity=0", "--set", "gpu.device=cpu")
    assert code == 2 and "Traceback" not in err
    assert re.search(message, err), err


def test_generate_names_a_missing_prompt_file(model_dir: Path, tmp_path: Path) -> None:
    code, out, err = _cli("generate", "--model", str(model_dir), "--prompt-file", str(tmp_path / "none.jsonl"))
    assert code == 2 and "Traceback" not in err
    assert f"--prompt-file: {tmp_path / 'none.jsonl'}: No such file or directory" in err, err


def test_generate_refuses_a_model_that_is_not_llama_family(tmp_path: Path) -> None:
    ckpt = _write_config(tmp_path / "gemma", model_type="gemma3_text")
    (tmp_path / "p.jsonl").write_text("[1, 2, 3]\n")
    code, out, err = _cli("generate", "--model", str(ckpt), "--prompt-file", str(tmp_path / "p.jsonl"))
    assert code == 2 and "is not a Llama-family model" in err and "Traceback" not in err



def _copy_checkpoint(model_dir: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(model_dir, dest)
    return dest


def test_weights_lacking_a_tensor_the_config_names_are_refused_not_run_at_random(model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """Regression: transformers fills a tensor missing from the files with random values, and
    ``generate`` ran them and exited 0."""
    from safetensors.torch import load_file, save_file

    from kvstrata.engine import LLMEngine

    ckpt = _copy_checkpoint(model_dir, tmp_path / "ckpt")
    (weights,) = ckpt.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(k for k in tensors if "layers.1.mlp.down_proj" in k)
    del tensors[name]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"the weight files lack 1 tensor\(s\) the config names, first "
                                          r"'model.layers.1.mlp.down_proj.weight'"):
        LLMEngine(ckpt, engine_config(tmp_path))


def test_a_damaged_weights_file_is_one_line_naming_the_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    from kvstrata.engine import LLMEngine

    ckpt = _copy_checkpoint(model_dir, tmp_path / "ckpt")
    (weights,) = ckpt.glob("*.safetensors")
    weights.write_bytes(b"\xff" * 64 + weights.read_bytes()[64:])  # the header's length and start overwritten
    with pytest.raises(ConfigError, match=rf"^model: {re.escape(str(ckpt))}: cannot load the weights"):
        LLMEngine(ckpt, engine_config(tmp_path))


def test_a_kv_pool_larger_than_memory_is_refused_before_allocating_whichever_key_sized_it(model_dir: Path,
                                                                                        tmp_path: Path) -> None:
    """Regression: ``gpu.num_blocks`` of 10^6 ran until killed at 4 GiB, where ``gpu.capacity``
    was refused at once."""
    from kvstrata.engine import LLMEngine

    huge = engine_config(tmp_path, gpu_blocks=10**9)
    with pytest.raises(ConfigError, match=r"^gpu\.num_blocks: a KV pool of 1,000,000,000 blocks .* free"):
        LLMEngine(model_dir, huge)
    assert not (tmp_path / "ssd").exists()  # refused before any tier was opened


def test_a_prompt_file_nested_too_deeply_or_not_a_file_is_one_line(tmp_path: Path) -> None:
    from kvstrata.engine.prompts import read_prompts

    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"deep.jsonl:1: JSON nested too deeply"):
        read_prompts(deep, tmp_path)
    with pytest.raises(ConfigError, match=r"^--prompt-file: /dev/zero is not a regular file"):
        read_prompts("/dev/zero", tmp_path)


def test_generate_checks_every_prompt_before_the_weights_load(tmp_path: Path) -> None:
    """Regression: the prompt checks ran only after the weights loaded. A checkpoint with no
    weight file at all still gets the prompt's error: nothing was loaded."""
    ckpt = _write_config(tmp_path / "ckpt")
    (tmp_path / "p.jsonl").write_text("[1, 2, 3]\n[5, 9999]\n")
    code, out, err = _cli("generate", "--model", str(ckpt), "--prompt-file", str(tmp_path / "p.jsonl"),
                          "--set", f"ssd.path={tmp_path / 'ssd'}", "--set", "gpu.device=cpu")
    assert code == 2 and "Traceback" not in err
    assert "prompts[1]: token 9999 is not an id" in err, err
    assert not (tmp_path / "ssd").exists()
