"""Locating the .cu sources: package data of ``kvstrata.cuda`` (the ``cuda/``
directory beside this package's modules, installed or in a checkout)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cuda_dir() -> Path:
    """The directory holding the kernel sources (``*.cu``, ``*.cuh``)."""
    path = Path(__file__).resolve().parents[1] / "cuda"
    if (path / "kvstrata_types.cuh").is_file():
        return path
    raise FileNotFoundError(f"kvstrata's CUDA sources are missing: {path} holds no kvstrata_types.cuh")


def read_source(name: str) -> str:
    """The text of one kernel source file, e.g. ``"copy_blocks.cu"``."""
    return (cuda_dir() / name).read_text(encoding="utf-8")
