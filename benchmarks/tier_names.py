"""How many identifiers name a tier outside the tiers, their declarations and the config.

    python benchmarks/tier_names.py [--root DIR] [--top N]

The rule. An identifier names a tier when one of its word parts is ``cpu``, ``ssd`` or
``remote`` (any case): the identifier is split on ``_`` and at case changes (``ssd_tier``,
``SSDTier``, ``read_remote`` and ``CPU`` all count; ``remotely`` and ``ssds`` do not).
Identifiers are names (read or written: variables, constants, dataclass fields),
attributes, parameters, keyword arguments at calls, and the names of functions and
classes where they are defined. Counted are occurrences, line by line: each line counts
every tier-naming identifier it spells, one spelled twice on a line once (``f(ssd=ssd)``,
``self.ssd = ssd``: one each). Not counted: string constants (public output names, config
keys and metric labels may keep tier names), comments and docstrings, and import
statements (the names an import binds count where they are used). Calibrated on commit
1a0b6a9, the flat layout before the package was arranged by concern: 717 there (counting
every repeat on a line too would give 799; names and attributes alone, 729).

Counted are ``kvstrata/**/*.py`` under DIR (the repository root, this checkout by default)
except the tier kinds (``kvstrata/tiers/**``), the tier declarations
(``kvstrata/policy/tiers.py``) and the config: ``kvstrata/config/**`` and
``kvstrata/system/values.py`` in the layout by concern, ``kvstrata/config.py``,
``values.py``, ``yaml_file.py``, ``remote_config.py``, ``model_config.py``,
``load_config.py`` and ``credentials.py`` at the package's top level in the older flat
layout (both are excluded wherever they exist, so the one rule measures either layout).

Prints the total and the files with the most occurrences.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections import Counter
from pathlib import Path

TIER_WORDS = frozenset({"cpu", "ssd", "remote"})
EXCLUDED_DIRS = ("kvstrata/tiers", "kvstrata/config")
EXCLUDED_FILES = frozenset({
    "kvstrata/policy/tiers.py",
    "kvstrata/system/values.py",
    # the flat layout's config modules
    "kvstrata/config.py",
    "kvstrata/values.py",
    "kvstrata/yaml_file.py",
    "kvstrata/remote_config.py",
    "kvstrata/model_config.py",
    "kvstrata/load_config.py",
    "kvstrata/credentials.py",
})
_PARTS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def word_parts(identifier: str) -> list[str]:
    """``SSDTier`` -> ``["ssd", "tier"]``, ``read_remote_v2`` -> ``["read", "remote", "v", "2"]``."""
    return [p.lower() for chunk in identifier.split("_") for p in _PARTS.findall(chunk)]


def names_a_tier(identifier: str) -> bool:
    return any(p in TIER_WORDS for p in word_parts(identifier))


def identifiers(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, identifier) for every identifier the code spells: no string constants, no imports."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg is not None:
            out.append((node.lineno, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name))
    return out


def count_source(source: str) -> int:
    """One module's tier-naming identifiers, each counted once per line that spells it."""
    return len({(line, name) for line, name in identifiers(ast.parse(source)) if names_a_tier(name)})


def excluded(rel: str) -> bool:
    return rel in EXCLUDED_FILES or any(rel.startswith(d + "/") for d in EXCLUDED_DIRS)


def count_tree(root: Path) -> Counter[str]:
    """Per counted module (path relative to ``root``): its occurrences (modules with none left out)."""
    counts: Counter[str] = Counter()
    for path in sorted((root / "kvstrata").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not excluded(rel):
            n = count_source(path.read_text())
            if n:
                counts[rel] = n
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository root holding kvstrata/ (default: this checkout)")
    parser.add_argument("--top", type=int, default=10, help="how many files to list (default 10)")
    args = parser.parse_args(argv)
    if not (args.root / "kvstrata").is_dir():
        parser.error(f"--root: no kvstrata/ under {args.root}")
    counts = count_tree(args.root)
    print(f"identifiers naming a tier: {sum(counts.values())} in {len(counts)} files")
    for rel, n in counts.most_common(args.top):
        print(f"{n:6d}  {rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
