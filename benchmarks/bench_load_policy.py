"""Load or recompute on the real vLLM engine: TTFT of kvstrata with ``load.policy: always``
and with ``measured`` (the default) against vLLM alone, with the SSD tier at its real speed
and on a disk slower than recompute, and with a remote tier at its real speed and behind a
slow server, every engine measured side by side with vLLM alone.

The slow disk is real (needs root and cgroup v1's blkio controller): the SSD tier lives
on an ext4 file system on a file-backed loop device, and the engines under test run in a
blkio cgroup whose ``blkio.throttle.read_bps_device`` limits that device's reads
(``tests/throttled_disk.py``; set up and removed here). The remote tier is a real
``valkey-server`` on loopback, reached directly or through a proxy that delivers its
answers at ``--read-mib`` MiB/s (``tests/slow_proxy.py``).

A locally built Llama (random weights, 8 layers, hidden 1024, fp32: 512 KiB per 32-token
block), ``--prompts`` distinct prompts of ``--tokens`` tokens, one at a time, one output
token each: TTFT is the time of each request.

Two phases, the SSD tier then the remote tier. In each, a writer engine with kvstrata
first stores every prompt below (the SSD tier: unthrottled, then copied once per engine
that reads it, since a tier's directory belongs to one server; the remote tier: the
server). Then these engines start, each in its own process, and stay up:

* vLLM alone (it recomputes every prompt: no prefix cache yet), in three processes: the
  reference is their mean TTFT prompt by prompt, and how far each is from it shows how far
  identical engines differ here (each process is consistently faster or slower, by up to
  about 15%, by where its memory landed);
* kvstrata with nothing below to hit (SSD phase; a DRAM tier that starts empty): what
  recomputing costs with kvstrata attached, storing what it computes;
* kvstrata, ``always`` and ``measured``, with the tier at its real speed (unless
  ``--slow-only``) and at ``--read-mib`` MiB/s.

The engines take turns: each prompt goes to every engine in turn, one engine running at
a time, after a pause that lets the engine before it go idle, in an order that rotates
from prompt to prompt (``vllm_util.take_turns``). This machine's drift over minutes
(20% between runs of the same engine minutes apart) falls on every engine alike. Two
figures per engine:

* its mean TTFT over the stored prompts against vLLM alone's for the same prompts (the
  mean of its three processes, prompt by prompt); vLLM alone's own processes show what
  is noise between processes;
* against itself: after each stored prompt every engine serves a fresh one of its own
  (which no tier holds, so every engine computes it), and its mean TTFT over the stored prompts is
  divided by its own over the fresh ones. That removes the process's own speed: vLLM
  alone, and any engine that computes what it could load, shows about 1.00x; it does
  not show what kvstrata costs when it computes, which the first figure of "kvstrata,
  nothing to hit" does. Every engine first serves four unrelated prompts of 64 to 1,024 tokens
(its warm-up, not timed: prefills of several sizes, from which ``measured`` tells what a
step costs whatever it computes from what a token costs; the writer stored them too, so
each tier gets its first samples there), then all idle ``IDLE_S`` (an engine's first
seconds run its forward up to 2-3x slower here, with kvstrata or without). The page cache
of the disk's files is dropped before the warm-up and again before the timed prompts, so
every read reaches the device. Every engine has the same environment and compute threads
(``ENV``).

    sudo .venv/bin/python benchmarks/bench_load_policy.py [--prompts 12] [--tokens 1024] [--read-mib 6]
        [--slow-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from slow_proxy import SlowProxy  # noqa: E402
from throttled_disk import ThrottledDisk, unavailable  # noqa: E402
from valkey_server import ValkeyServer, secret_file  # noqa: E402
from vllm_util import (EngineProcess, build_tiny_llama, random_token_prompt, run_in_subprocess,  # noqa: E402
                       take_turns)

# The same compute threads for every engine, and torch's CPU allocator backing large tensors
# with transparent huge pages (identical engine processes here ran the same prompts up to
# 40% apart without them, up to 18% with them: each process consistently fast or slow, by
# where its memory landed).
ENV = {"OMP_NUM_THREADS": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "THP_MEM_ALLOC_ENABLE": "1"}
WARM_UP = (64, 256, 1024, 128)  # tokens of each warm-up prompt
IDLE_S = 5.0  # after the warm-up: an engine's first seconds run slower here, with or without kvstrata
PAUSE_S = 0.5  # before each engine's turn
ALONES = ("vllm alone", "vllm alone, a second process", "vllm alone, a third process")
DRAM = {"cpu.capacity": "512MiB"}


def scenario(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The engine every run uses, and its steps: the warm-up prompts, then the timed ones."""
    model = str(build_tiny_llama(work / "llama-8x1024", layers=8, hidden=1024, heads=16, kv_heads=4,
                                 intermediate=2816, vocab=2048, max_positions=8192))
    prompts = [random_token_prompt(args.tokens, seed=100 + i, vocab=2000) for i in range(args.prompts)]
    warm = [random_token_prompt(n, seed=2 + i, vocab=2000) for i, n in enumerate(WARM_UP)]
    return {"engine": {"model": model, "max_tokens": 1, "kv_bytes": 256 * 1024**2, "max_model_len": 8192,
                       "load_stats": True, "steps": []},
            "warm_up": [{"prompts": [w]} for w in warm], "timed": [{"prompts": [p]} for p in prompts],
            "fresh": [{"fresh": i, "tokens": args.tokens} for i in range(args.prompts)]}


