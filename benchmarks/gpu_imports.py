"""Import everything the given test files import, as the GPU machine will.

The GPU tests skip at import without CUDA, so collecting them here proves nothing: an
import that fails only reaches the GPU machine, where device time is scarce. This
walks each file's syntax tree (module-level imports and those inside functions) and
imports every module named, plus each test file's own helpers from its directory.
``--allow NAME`` lets a package that exists only on the GPU machine be missing here
(``cupy``), reported, never silently.

    python benchmarks/gpu_imports.py tests/test_copier_gpu.py tests/test_kernels_gpu.py --allow cupy
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, in order of first appearance (relative imports skipped)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"]
    return list(dict.fromkeys(names))


def check(paths: list[Path], allow: set[str]) -> tuple[list[str], list[str], list[str]]:
    """``(imported, allowed missing, errors)``. ``from a import b`` counts ``a.b`` as
    imported when it is a module or an attribute of ``a``."""
    imported, missing, errors = [], [], []
    failed: set[str] = set()
    for path in paths:
        sys.path.insert(0, str(path.parent.resolve()))
        for name in imported_modules(path):
            parent, _, attr = name.rpartition(".")
            if parent in failed:  # reported once, as the module
                failed.add(name)
                continue
            failed.add(name)  # until it imports
            try:
                importlib.import_module(name)
                imported.append(name)
                failed.discard(name)
            except ModuleNotFoundError as exc:
                root = (exc.name or "").split(".")[0]
                if parent and exc.name == name:
                    try:  # `from parent import attr` where attr is not a module
                        if hasattr(importlib.import_module(parent), attr):
                            imported.append(name)
                            failed.discard(name)
                            continue
                    except Exception as inner:  # noqa: BLE001 (report any failure)
                        exc = inner  # type: ignore[assignment]
                if root in allow:
                    missing.append(f"{path.name}: {name} (needs {root})")
                else:
                    errors.append(f"{path.name}: import {name}: {type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 (an import that raises anything is an error)
                errors.append(f"{path.name}: import {name}: {type(exc).__name__}: {exc}")
    return imported, missing, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--allow", action="append", default=[], help="a package that may be missing here")
    args = parser.parse_args(argv)
    imported, missing, errors = check(args.files, set(args.allow))
    import kvstrata

    print(f"{len(imported)} imports of {len(args.files)} GPU test files resolved (kvstrata from {kvstrata.__file__})")
    for line in missing:
        print(f"missing here, present on the GPU machine: {line}")
    for line in errors:
        print(f"ERROR {line}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
