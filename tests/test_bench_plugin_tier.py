"""``kvstrata bench`` over a deployment with a registered tier kind (``dict_tier.py``: a dict
between DRAM and SSD): the JSON report names the tier by its declared name wherever it
reports per tier, the text report by its label, and it serves hits on a workload whose GPU
pool and DRAM tier are too small for it; the same run without the kind registered reports
no such tier at all."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dict_tier import dict_tier  # noqa: E402

from kvstrata.bench.report import render_text  # noqa: E402
from kvstrata.cli.commands import main  # noqa: E402
from kvstrata.policy.tiers import KNOWN  # noqa: E402

DICT_BLOCKS = 1024
# a chat workload on a 256-block GPU pool and a 64-block DRAM tier, the SSD tier off: what the
# pool evicts is held below it only by the dict tier
BENCH = ["bench", "--workload", "chat", "--seed", "1", "--scale", "0.2", "--set", "gpu.num_blocks=256",
         "--set", "cpu.capacity=128MiB", "--set", "ssd.capacity=0", "--admission", "both", "--explain"]
BUILT_IN = ["gpu", "cpu", "ssd"]


def bench(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> tuple[dict[str, Any], str]:
    """The JSON and the text report of :data:`BENCH`."""
    out = tmp_path / f"{name}.json"
    assert main([*BENCH, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def table(text: str, title: str) -> list[str]:
    """The lines of the table under the line that starts with ``title`` (up to the blank line
    after it)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 1
    return lines[start:lines.index("", start)]


@pytest.fixture
def reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, tuple[dict[str, Any], str]]:
    """The reports with the dict tier registered and without it."""
    with dict_tier(DICT_BLOCKS):
        label = KNOWN["dict"].label
        with_dict = bench(tmp_path, capsys, "with")
    assert "dict" not in KNOWN and label == "dict"
    return {"with": with_dict, "without": bench(tmp_path, capsys, "without")}


def test_the_json_report_names_the_tier_wherever_it_reports_per_tier(reports: dict[str, Any]) -> None:
    r, _ = reports["with"]
    assert list(r["hit_rate"]) == [*BUILT_IN, "dict", "total"]
    assert list(r["hit_blocks"]) == [*BUILT_IN, "dict"]
    hits = r["hit_blocks"]["dict"]
    assert hits > 0 and r["hit_rate"]["dict"] == round(hits / r["block_accesses"], 6)
    assert r["capacity"]["dict"]["blocks"] == DICT_BLOCKS and r["capacity"]["dict"]["tokens"] == DICT_BLOCKS * 16
    for what in ("reuse_gap_s", "idle_before_evict_s", "lifetime_s"):
        assert list(r[what]["tiers"]) == [*BUILT_IN, "dict"], what
    assert r["reuse_gap_s"]["tiers"]["dict"]["count"] == hits  # each hit reuses a block the tier took
    assert r["replay"]["spills"]["dict"] > 0 and r["replay"]["evictions"]["dict"] > 0
    assert r["miss_reasons"]["evicted_dict"] > 0  # the tier held those blocks last
    assert list(r["miss_reasons"]) == ["new", *(f"evicted_{t}" for t in (*BUILT_IN, "dict")), "prefix_miss",
                                       "last_token", "rejected", "other"]
    assert r["diagnosis"]["pools"]["dict"]["evictions"] == r["replay"]["evictions"]["dict"]
    assert r["diagnosis"]["pools"]["dict"]["missed"] == r["miss_reasons"]["evicted_dict"]
    for mode, c in r["admission_comparison"].items():
        assert c["hit_blocks"]["dict"] > 0 and c["blocks_written"]["dict"] > 0, mode
    assert any(m["reason"] == "evicted_dict" for m in r["misses"])


def test_the_workload_needs_the_tier(reports: dict[str, Any]) -> None:
    """Without it, most of what the GPU pool evicts is lost: with it, a tenth of the blocks
    and more are served from it, and the total rises by as much."""
    with_dict, without = reports["with"][0], reports["without"][0]
    assert with_dict["hit_rate"]["dict"] > 0.1
    assert with_dict["hit_rate"]["total"] > without["hit_rate"]["total"] + 0.1
    assert with_dict["hit_rate"]["ssd"] == without["hit_rate"]["ssd"] == 0.0  # the SSD tier is off


def test_the_text_report_names_the_tier_by_its_label(reports: dict[str, Any]) -> None:
    r, text = reports["with"]
    rows = {line.split()[0]: line.split() for line in table(text, "Hit rate by tier")[2:]}
    assert rows["DICT"][1:3] == [f"{DICT_BLOCKS:,}", f"{DICT_BLOCKS * 16:,}"]
    assert rows["DICT"][-1] == f"{r['hit_blocks']['dict']:,}"
    assert rows["DICT"][-2] == f"{100 * r['hit_rate']['dict']:.1f}%"
    reasons = table(text, "Why blocks missed")
    assert any(line.startswith("  evicted earlier from the dict tier") and f"{r['miss_reasons']['evicted_dict']:,}"
               in line for line in reasons)
    assert "\n  dict: " in text  # the diagnosis of its size
    head = table(text, "Admission modes (the same trace and capacities)")[0].split()
    assert head[:6] == ["admission", "GPU", "CPU", "SSD", "dict", "total"]
    assert re.search(r"^\s+dict\s", text, re.M)  # its lifecycle rows
    # a request's first miss (--explain shows the first 20): those the tier held last
    firsts = [m for m in r["misses"] if m["reason"] == "evicted_dict"]
    with dict_tier(DICT_BLOCKS):
        explained = table(render_text({**r, "misses": firsts}), "First miss per request")
    assert sum("evicted from the dict tier" in line and "s before (last used" in line for line in explained) == \
        min(20, len(firsts)) > 0


def test_without_the_kind_registered_the_report_has_no_such_tier(reports: dict[str, Any]) -> None:
    r, text = reports["without"]
    assert list(r["hit_rate"]) == [*BUILT_IN, "total"] and list(r["hit_blocks"]) == BUILT_IN
    assert "dict" not in r["capacity"] and "dict" not in r["diagnosis"]["pools"]
    for what in ("reuse_gap_s", "idle_before_evict_s", "lifetime_s"):
        assert list(r[what]["tiers"]) == BUILT_IN, what
    assert "evicted_dict" not in r["miss_reasons"] and "dict" not in r["replay"]["spills"]
    for c in r["admission_comparison"].values():
        assert "dict" not in c["hit_rate"] and "dict" not in c["blocks_written"]
    assert not re.search(r"\bdict\b", text, re.I)
