"""A fake device for the copy tests: streams that run their work late, in a seeded order.

No GPU exists on the CI machines, so the ordering that CUDA streams and events
give the copier is reproduced here, adversarially: work submitted to a
:class:`FakeStream` is only queued; it runs when the seeded scheduler picks
that stream (each ``query`` may advance a few operations, ``run_all``
finishes everything). A stream's head operation that waits on an event not
yet complete blocks only that stream. So a missing ``wait`` lets a copy run
before the bytes it should copy were written, or after they were
overwritten, and the test sees wrong bytes.

``synchronize`` from the thread marked as the step thread is recorded as a
violation (the hot path must only poll).
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["FakeDevice", "FakeStream", "FakeEvent", "FakeIO", "FakeRows", "pattern"]


class FakeEvent:
    def __init__(self, device: "FakeDevice") -> None:
        self.device = device
        self.done = False

    def query(self) -> bool:
        dev = self.device
        with dev.lock:
            dev.queries += 1
            for _ in range(dev.rng.randrange(dev.max_advance + 1)):
                if self.done or not dev.step():
                    break
            return self.done

    def synchronize(self) -> None:
        dev = self.device
        if threading.get_ident() == dev.step_thread and not dev.in_io:
            dev.violations.append("synchronize on the step thread")
        with dev.lock:
            while not self.done:
                if not dev.step():
                    raise AssertionError("deadlock: an event waits on work that can never run")


class FakeStream:
    def __init__(self, device: "FakeDevice", name: str) -> None:
        self.device = device
        self.name = name
        self.ops: list[tuple[str, object]] = []

    def submit(self, fn: Callable[[], None]) -> None:
        with self.device.lock:
            self.ops.append(("run", fn))

    def record(self, timed: bool = False) -> FakeEvent:
        event = FakeEvent(self.device)
        with self.device.lock:
            self.ops.append(("record", event))
        return event

    def wait(self, event: object) -> None:
        if isinstance(event, FakeEvent):
            with self.device.lock:
                self.ops.append(("wait", event))

    def runnable(self) -> bool:
        if not self.ops:
            return False
        kind, arg = self.ops[0]
        return kind != "wait" or arg.done  # type: ignore[union-attr]

    def run_one(self) -> None:
        kind, arg = self.ops.pop(0)
        if kind == "run":
            arg()  # type: ignore[operator]
        elif kind == "record":
            arg.done = True  # type: ignore[union-attr]


class _FakeFuture(Future):  # type: ignore[type-arg]
    """A future of the fake I/O lane: polling it may advance the device, waiting runs it."""

    def __init__(self, device: "FakeDevice") -> None:
        super().__init__()
        self.device = device

    def done(self) -> bool:
        dev = self.device
        with dev.lock:
            for _ in range(dev.rng.randrange(dev.max_advance + 1)):
                if super().done() or not dev.step():
                    break
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        dev = self.device
        with dev.lock:
            while not super().done():
                if not dev.step():
                    raise AssertionError("deadlock: an I/O job waits on work that can never run")
        return super().result(0)


class FakeIO:
    """The copier's I/O thread, as one more lane of the seeded scheduler (first in, first out;
    a job that waits for a device event runs that device work meanwhile)."""

    def __init__(self, device: "FakeDevice") -> None:
        self.device = device
        self.name = "io"
        self.ops: list[tuple[_FakeFuture, Callable[..., Any], tuple[Any, ...]]] = []
        self.busy = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:  # type: ignore[type-arg]
        fut = _FakeFuture(self.device)
        with self.device.lock:
            self.ops.append((fut, fn, args))
        return fut

    def shutdown(self, wait: bool = True) -> None:
        return None

    def runnable(self) -> bool:
        return bool(self.ops) and not self.busy

    def run_one(self) -> None:
        fut, fn, args = self.ops.pop(0)
        dev = self.device
        self.busy, outer = True, dev.in_io
        dev.in_io = True
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 (handed to whoever waits, as a thread pool does)
            fut.set_exception(exc)
        finally:
            self.busy, dev.in_io = False, outer


class FakeDevice:
    """Streams sharing one lock and one seeded scheduler; ``kv`` is the device's KV blocks."""

    def __init__(self, seed: int, num_blocks: int, block_nbytes: int, *, max_advance: int = 2) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.RLock()
        self.max_advance = max_advance
        self.compute = FakeStream(self, "compute")
        self.kv = np.zeros((num_blocks, block_nbytes), dtype=np.uint8)
        self.io = FakeIO(self)
        self.streams: list[Any] = [self.compute, self.io]
        self.in_io = False  # running an I/O job (which models the copier's I/O thread)
        self.step_thread: int | None = None
        self.violations: list[str] = []
        self.queries = 0

    # the kvstrata.system.streams.Streams interface
    def current(self) -> FakeStream:
        return self.compute

    def new_stream(self, *, low_priority: bool) -> FakeStream:
        stream = FakeStream(self, "store" if low_priority else "load")
        self.streams.append(stream)
        return stream

    def step(self) -> bool:
        """Run the head operation of one randomly chosen runnable stream."""
        with self.lock:
            ready = [s for s in self.streams if s.runnable()]
            if not ready:
                return False
            self.rng.choice(ready).run_one()
            return True

    def run_all(self) -> None:
        with self.lock:
            while self.step():
                pass
            stuck = [s.name for s in self.streams if s.ops]
            assert not stuck, f"streams {stuck} wait on events never recorded"

    def write(self, block_id: int, data: np.ndarray) -> None:
        """The forward pass writes a block's KV (queued on the compute stream)."""
        row = np.array(data, copy=True)
        self.compute.submit(lambda: self.kv.__setitem__(block_id, row))


class FakeRows:
    """The copier's device rows over a :class:`FakeDevice`'s ``kv`` (runs inside stream work)."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.block_nbytes = int(device.kv.shape[1])

    def gather(self, block_ids: Sequence[int], dst: np.ndarray, dst_rows: Sequence[int]) -> None:
        for b, r in zip(list(block_ids), list(dst_rows)):
            dst[r] = self.device.kv[b]

    def scatter(self, src: np.ndarray, src_rows: Sequence[int], block_ids: Sequence[int]) -> None:
        for r, b in zip(list(src_rows), list(block_ids)):
            self.device.kv[b] = src[r]

    def staging(self, n: int) -> np.ndarray:
        return np.full((n, self.block_nbytes), 0xEE, dtype=np.uint8)


def pattern(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes a block with ``key`` holds when computed (distinct per key)."""
    seed = int.from_bytes(key[:8].ljust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
