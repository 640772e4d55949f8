"""The kernel instantiation grid: one source of truth for the runtime loader
(which compiles a specialisation the first time it is launched) and for the
compile check (which compiles every specialisation with nvcc).

A specialisation is a (source file, C++ name expression) pair, e.g.
``("paged_attention_v1.cu", "tkv::paged_attention_v1_kernel<tkv::bf16, tkv::bf16, 128, 16, 128>")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

HEAD_SIZES: tuple[int, ...] = (64, 128, 256)
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)
NUM_THREADS = 128  # attention thread block: 4 warps
PARTITION_SIZE = 512  # tokens per v2 partition

# torch dtype name -> C++ storage type in cuda/kvstrata_types.cuh
ACTIVATION_TYPES: dict[str, str] = {"float32": "float", "float16": "tkv::f16", "bfloat16": "tkv::bf16"}
FP8_TYPES: dict[str, str] = {"float8_e4m3fn": "tkv::fp8e4m3", "float8_e5m2": "tkv::fp8e5m2"}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel specialisation: compile ``name`` from ``source`` (a file in cuda/)."""

    source: str
    name: str


def cache_types(activation: str) -> tuple[str, ...]:
    """Cache dtype names allowed with an activation dtype: itself or an FP8 format."""
    return (activation, *FP8_TYPES)


def _ctype(dtype_name: str) -> str:
    return ACTIVATION_TYPES.get(dtype_name) or FP8_TYPES[dtype_name]


def attention_v1(act: str, cache: str, head: int, block: int) -> KernelSpec:
    args = f"{_ctype(act)}, {_ctype(cache)}, {head}, {block}, {NUM_THREADS}"
    return KernelSpec("paged_attention_v1.cu", f"tkv::paged_attention_v1_kernel<{args}>")


def attention_v2(act: str, cache: str, head: int, block: int) -> KernelSpec:
    args = f"{_ctype(act)}, {_ctype(cache)}, {head}, {block}, {NUM_THREADS}, {PARTITION_SIZE}"
    return KernelSpec("paged_attention_v2.cu", f"tkv::paged_attention_v2_kernel<{args}>")


def attention_v2_reduce(act: str, head: int) -> KernelSpec:
    args = f"{_ctype(act)}, {head}, {NUM_THREADS}, {PARTITION_SIZE}"
    return KernelSpec("paged_attention_v2.cu", f"tkv::paged_attention_v2_reduce_kernel<{args}>")


def reshape_and_cache(act: str, cache: str) -> KernelSpec:
    return KernelSpec("reshape_and_cache.cu", f"tkv::reshape_and_cache_kernel<{_ctype(act)}, {_ctype(cache)}>")


def copy_blocks(vectorised: bool) -> KernelSpec:
    return KernelSpec("copy_blocks.cu", f"tkv::copy_blocks_kernel<{_vec(vectorised)}>")


def gather_scatter(vectorised: bool, gather: bool) -> KernelSpec:
    flag = "true" if gather else "false"
    return KernelSpec("gather_scatter.cu", f"tkv::gather_scatter_kernel<{_vec(vectorised)}, {flag}>")


def _vec(vectorised: bool) -> str:
    return "uint4" if vectorised else "unsigned char"


def full_grid() -> list[KernelSpec]:
    """Every specialisation the launchers can request."""
    specs: list[KernelSpec] = []
    for act in ACTIVATION_TYPES:
        for cache, head, block in product(cache_types(act), HEAD_SIZES, BLOCK_SIZES):
            specs += [attention_v1(act, cache, head, block), attention_v2(act, cache, head, block)]
        specs += [attention_v2_reduce(act, head) for head in HEAD_SIZES]
        specs += [reshape_and_cache(act, cache) for cache in cache_types(act)]
    specs += [copy_blocks(v) for v in (True, False)]
    specs += [gather_scatter(v, g) for v, g in product((True, False), (True, False))]
    return specs


def quick_grid() -> list[KernelSpec]:
    """A few specialisations touching every source file, type and code path:
    fp32/fp16/bf16 activations, both FP8 formats, the smallest and largest
    head and block sizes, both copy widths."""
    return [
        attention_v1("bfloat16", "bfloat16", 128, 16),
        attention_v1("float16", "float8_e4m3fn", 256, 8),
        attention_v2("float32", "float8_e5m2", 64, 32),
        attention_v2_reduce("bfloat16", 128),
        reshape_and_cache("float16", "float8_e4m3fn"),
        reshape_and_cache("bfloat16", "float8_e5m2"),
        reshape_and_cache("float32", "float32"),
        copy_blocks(True),
        gather_scatter(True, True),
        gather_scatter(False, False),
    ]
