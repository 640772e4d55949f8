"""Tier kinds that installed packages declare under the ``kvstrata.tiers`` entry-point group are
registered in every process on first use (a vLLM worker process too), and one that fails to
import is a ConfigError naming it. Each case runs in a fresh Python process over a real
``.dist-info`` directory on its path, as pip would install it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

PLUGIN = '''
from dict_tier import DictStore
from kvstrata.policy.tiers import Tier
from kvstrata.tiers.kinds import TierKind, register

register(TierKind(Tier("dict", medium="CPU", key="dict", label="dict"), section="dict",
                  capacity=lambda config, block_nbytes: 8, open=lambda opening: DictStore(), backend=DictStore,
                  position=200))
'''

PROBE = '''
from kvstrata.tiers.kinds import kinds
print(",".join(kinds()))
'''


def install(site: Path, module: str, source: str) -> None:
    """A package ``kvstrata-dict`` whose entry point names ``module`` (with ``source``)."""
    (site / f"{module}.py").write_text(source)
    info = site / "kvstrata_dict-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvstrata-dict\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kvstrata.tiers]\ndict = {module}\n")


def run(site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(TESTS), str(TESTS.parent)])}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)


def test_an_installed_kind_is_registered_in_chain_order(tmp_path: Path) -> None:
    install(tmp_path, "kvstrata_dict_tier", PLUGIN)
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu,dict,ssd,remote"]


def test_a_plugin_that_fails_to_import_is_named(tmp_path: Path) -> None:
    install(tmp_path, "kvstrata_broken_tier", "raise RuntimeError('no such device')\n")
    done = run(tmp_path)
    assert done.returncode != 0
    assert ("ConfigError: tiers: the tier kind plug-in 'dict' (kvstrata_broken_tier) failed to load: "
            "RuntimeError: no such device") in done.stderr