def fresh_prompt(label: str, step: dict[str, Any]) -> dict[str, Any]:
    """What engine ``label`` serves for a step: a ``fresh`` one is a prompt of its own, which
    no engine stored (engines of a phase share the remote server: one another's would hit)."""
    if "fresh" not in step:
        return step
    seed = 10_000 + 1_000 * (sum(map(ord, label)) % 997) + step["fresh"]
    return {"prompts": [random_token_prompt(step["tokens"], seed=seed, vocab=2000)]}


def measure(args: argparse.Namespace, work: Path, real_speed: bool = True, ssd: bool = True,
            remote: bool = True) -> dict[str, dict[str, Any]]:
    """Each phase's engines side by side (``real_speed``: the unthrottled ones too):
    ``{"ssd": {label: summary}, "remote": {...}}``."""
    common = scenario(args, work)
    out: dict[str, dict[str, Any]] = {}
    if ssd:
        out["ssd"] = _ssd(args, work, common, real_speed)
    if remote:
        out["remote"] = _remote(args, work, common, real_speed)
    return out


def _speeds(args: argparse.Namespace, real_speed: bool) -> list[str]:
    return ["real speed", f"{args.read_mib} MiB/s"][0 if real_speed else 1:]


def _ssd(args: argparse.Namespace, work: Path, common: dict[str, Any], real_speed: bool) -> dict[str, Any]:
    with ThrottledDisk(work / "disk", read_bps=args.read_mib << 20, size_mib=args.disk_mib) as disk:
        tier = {**DRAM, "ssd.capacity": f"{args.ssd_mib}MiB"}
        writer = {**tier, "ssd.path": str(disk.mount / "ssd"), "load.policy": "always"}
        run_in_subprocess({**common["engine"], "steps": common["warm_up"] + common["timed"], "kvstrata": writer},
                          env=ENV, timeout=1800)
        with _Engines(work, common) as engines:
            engines.start_alone()
            engines.start("kvstrata, nothing to hit", {**DRAM, "ssd.capacity": 0})
            for speed in _speeds(args, real_speed):
                for policy in ("always", "measured"):
                    label = f"{policy}, SSD {speed}"
                    copy = disk.mount / f"ssd-{len(engines.running)}"  # a tier's directory is one server's
                    shutil.copytree(disk.mount / "ssd", copy)
                    cfg = {**tier, "ssd.path": str(copy), "load.policy": policy}
                    with contextlib.nullcontext() if speed == "real speed" else disk.throttled():
                        engines.start(label, cfg)  # a throttled engine stays in the cgroup
            disk.drop_cache()  # the warm-up's loads read the device too: the tier's first samples
            return engines.run(before_timed=disk.drop_cache)


def _remote(args: argparse.Namespace, work: Path, common: dict[str, Any], real_speed: bool) -> dict[str, Any]:
    with ValkeyServer(maxmemory="1gb") as server:
        tier = {**DRAM, "ssd.capacity": 0, "remote.secret_file": secret_file(work)}
        run_in_subprocess({**common["engine"], "steps": common["warm_up"] + common["timed"],
                           "kvstrata": {**tier, "remote.url": server.url, "load.policy": "always"}},
                          env=ENV, timeout=1800)
        with SlowProxy(server.port, bps=args.read_mib << 20) as proxy, _Engines(work, common) as engines:
            engines.start_alone()
            slow = f"redis://127.0.0.1:{proxy.port}/0"
            for speed in _speeds(args, real_speed):
                for policy in ("always", "measured"):
                    url = server.url if speed == "real speed" else slow
                    engines.start(f"{policy}, remote {speed}", {**tier, "remote.url": url, "load.policy": policy})
            return engines.run()


