"""benchmarks/soak.py: its workload and journal, and a short soak with a SIGKILL restart."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def _load():
    spec = importlib.util.spec_from_file_location("kvstrata_soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvstrata_soak"] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


soak = _load()

PARAMS = {"seed": 3, "system_prompts": 4, "sys_blocks": [2, 6], "active": 20, "max_blocks": 40, "max_turns": 5,
          "zipf": 1.0, "new_prob": 0.1, "user_tokens": [4, 60], "out_tokens": [4, 40]}


def test_workload_resumes_where_a_restarted_child_left_off() -> None:
    whole = soak.make_workload(PARAMS)
    turns = [whole.next() for _ in range(300)]
    tokens = {t.index: whole.tokens(t) for t in turns[200:]}
    resumed = soak.make_workload(PARAMS)
    resumed.skip(200)
    for t in turns[200:]:
        u = resumed.next()
        assert (u.index, u.conv.cid, u.turn) == (t.index, t.conv.cid, t.turn)
        assert resumed.tokens(u) == tokens[t.index]


def test_each_turn_extends_the_previous_turn_of_its_conversation() -> None:
    wl = soak.make_workload(PARAMS)
    last: dict[int, list[int]] = {}
    for _ in range(300):
        t = wl.next()
        prompt, out = wl.tokens(t)
        if t.conv.cid in last:
            assert prompt[:len(last[t.conv.cid])] == last[t.conv.cid]
        else:
            assert prompt[:len(wl.sys_tokens[t.conv.sys_id])] == wl.sys_tokens[t.conv.sys_id].tolist()
        assert len(prompt) + len(out) <= PARAMS["max_blocks"] * soak.BS
        last[t.conv.cid] = prompt + out


def test_payload_is_a_function_of_the_hash() -> None:
    a, b = b"\x01" * 32, b"\x02" * 32
    assert (soak.payload(a, 8192) == soak.payload(a, 8192)).all()
    assert (soak.payload(a, 8192) != soak.payload(b, 8192)).any()
    assert (soak.payloads([a, b], 4096)[1] == soak.payload(b, 4096)).all()


def test_confirmed_after_kill_subtracts_what_was_journalled(tmp_path: Path) -> None:
    keys = [bytes([i]) * 32 for i in range(6)]
    j = soak.Journal(tmp_path)
    j.checkpoint(keys[:2])
    j.write("D", [keys[0]])
    j.checkpoint(keys[1:5])           # replaces checkpoint 1 and its journal
    j.write("D", [keys[1]])
    j.write("L", [keys[2], keys[5]])  # keys[5] was never confirmed
    confirmed, info = soak.confirmed_after_kill(tmp_path)
    assert confirmed == {keys[3], keys[4]}
    assert info == {"checkpoint": 2, "snapshot": 4, "discarded_since": 1, "lost_since": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal-2", "snapshot-2.keys"]


@pytest.mark.long
def test_short_soak_with_a_sigkill_restart(tmp_path: Path) -> None:
    """About 20 s of replay: one child SIGKILLed mid-work, its successor and a final verify-only
    child read every SSD record back; no wrong block, no confirmed block lost."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(SOAK), "--minutes", "0.35", "--restart-every", "8",
                           "--kill-every", "1", "--warmup", "5", "--checkpoint-every", "3",
                           "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    chk, tot = rep["checks"], rep["totals"]
    assert chk["wrong_blocks"] == 0, proc.stdout
    assert chk["flushed_blocks_lost"] == 0, proc.stdout
    assert chk["hash_mismatches"] == 0
    assert chk["sigkill_restarts"] >= 1, proc.stdout
    assert tot["requests"] > 0 and tot["checked"] > 0 and tot["hit_gpu"] > 0 and tot["hit_cpu"] > 0
    after_kill = [c for c in rep["children"] if c["after"] == "SIGKILL"]
    assert after_kill and after_kill[0]["reopen"]["scan_exact"] > 0
    assert after_kill[0]["reopen"]["confirmed"] > 0          # the check after the kill covered blocks
    assert rep["children"][-1]["kind"] == "verify" and rep["children"][-1]["reopen"]["lost"] == 0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(tmp_path.glob("kvstrata-soak-*"))          # the work directory is removed
