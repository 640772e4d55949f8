"""SGLang's HiCache storage: kvstrata beside SGLang's own ``file`` backend (``HiCacheFile``), same run.

Both are attached to SGLang 0.5.23's own ``HiCacheController`` over its own host pool
(tests/sglang_env.py: the storage paths run on a CPU; no engine runs) and get the same pages
under the same keys, through the controller's backup and prefetch threads in its batches of
128 pages: kvstrata as ``--hicache-storage-backend dynamic`` with ``interface_v1`` (zero
copy) and without it (the generic path ``file`` uses too), ``file`` as ``--hicache-storage-backend file``.

* write and read throughput (best of ``--rounds``, the backends taking turns, fresh
  directories each round; reads best of 3 a round): ``write`` is until the controller's
  backup ack, ``durable``
  adds kvstrata's ``flush`` (its SSD tier syncs; ``file`` never syncs, so it has none);
* hits after a restart: a new controller, a fresh host pool, the same directory;
* capacity exceeded: four times the capacity (256 pages) written (``file``: ``max_size``);
* one damaged page: a byte flipped on disk in page 5 of 16, then a prefetch;
* a process SIGKILLed mid-write: a child backs up two batches of 128 pages, then four more
  in one backup, and is killed inside it; what each serves after the restart, checked
  against the pages written.

    .venv/bin/python benchmarks/bench_sglang.py [--pages 384] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import sglang_env as env  # noqa: E402

GEOMETRY = {"layers": 8, "heads": 4, "head_dim": 128, "page_size": 16}  # bf16: 256 KiB pages
BATCH = 128
READS = 3  # prefetches of the same pages per round
BACKENDS = ("kvstrata", "kvstrata-generic", "file")


def extra(kind: str, where: Path, capacity: int | None = None) -> dict[str, Any]:
    """The extra config SGLang gets for ``kind`` storing under ``where`` (``capacity`` bytes)."""
    if kind == "file":
        out: dict[str, Any] = {"file_storage_path": str(where)}
        if capacity is not None:
            out["max_size"] = str(capacity)
        return out
    return {**env.DYNAMIC, "interface_v1": int(kind == "kvstrata"), "ssd.path": str(where),
            "ssd.capacity": capacity or 8 * 1024**3, "model.id": "bench-model"}


def attach(kind: str, where: Path, host: Any, capacity: int | None = None) -> Any:
    return env.controller(extra(kind, where, capacity), host, model_name="bench-model",
                          backend="file" if kind == "file" else "dynamic")


def new_host(pages: int) -> Any:
    g = GEOMETRY
    return env.host_pool("page_first", layers=g["layers"], heads=g["heads"], head_dim=g["head_dim"],
                         page_size=g["page_size"], device_tokens=pages * g["page_size"], ratio=2.5)


def fill_pages(host: Any, indices: Any, first: int) -> None:
    """Page ``first + i`` of a run gets the bytes seeded by its number: anyone can check it."""
    import torch

    for i, start in enumerate(indices[::host.page_size].tolist()):
        gen = torch.Generator().manual_seed(10_000 + first + i)
        page = host.get_data_page(start, flat=False)
        noise = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=gen)
        host.set_from_flat_data_page(start, noise.view(host.dtype))


def tokens_of(pages: int, salt: int) -> list[int]:
    ps = GEOMETRY["page_size"]
    return [(salt * 100_003 + i) % 32_000 for i in range(pages * ps)]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def close(ctl: Any) -> None:
    ctl.detach_storage_backend()


# ------------------------------------------------------------------ throughput and restart

def throughput_round(kind: str, where: Path, pages: int, salt: int) -> dict[str, Any]:
    """Write ``pages`` pages, read them back, restart, read them again."""
    host = new_host(pages)
    ps = host.page_size
    src = host.alloc(pages * ps)
    fill_pages(host, src, 0)
    tokens = tokens_of(pages, salt)
    ctl = attach(kind, where, host)
    stored, write_s = timed(lambda: env.backup(ctl, src, tokens))
    flush_s = timed(ctl.storage_backend.flush)[1] if kind != "file" else 0.0
    read_s, exact = float("inf"), True
    for _ in range(READS):  # reads are short: the best of a few, so a busy moment does not decide
        (got, dst, _), seconds = timed(lambda: env.prefetch(ctl, host, tokens))
        read_s = min(read_s, seconds)
        exact = exact and got == pages * ps and env.page_bytes(host, dst) == env.page_bytes(host, src)
        host.free(dst)
    close(ctl)
    host = new_host(pages)  # a new server: a fresh host pool, the same directory
    ctl = attach(kind, where, host)
    (again, dst2, _), reread_s = timed(lambda: env.prefetch(ctl, host, tokens))
    close(ctl)
    nbytes = pages * host.get_dummy_flat_data_page().numel() * 2
    return {"stored_pages": stored // ps, "write_gbps": nbytes / write_s / 1e9,
            "durable_gbps": nbytes / (write_s + flush_s) / 1e9, "read_gbps": nbytes / read_s / 1e9,
            "byte_exact": exact, "hit_after_restart": again / (pages * ps),
            "read_after_restart_gbps": nbytes / reread_s / 1e9 if again else 0.0}


def throughput(base: Path, pages: int, rounds: int) -> dict[str, dict[str, Any]]:
    best: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        for kind in order:
            where = base / f"tp-{kind}-{r}"
            out = throughput_round(kind, where, pages, salt=r)
            shutil.rmtree(where, ignore_errors=True)
            keep = best.setdefault(kind, out)
            for k, v in out.items():
                keep[k] = max(keep[k], v) if k.endswith("gbps") else keep[k] and v if isinstance(v, bool) else v
    return best


# ------------------------------------------------------------------ capacity

def disk_bytes(where: Path) -> int:
    return sum(p.stat().st_size for p in where.rglob("*") if p.is_file())


def capacity_case(kind: str, where: Path, batches: int = 8) -> dict[str, Any]:
    """Four times the capacity (two batches) written, 128 pages a backup, the pages of one
    host batch under new keys each time: what is kept and what it costs."""
    host = new_host(2 * BATCH)
    ps = host.page_size
    nbytes = host.get_dummy_flat_data_page().numel() * 2
    cap_pages = 2 * BATCH
    ctl = attach(kind, where, host, capacity=cap_pages * nbytes)
    src = host.alloc(BATCH * ps)
    fill_pages(host, src, 0)
    tokens = tokens_of(batches * BATCH, salt=99)
    keys = env.sglang().utils.get_storage_hash_str(tokens, None, page_size=ps)
    acked, failed = 0, 0
    for lo in range(0, len(keys), BATCH):
        done = env.backup(ctl, src, tokens[lo * ps:(lo + BATCH) * ps], keys[lo:lo + BATCH]) // ps
        acked += done
        failed += done < BATCH
    if kind != "file":
        ctl.storage_backend.flush()
    held = [ctl.storage_backend.exists(k) for k in keys]
    newest = sum(held[-cap_pages // 2:])
    if kind == "file":
        records = sum(p.stat().st_size for p in where.glob("*.bin"))
    else:
        records = ctl.storage_backend.get_stats().kvstrata["ssd"]["current_bytes"]
    close(ctl)
    cap = cap_pages * nbytes
    return {"capacity_pages": cap_pages, "written_pages": len(keys), "acked_pages": acked, "failed_backups": failed,
            "held_pages": sum(held), "newest_half_capacity_held": f"{newest}/{cap_pages // 2}",
            "page_bytes_over_capacity": records / cap, "file_bytes_over_capacity": disk_bytes(where) / cap}


# ------------------------------------------------------------------ a damaged page

def damage(where: Path, page: bytes, file_key: str | None) -> str:
    """Flip one byte of ``page`` where the backend keeps it; where that was."""
    if file_key is not None:
        (path,) = [p for p in where.iterdir() if p.name.startswith(file_key) and p.name.endswith(".bin")]
        candidates = [path]
    else:
        candidates = sorted(p for p in where.rglob("*") if p.name in ("blocks.dat", "data.mdb"))
    for path in candidates:
        data = path.read_bytes()
        at = data.find(page[:256])
        if at >= 0:
            with open(path, "r+b") as f:
                f.seek(at + 1000)
                f.write(bytes([data[at + 1000] ^ 0x10]))
            return path.name
    raise RuntimeError(f"page not found on disk under {where}")


def damaged_case(kind: str, where: Path) -> dict[str, Any]:
    n, bad = 16, 5
    host = new_host(64)
    ps = host.page_size
    ctl = attach(kind, where, host)
    src = host.alloc(n * ps)
    fill_pages(host, src, 0)
    written = env.page_bytes(host, src)
    tokens = tokens_of(n, salt=7)
    keys = env.sglang().utils.get_storage_hash_str(tokens, None, page_size=ps)
    env.backup(ctl, src, tokens)
    if kind != "file":
        ctl.storage_backend.flush()
    where_hit = damage(where, written[bad], keys[bad] if kind == "file" else None)
    got, dst, _ = env.prefetch(ctl, host, tokens)
    served = env.page_bytes(host, dst)[:got // ps] if dst is not None else []  # what arrived
    wrong = [i for i, b in enumerate(served) if b != written[i]]
    counted = None
    if kind != "file":
        ctl.storage_backend.flush()  # the bad record is deleted (and counted) on the SSD writer's thread
        counted = ctl.storage_backend.get_stats().kvstrata["corrupt_blocks"]["ssd"]
    close(ctl)
    return {"damaged": f"page {bad} of {n} ({where_hit})", "served_pages": got // ps, "served_wrong_pages": wrong,
            "counted_corrupt": counted}


# ------------------------------------------------------------------ SIGKILL mid-write

def child_write(kind: str, where: str, pages: int) -> None:
    """The child: back up ``pages`` pages, 128 a batch, saying after each batch how many
    the controller acked (the parent kills it inside the third)."""
    host = new_host(pages)
    ps = host.page_size
    ctl = attach(kind, Path(where), host)
    tokens = tokens_of(pages, salt=3)
    keys = env.sglang().utils.get_storage_hash_str(tokens, None, page_size=ps)
    src = host.alloc(pages * ps)
    fill_pages(host, src, 0)
    print("ready", flush=True)
    acked = 0
    for lo in range(0, 2 * BATCH, BATCH):
        acked += env.backup(ctl, src[lo * ps:(lo + BATCH) * ps], tokens[lo * ps:(lo + BATCH) * ps],
                            keys[lo:lo + BATCH]) // ps
        print(f"acked {acked}", flush=True)
    print("rest", flush=True)  # the rest in one backup (batches of 128 inside): long enough to be killed in
    acked += env.backup(ctl, src[2 * BATCH * ps:], tokens[2 * BATCH * ps:], keys[2 * BATCH:]) // ps
    print(f"acked {acked}", flush=True)
    time.sleep(60)


def killed_case(kind: str, where: Path, pages: int, kill_after_s: float) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(where), str(pages)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    acked = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("acked"):
            acked = int(line.split()[1])
        if line.startswith("rest") or acked == pages:
            time.sleep(kill_after_s)  # two batches acked: killed while it writes the rest
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    strays = [p for p in where.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    host = new_host(pages)
    ps = host.page_size
    ctl = attach(kind, where, host)
    got, dst, _ = env.prefetch(ctl, host, tokens_of(pages, salt=3))
    expected = new_host(pages)
    ref = expected.alloc(pages * ps)
    fill_pages(expected, ref, 0)
    want = env.page_bytes(expected, ref)
    served = env.page_bytes(host, dst)[:got // ps] if dst is not None else []
    wrong = sum(b != want[i] for i, b in enumerate(served))
    out = {"acked_before_kill": acked, "served_after_restart": got // ps}
    if kind != "file":  # an unclean close: the SSD tier verifies its records in the background first
        if dst is not None:
            host.free(dst)
        ready_s = timed(lambda: ctl.storage_backend.store.executor.persistent.wait_ready(60))[1]
        got, dst, _ = env.prefetch(ctl, host, tokens_of(pages, salt=3))
        late = env.page_bytes(host, dst)[:got // ps] if dst is not None else []
        wrong += sum(b != want[i] for i, b in enumerate(late))
        out.update(recovery_s=ready_s, served_after_recovery=got // ps)
    close(ctl)
    left = [p for p in where.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    return {**out, "served_wrong": wrong, "stray_tmp_files": len(strays),
            "stray_tmp_bytes": sum(p.stat().st_size for p in strays), "stray_tmp_files_after_restart": len(left)}


# ------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=384, help="pages per write (256 KiB each)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kill-after", type=float, default=0.05, help="seconds into the child's last backup")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one under /tmp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only-killed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=3, metavar=("KIND", "DIR", "PAGES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    import logging

    logging.disable(logging.WARNING)  # both backends log each miss; the figures say it
    if args.child:
        child_write(args.child[0], args.child[1], int(args.child[2]))
        return
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-sglang-"))
    started = time.perf_counter()
    out: dict[str, Any] = {"pages": args.pages, "page_bytes": 2 * GEOMETRY["layers"] * GEOMETRY["page_size"]
                           * GEOMETRY["heads"] * GEOMETRY["head_dim"] * 2}
    phases: dict[str, float] = {}

    def phase(name: str, fn: Callable[[], Any]) -> None:
        out[name], phases[name] = timed(fn)

    if not args.only_killed:
        phase("throughput", lambda: throughput(base, args.pages, args.rounds))
        phase("capacity", lambda: {k: capacity_case(k, base / f"cap-{k}") for k in ("kvstrata", "file")})
        phase("damaged", lambda: {k: damaged_case(k, base / f"bad-{k}") for k in ("kvstrata", "file")})
    killed_pages = 6 * BATCH  # two batches, then four in one backup, killed inside it
    phase("killed", lambda: {k: killed_case(k, base / f"kill-{k}", killed_pages, args.kill_after)
                             for k in ("kvstrata", "file")})
    out["seconds"] = time.perf_counter() - started
    out["phase_seconds"] = phases
    shutil.rmtree(base, ignore_errors=True)
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def report(out: dict[str, Any]) -> None:
    tp = out.get("throughput", {})
    f = tp.get("file")
    print(f"{out['pages']} pages of {out['page_bytes'] // 1024} KiB, batches of {BATCH}; best of the rounds")
    print(f"{'backend':18} {'write GB/s':>10} {'durable':>8} {'read GB/s':>10} {'exact':>6} {'restart hits':>12}"
          f" {'restart read':>12} {'write/file':>10} {'read/file':>9}")
    for kind, r in tp.items() if f else ():
        print(f"{kind:18} {r['write_gbps']:10.3f} {r['durable_gbps']:8.3f} {r['read_gbps']:10.3f} "
              f"{str(r['byte_exact']):>6} {r['hit_after_restart']:12.0%} {r['read_after_restart_gbps']:12.3f}"
              f" {r['write_gbps'] / f['write_gbps']:9.2f}x {r['read_gbps'] / f['read_gbps']:8.2f}x")
    for case in ("capacity", "damaged", "killed"):
        for kind, r in out.get(case, {}).items():
            print(f"{case:9} {kind:9} " + ", ".join(f"{k}={v if not isinstance(v, float) else round(v, 3)}"
                                                    for k, v in r.items()))
    print(f"{out['seconds']:.1f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in out["phase_seconds"].items()) + ")")


if __name__ == "__main__":
    main()