class _Engines:
    """The engines of one phase, started one at a time, then run side by side; closed on exit."""

    def __init__(self, work: Path, common: dict[str, Any]) -> None:
        self.work, self.common = work, common
        self.running: dict[str, EngineProcess] = {}

    def __enter__(self) -> "_Engines":
        return self

    def __exit__(self, *exc: object) -> None:
        for engine in self.running.values():
            engine.close()

    def start(self, label: str, kvstrata: dict[str, Any] | None = None) -> None:
        spec = {**self.common["engine"], **({"kvstrata": kvstrata} if kvstrata is not None else {})}
        log = self.work / f"engine-{len(list(self.work.glob('engine-*.log')))}.log"  # across phases
        self.running[label] = EngineProcess(spec, log, env=ENV)

    def start_alone(self) -> None:
        for label in ALONES:
            self.start(label)

    def run(self, before_timed: Any = None) -> dict[str, Any]:
        """The warm-up, the idle, then the timed prompts, the engines taking turns; each
        engine's summary against vLLM alone's (the mean of its processes, prompt by prompt)."""
        take_turns(self.running, self.common["warm_up"], pause_s=PAUSE_S)
        time.sleep(IDLE_S)
        if before_timed is not None:
            before_timed()
        both = [step for pair in zip(self.common["timed"], self.common["fresh"]) for step in pair]
        ran = take_turns(self.running, both, pause_s=PAUSE_S, first=len(self.common["warm_up"]), each=fresh_prompt)
        timed = {label: steps[0::2] for label, steps in ran.items()}
        alone = [statistics.fmean(s["seconds"] for s in steps) for steps in zip(*(timed[a] for a in ALONES))]
        return {label: {**summary(steps, alone, timed[ALONES[0]]), **own(steps, ran[label][1::2])}
                for label, steps in timed.items()}


def summary(steps: list[dict[str, Any]], base: list[float], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's timed prompts against vLLM alone's TTFTs ``base``, prompt by prompt: the
    ratio of their means, the median and quartiles of the per-prompt ratios; its outputs
    against ``reference``'s."""
    ttft = [s["seconds"] for s in steps]
    ratios = sorted(a / b for a, b in zip(ttft, base))
    return {"mean_ttft_s": statistics.fmean(ttft), "median_ttft_s": statistics.median(ttft), "ttft_s": ttft,
            "mean_ratio": statistics.fmean(ttft) / statistics.fmean(base),
            "ratio": {"median": statistics.median(ratios), "q1": ratios[len(ratios) // 4],
                      "q3": ratios[(3 * len(ratios)) // 4]},
            "steps": [{k: s.get(k) for k in ("seconds", "external_hits", "cached")} for s in steps],
            "loaded_tokens": sum(s["external_hits"] for s in steps), "load": steps[-1].get("load"),
            "outputs_identical": all(a["tokens"] == b["tokens"] for a, b in zip(steps, reference))}


def own(stored: list[dict[str, Any]], fresh: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's mean TTFT of the stored prompts against its own of the fresh ones (which
    no tier holds: every engine computes them), served alternately: what a hit costs in
    this engine against computing a prompt, whatever this process's own speed."""
    ttft = [s["seconds"] for s in fresh]
    return {"fresh_ttft_s": ttft, "own_ratio": statistics.fmean(s["seconds"] for s in stored) / statistics.fmean(ttft)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--read-mib", type=int, default=6, help="the throttled disk's and slow server's rate, MiB/s")
    ap.add_argument("--ssd-mib", type=int, default=512, help="each engine's SSD tier capacity")
    ap.add_argument("--disk-mib", type=int, default=4096, help="the loop device (a sparse file): every copy fits")
    ap.add_argument("--slow-only", action="store_true", help="leave out the tiers at their real speed")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"bench_load_policy: {why}", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvstrata-bench-load-"))
    out = measure(args, work, real_speed=not args.slow_only)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)  # the model and the engines' logs (kept where it fails)
    print(f"{args.prompts} prompts of {args.tokens} tokens, one at a time, the engines side by side; "
          "TTFT against vLLM alone's for the same prompts")
    for phase, engines in out.items():
        alone = [engines[a]["mean_ttft_s"] for a in ALONES]
        print(f"{phase}: vLLM alone ({len(ALONES)} processes) mean {statistics.fmean(alone) * 1e3:.1f} ms "
              f"({min(alone) * 1e3:.1f}-{max(alone) * 1e3:.1f} ms)")
        for name, r in engines.items():
            decisions = {t: d for t, d in ((r.get("load") or {}).get("decisions") or {}).items() if any(d.values())}
            print(f"  {name:29s} mean {r['mean_ttft_s'] * 1e3:7.1f} ms {r['mean_ratio']:5.2f}x  per prompt: median "
                  f"{r['ratio']['median']:5.2f}x ({r['ratio']['q1']:.2f}-{r['ratio']['q3']:.2f}x)  "
                  f"vs its own fresh prompts {r['own_ratio']:5.2f}x  "
                  f"loaded {r['loaded_tokens']:6d} tokens  decisions {decisions}  identical: {r['outputs_identical']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else list(argv), "results": out},
                                        indent=2) + "\n")
    return 0 if all(r["outputs_identical"] for engines in out.values() for r in engines.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
