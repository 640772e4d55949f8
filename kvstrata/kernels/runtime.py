"""cupy plumbing: lazy import, one compiled module per kernel specialisation
and device, zero-copy DLPack views of torch tensors, and launches on torch's
current stream. Nothing here is imported until a CUDA tensor shows up."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch

from kvstrata.kernels.reference_cache import bits
from kvstrata.kernels.sources import cuda_dir, read_source
from kvstrata.kernels.specs import KernelSpec

NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)
# What cupy.RawModule adds after the caller's options, whatever they say: device code is
# compiled flushing denormals to zero (the FP8 conversions are integer-only for this).
CUPY_APPENDED_OPTIONS: tuple[str, ...] = ("-ftz=true",)
DEFAULT_SMEM_LIMIT = 48 * 1024  # dynamic shared memory a launch gets without opting in


def cupy() -> ModuleType:
    """The cupy module, or a RuntimeError saying how to install it."""
    try:
        import cupy as cp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("CUDA tensors need cupy: pip install 'kvstrata[cuda13]' (CUDA 13 driver) or "
                           "'kvstrata[cuda12]' (CUDA 12)") from exc
    return cp


@lru_cache(maxsize=None)
def kernel(spec: KernelSpec, device_index: int) -> Any:
    """The compiled ``cupy.RawKernel`` for ``spec`` on a device (compiled on first use)."""
    cp = cupy()
    with cp.cuda.Device(device_index):
        module = cp.RawModule(
            code=read_source(spec.source),
            options=(*NVRTC_OPTIONS, f"--include-path={cuda_dir()}"),
            name_expressions=(spec.name,),
        )
        return module.get_function(spec.name)


def launch(spec: KernelSpec, device: torch.device, grid: tuple[int, ...], block: int, args: tuple[Any, ...], smem: int = 0) -> None:
    """Launch ``spec`` on torch's current stream of ``device``; ``args`` are
    already cupy arrays or numpy scalars (see ``arg``). A bfloat16 kernel on a
    device older than sm_80 is a ValueError, before anything is launched."""
    if "tkv::bf16" in spec.name and torch.cuda.get_device_capability(device) < (8, 0):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"dtype: bfloat16 kernels need compute capability 8.0 or newer; {device} "
                         f"has {major}.{minor}")
    k = kernel(spec, device.index)
    with stream_of(device):  # the attribute belongs to the function on this device
        if smem > DEFAULT_SMEM_LIMIT and k.max_dynamic_shared_size_bytes < smem:
            k.max_dynamic_shared_size_bytes = smem
        k(grid, (block,), args, shared_mem=smem)


@lru_cache(maxsize=None)
def max_shared_memory(device: torch.device) -> int:
    """Dynamic shared memory one thread block of ``device`` may opt in to (bytes)."""
    cp = cupy()
    with cp.cuda.Device(device.index) as dev:
        return int(dev.attributes["MaxSharedMemoryPerBlockOptin"])


@contextmanager
def stream_of(device: torch.device) -> Iterator[None]:
    """Make torch's current stream on ``device`` cupy's current stream."""
    cp = cupy()
    handle = torch.cuda.current_stream(device).cuda_stream
    with cp.cuda.Device(device.index), cp.cuda.ExternalStream(handle, device.index):
        yield


def arg(t: torch.Tensor) -> Any:
    """A cupy view of a CUDA tensor's memory (DLPack, no copy), reinterpreted
    as the same-width integer type so every dtype (bf16, fp8) crosses over;
    the kernel receives its data pointer."""
    with stream_of(t.device):
        return cupy().from_dlpack(bits(t).detach())
