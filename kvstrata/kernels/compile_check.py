"""Compile kernel specialisations with nvcc for sm_80 and sm_90.

Templates are only type-checked when instantiated, so the check writes
translation units that ``#include`` each source and take the address of every
specialisation (which instantiates it, exactly what NVRTC's name expressions
do at run time) and compiles them to device code (``nvcc -c``, ptxas
included). Units are compiled by a couple of nvcc processes in parallel in a
temporary directory; nothing is cached.

    python -m kvstrata.kernels.compile_check [--quick] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstrata.kernels.sources import cuda_dir
from kvstrata.kernels.specs import KernelSpec, full_grid, quick_grid

ARCHS: tuple[str, ...] = ("sm_80", "sm_90")
NVCC_FLAGS: tuple[str, ...] = ("-std=c++17", "-O3", "--Werror", "all-warnings")


@dataclass(frozen=True)
class UnitResult:
    """Outcome of compiling one translation unit."""

    specs: tuple[KernelSpec, ...]
    ok: bool
    log: str


def find_nvcc() -> str | None:
    """Path of nvcc ($NVCC, PATH, or /usr/local/cuda/bin), or None."""
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def translation_unit(specs: Sequence[KernelSpec]) -> str:
    """C++ source instantiating ``specs`` (their sources included once each)."""
    sources = dict.fromkeys(s.source for s in specs)
    lines = [f'#include "{src}"' for src in sources]
    lines.append("void* tkv_instances[] = {")
    lines += [f"    (void*)&{s.name}," for s in specs]
    lines.append("};")
    return "\n".join(lines) + "\n"


def compile_unit(code: str, nvcc: str, workdir: Path, tag: str, include: Path | None = None) -> tuple[bool, str]:
    """Compile one unit for every arch in ARCHS; returns (ok, compiler log)."""
    src = workdir / f"{tag}.cu"
    src.write_text(code, encoding="utf-8")
    cmd = [nvcc, *NVCC_FLAGS, "-I", str(include or cuda_dir()), "-c", str(src), "-o", str(workdir / f"{tag}.o")]
    for arch in ARCHS:
        cmd += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout + proc.stderr


def _chunks(specs: Sequence[KernelSpec], size: int) -> list[tuple[KernelSpec, ...]]:
    return [tuple(specs[i : i + size]) for i in range(0, len(specs), size)]


def check(specs: Sequence[KernelSpec], *, jobs: int = 2, per_unit: int = 12, nvcc: str | None = None) -> list[UnitResult]:
    """Compile ``specs`` in units of ``per_unit`` with ``jobs`` nvcc processes."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set $NVCC or put it on PATH)")
    units = _chunks(list(specs), per_unit)
    with tempfile.TemporaryDirectory(prefix="kvstrata-nvcc-") as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = [
            pool.submit(compile_unit, translation_unit(unit), nvcc, Path(tmp), f"unit{i}")
            for i, unit in enumerate(units)
        ]
        return [UnitResult(unit, *f.result()) for unit, f in zip(units, futures)]


def failures_report(results: Sequence[UnitResult]) -> str:
    """Human-readable summary of the failed units ('' when all compiled)."""
    parts = []
    for r in results:
        if not r.ok:
            names = "\n  ".join(s.name for s in r.specs)
            parts.append(f"unit with:\n  {names}\n{r.log}")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few instantiations instead of the full grid")
    parser.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes")
    args = parser.parse_args(argv)
    specs = quick_grid() if args.quick else full_grid()
    results = check(specs, jobs=args.jobs)
    report = failures_report(results)
    print(report or f"ok: {len(specs)} specialisations compiled for {', '.join(ARCHS)}")
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
