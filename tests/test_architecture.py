"""The layout rules the design depends on, checked on the source (AST), not by convention.

* Placement is decided in one place: only the tier policy (``tierkv/policy``) uses the
  slot index's placement operations. The drivers (library cache, vLLM connector,
  bench replay) and the executor call the policy's verbs and apply its plans.
  (``tierkv/tiers/host.py``'s ``CPUTier`` is the standalone DRAM store for library
  users; the tiered cache does not use it.)
* Imports go one way: connectors -> tierkv; drivers -> policy -> nothing with bytes.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACEMENT = {"SlotIndex", "allocate_many", "try_allocate", "pin_many", "unpin_many"}
ALLOWED = {ROOT / "tierkv" / "tiers" / "host.py"}


def sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.name for a in node.names)
    return out


def module_imports(path: Path) -> set[str]:
    """Modules imported at module level (function-level imports are lazy by design)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_only_the_policy_places_blocks() -> None:
    policy = ROOT / "tierkv" / "policy"
    offenders = {}
    for path in sources("tierkv", "connectors"):
        if policy in path.parents or path in ALLOWED:
            continue
        used = names_used(path) & PLACEMENT
        if used:
            offenders[str(path.relative_to(ROOT))] = sorted(used)
    assert not offenders, f"placement decided outside tierkv/policy: {offenders}"


def test_the_policy_imports_nothing_with_bytes_or_drivers() -> None:
    forbidden = ("numpy", "torch", "lmdb", "zstandard", "cupy", "vllm", "tierkv.tiers", "tierkv.executor",
                 "tierkv.tiered", "tierkv.bench", "tierkv.connectors", "tierkv.transfer", "tierkv.block_pool")
    for path in sources("tierkv/policy"):
        bad = [m for m in module_imports(path) if m.startswith(forbidden)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_tierkv_never_imports_the_connectors() -> None:
    for path in sources("tierkv"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [m for m in mods if m.startswith("tierkv.connectors") or m.startswith("connectors")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_rules_have_teeth(tmp_path: Path) -> None:
    """A driver that calls the slot index itself is caught."""
    bad = tmp_path / "driver.py"
    bad.write_text("def place(index, keys):\n    return index.allocate_many(keys)\n")
    assert names_used(bad) & PLACEMENT == {"allocate_many"}
