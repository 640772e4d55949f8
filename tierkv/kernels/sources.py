"""Locating the .cu sources: the installed package ``tierkv.cuda`` (package
data) or, in a source checkout, the repository's ``cuda/`` directory."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cuda_dir() -> Path:
    """The directory holding the kernel sources (``*.cu``, ``*.cuh``)."""
    try:  # installed: tierkv/cuda/ is a namespace package holding only package data
        import tierkv.cuda

        for entry in tierkv.cuda.__path__:
            if (Path(entry) / "tierkv_types.cuh").is_file():
                return Path(entry)
    except ModuleNotFoundError:
        pass
    path = Path(__file__).resolve().parents[2] / "cuda"
    if (path / "tierkv_types.cuh").is_file():
        return path
    raise FileNotFoundError("tierkv CUDA sources not found (neither package tierkv.cuda nor <repo>/cuda)")


def read_source(name: str) -> str:
    """The text of one kernel source file, e.g. ``"copy_blocks.cu"``."""
    return (cuda_dir() / name).read_text(encoding="utf-8")
