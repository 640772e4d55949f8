"""Byte views of the block buffers callers hand to the tiers: numpy arrays, CPU tensors, bytes.

Pure functions with no state (safe from any thread). torch is never imported
here: a tensor is recognised by its type's module and converted through its
own methods.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_numpy", "nbytes", "writable_view"]


def as_numpy(data: Any, what: str) -> np.ndarray:
    """``data`` as a numpy array sharing its memory (a flat ``uint8`` view for bytes-likes
    and tensors). ``what`` names the argument in the ``ValueError`` for anything else."""
    if isinstance(data, np.ndarray):
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    if type(data).__module__.startswith("torch"):
        if data.device.type != "cpu":
            raise ValueError(f"{what}: expected a CPU tensor, got one on {data.device}")
        if not data.is_contiguous():
            raise ValueError(f"{what}: must be contiguous")
        import torch
        return data.detach().reshape(-1).view(torch.uint8).numpy()
    raise ValueError(f"{what}: expected a torch tensor, numpy array or bytes, "
                     f"got {type(data).__name__}")


def nbytes(data: Any) -> int:
    """Size in bytes of a bytes-like, numpy array or tensor, without converting it."""
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    if isinstance(data, memoryview):
        return data.nbytes
    size = getattr(data, "nbytes", None)
    if isinstance(size, int):
        return size
    if type(data).__module__.startswith("torch"):
        return int(data.numel() * data.element_size())
    raise ValueError(f"data: expected a torch tensor, numpy array or bytes, "
                     f"got {type(data).__name__}")


def writable_view(buf: Any, what: str) -> memoryview:
    """A flat writable byte view of ``buf`` (numpy array, CPU tensor, bytearray, memoryview)."""
    if isinstance(buf, bytes):
        raise ValueError(f"{what}: bytes are read-only; pass a bytearray or an array")
    arr = as_numpy(buf, what)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError(f"{what}: every buffer must be writable and C-contiguous")
    return memoryview(arr.reshape(-1).view(np.uint8))
