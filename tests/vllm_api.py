"""The Python sources of another vLLM release, for tests that check kvstrata's connector
against that release's API (the connector base class, its hooks and signatures).

``python tests/vllm_api.py DEST [VERSION]`` downloads the release's wheel (no
dependencies) and unpacks only its ``.py`` files into ``DEST`` (~60 MB instead of
~1 GB: no CUDA binaries, which could not load here anyway); ``make test`` runs it once.
A test puts ``DEST`` first on ``PYTHONPATH`` in a child process, where ``import vllm``
is then that release's pure-Python code over the installed dependencies.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.33.0"
REPO = Path(__file__).resolve().parents[1]


def sources(version: str) -> Path:
    """Where ``make test`` keeps that release's sources."""
    return REPO / ".venv" / f"vllm-{version}"


def pytest_under(version: str, *args: str) -> "subprocess.CompletedProcess[str]":
    """``pytest args`` in a child process whose ``import vllm`` is that release's sources over
    the installed dependencies (the test is skipped, naming the command, when they are missing)."""
    import os

    import pytest

    src = sources(version)
    if not (src / "vllm" / "distributed").is_dir():
        pytest.skip(f"{src} is missing: run `make test` (or python tests/vllm_api.py {src} {version})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
               VLLM_LOGGING_LEVEL="ERROR")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO))


def fetch(dest: Path, version: str = VERSION) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "-d", tmp, f"vllm=={version}"], check=True)
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        part = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if info.filename.startswith("vllm/") and info.filename.endswith(".py") or \
                        info.filename.endswith(".dist-info/METADATA"):
                    z.extract(info, part)
        part.rename(dest)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if not target.exists():
        fetch(target, sys.argv[2] if len(sys.argv) > 2 else VERSION)
    print(f"vLLM {sys.argv[2] if len(sys.argv) > 2 else VERSION} sources in {target}")
