"""The layout rules the design depends on, checked on the source (AST), not by convention.

* Placement is decided in one place: only the tier policy (``kvstrata/policy``) uses the
  slot index's placement operations. The drivers (library cache, vLLM connector,
  bench replay) and the executor call the policy's verbs and apply its plans.
  (``kvstrata/tiers/host.py``'s ``CPUTier`` is the standalone DRAM store for library
  users; the tiered cache does not use it.)
* Imports go one way, those inside functions included: connectors -> drivers -> policy
  -> nothing with bytes; no two modules import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACEMENT = {"SlotIndex", "allocate_many", "try_allocate", "pin_many", "unpin_many"}
ALLOWED = {ROOT / "kvstrata" / "tiers" / "host.py"}


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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level and inside functions alike (a lazy
    import is still a dependency): ``from a import b`` names ``a.b`` (a submodule, or a
    name in ``a``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (any level)."""
    files = {module_name(p): p for p in sources("kvstrata")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {r for r in map(resolve, all_imports(p)) if r is not None and r != m} for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_only_the_policy_places_blocks() -> None:
    policy = ROOT / "kvstrata" / "policy"
    offenders = {}
    for path in sources("kvstrata"):
        if policy in path.parents or path in ALLOWED:
            continue
        used = names_used(path) & PLACEMENT
        if used:
            offenders[str(path.relative_to(ROOT))] = sorted(used)
    assert not offenders, f"placement decided outside kvstrata/policy: {offenders}"


# The SSD record format's space arithmetic (capacity in blocks): no bytes, no I/O.
POLICY_MAY_IMPORT = ("kvstrata.tiers.ssd.footprint",)


def test_the_policy_imports_nothing_with_bytes_or_drivers() -> None:
    forbidden = ("numpy", "torch", "lmdb", "zstandard", "cupy", "vllm", "kvstrata.tiers", "kvstrata.dataplane.executor",
                 "kvstrata.library.tiered", "kvstrata.bench", "kvstrata.connectors", "kvstrata.dataplane.transfer", "kvstrata.pool.blocks",
                 "kvstrata.engine", "kvstrata.trace", "kvstrata.core.metrics", "kvstrata.dataplane.copier")
    for path in sources("kvstrata/policy"):
        bad = [m for m in all_imports(path) if m.startswith(forbidden) and not m.startswith(POLICY_MAY_IMPORT)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_the_connectors_import_the_connectors() -> None:
    inside = ROOT / "kvstrata" / "connectors"
    for path in sources("kvstrata"):
        if inside in path.parents:
            continue
        bad = [m for m in all_imports(path) if m.startswith("kvstrata.connectors")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_lower_layers_never_import_upper_ones() -> None:
    """Imports go one way, counting those inside functions: the tiers, the trace format
    and the kernels know nothing of the drivers, the bench or the engine."""
    upper = ("kvstrata.library.tiered", "kvstrata.bench", "kvstrata.engine", "kvstrata.connectors", "kvstrata.cli.main")
    for below in ("kvstrata/tiers", "kvstrata/trace", "kvstrata/kernels", "kvstrata/policy"):
        for path in sources(below):
            bad = [m for m in all_imports(path) if m.startswith(upper)]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_no_import_cycles_even_inside_functions() -> None:
    found = cycles(import_graph())
    assert not found, f"modules that import each other (directly or around a loop): {found}"


def test_the_cycle_check_has_teeth() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_tree_is_the_installed_tree() -> None:
    """Connectors and CUDA sources live inside the package directory: no mapping in
    pyproject.toml, nothing importable from the repository root but the package."""
    text = (ROOT / "pyproject.toml").read_text()
    assert "package-dir" not in text
    assert (ROOT / "kvstrata" / "connectors" / "vllm" / "__init__.py").is_file()
    assert list((ROOT / "kvstrata" / "cuda").glob("*.cu"))
    assert not (ROOT / "connectors").exists() and not (ROOT / "cuda").exists()


def test_the_rules_have_teeth(tmp_path: Path) -> None:
    """A driver that calls the slot index itself is caught."""
    bad = tmp_path / "driver.py"
    bad.write_text("def place(index, keys):\n    return index.allocate_many(keys)\n")
    assert names_used(bad) & PLACEMENT == {"allocate_many"}


DRIVERS = ("kvstrata/library/tiered.py", "kvstrata/bench/replay.py", "kvstrata/connectors/vllm/scheduler.py",
           "kvstrata/connectors/kit/remote_lookups.py")
# The policy's request verbs: only the driver core calls them, so the step protocol (their
# order, what is touched before what is placed, what is counted) is written once.
PROTOCOL_VERBS = {"prepare_load", "complete_load", "prepare_store", "complete_store", "prepare_fetch",
                  "complete_fetch", "touch", "request_counts", "served_from"}


def test_the_step_protocol_is_written_once_in_the_driver_core() -> None:
    for rel in DRIVERS:
        path = ROOT / rel
        assert "kvstrata.core.driver.DriverCore" in all_imports(path), f"{rel} does not drive the DriverCore"
        tree = ast.parse(path.read_text())
        called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        called |= {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        # the replay's per-block tracker has a touch of its own (miss reasons), not the policy's
        bad = called & PROTOCOL_VERBS - ({"touch"} if rel.endswith("replay.py") else set())
        assert not bad, f"{rel} calls {sorted(bad)} itself instead of through kvstrata.core"


def test_the_driver_core_knows_no_driver() -> None:
    upper = ("kvstrata.library.tiered", "kvstrata.bench", "kvstrata.engine", "kvstrata.connectors", "kvstrata.cli.main")
    for path in sources("kvstrata/core"):
        bad = [m for m in all_imports(path) if m.startswith(upper) or m.startswith(("vllm", "torch", "numpy"))]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


TIER_NAMES = {"gpu", "cpu", "ssd", "remote"}
DECLARING = {ROOT / "kvstrata" / "policy" / "tiers.py"}  # the tier declarations
CONFIG = ROOT / "kvstrata" / "config"  # the config names its sections
VALUES = ROOT / "kvstrata" / "system" / "values.py"  # and reads their values


def tier_name_comparisons(path: Path) -> list[int]:
    """Lines where a tier's name spelled as a string is compared (``==``, ``!=``, ``in``): a
    device's type (``t.device.type == "cpu"``) is torch's, not a tier's."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides):
            continue
        consts = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", []))]
        if any(isinstance(c, ast.Constant) and c.value in TIER_NAMES for c in consts):
            out.append(node.lineno)
    return out


def test_no_tier_name_is_compared_as_a_string_outside_the_declarations() -> None:
    for path in sources("kvstrata"):
        if path in DECLARING or CONFIG in path.parents or path == VALUES:
            continue
        lines = tier_name_comparisons(path)
        assert not lines, f"{path.relative_to(ROOT)}:{lines[0]} compares a tier's name it spells itself"


def test_the_tier_name_rule_has_teeth(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('def f(tier):\n    return tier == "ssd" or tier in ("cpu",)\n')
    ok = tmp_path / "ok.py"
    ok.write_text('def f(t):\n    return t.device.type == "cpu"\n')
    assert tier_name_comparisons(bad) == [2, 2] and tier_name_comparisons(ok) == []
