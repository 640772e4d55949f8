"""Argument checks run before every launch. Each failure is a ValueError whose
message starts with the offending argument's name."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def as_tensor(name: str, value: Any) -> torch.Tensor:
    """A torch tensor for ``value``: itself, or a zero-copy DLPack import
    (cupy arrays and other ``__dlpack__`` producers)."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "__dlpack__"):
        return torch.from_dlpack(value)
    raise ValueError(f"{name}: expected a tensor, got {type(value).__name__}")


def index_tensor(name: str, value: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D/2-D index tensor; a Python sequence of ints becomes a CPU tensor."""
    if isinstance(value, (list, tuple)):
        return torch.tensor(value, dtype=dtype)
    t = as_tensor(name, value)
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    return t


def dtype_in(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not supported (expected one of {', '.join(map(str, allowed))})")


def dtype_is(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def ndim(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != n:
        raise ValueError(f"{name}: expected {n} dimensions, got shape {tuple(t.shape)}")


def shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {t.stride()}, shape {tuple(t.shape)})")


def inner_contiguous(name: str, t: torch.Tensor) -> None:
    """Every dimension but the first is contiguous (rows may be strided)."""
    if t.dim() < 1 or (t.dim() > 1 and not t[0].is_contiguous()) or (t.numel() and t.stride(0) < max(1, t[0].numel())):
        raise ValueError(f"{name}: each row (dim 0 slice) must be contiguous and rows must not overlap (strides {t.stride()})")


def member(name: str, value: int, allowed: Sequence[int]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value} not supported (expected one of {tuple(allowed)})")


def same_device(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    for n, t in zip(names, tensors):
        if t.device != device:
            raise ValueError(f"{n}: on {t.device}, expected {device} like {names[0]}")
    return device


def in_range(name: str, t: torch.Tensor, low: int, high: int) -> int | None:
    """All values in [low, high); returns the largest (None when empty). Synchronises
    when ``t`` is on a GPU."""
    if t.numel() == 0:
        return None
    lo, hi = torch.aminmax(t)
    lo_v, hi_v = int(lo), int(hi)
    if lo_v < low or hi_v >= high:
        bad = lo_v if lo_v < low else hi_v
        raise ValueError(f"{name}: value {bad} out of range [{low}, {high})")
    return hi_v


def count(name: str, value: Any) -> int:
    """A non-negative Python integer (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    return value


def distinct(name: str, t: torch.Tensor) -> None:
    """No value repeats. Synchronises when ``t`` is on a GPU."""
    if t.numel() > 1 and torch.unique(t).numel() != t.numel():
        raise ValueError(f"{name}: values must be distinct")


def aligned(name: str, t: torch.Tensor, nbytes: int = 16) -> None:
    if t.data_ptr() % nbytes:
        raise ValueError(f"{name}: data must be {nbytes}-byte aligned")
