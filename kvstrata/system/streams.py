"""Streams and events: the ordering primitives of asynchronous block copies.

A :class:`Stream` runs submitted device work in submission order; an
:class:`Event` recorded on it completes once everything submitted before it
ran. ``stream.wait(event)`` orders later work on ``stream`` after ``event``
without blocking the host. Three implementations share this interface:

* :class:`CudaStreams`: CUDA streams and events through torch (``submit``
  runs the function under ``torch.cuda.stream``, so the kernels it launches
  are queued on that stream; the host never waits);
* :class:`InlineStreams`: the CPU backend, where "device" work is a host
  memcpy: ``submit`` runs the function at once and every event is complete;
* a fake for tests (``tests/fake_streams.py``) that queues work and runs it
  lazily in a seeded order, so that a missing wait produces wrong bytes.

Hot-path rule: the engine's step thread only calls ``query``; ``synchronize``
is for background threads and for shutdown.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

__all__ = ["Event", "Stream", "Streams", "InlineStreams", "CudaStreams", "streams_for", "to_device", "copy_priority",
           "elapsed_s"]


class Event(Protocol):
    def query(self) -> bool:
        """True once the work submitted before :meth:`Stream.record` ran. Never blocks."""

    def synchronize(self) -> None:
        """Block the calling thread until :meth:`query` would be True (never on the step thread)."""


class Stream(Protocol):
    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn``'s device work on this stream, after everything submitted before."""

    def record(self, timed: bool = False) -> Event:
        """An event that completes when the work submitted so far has run (``timed``: one that
        :func:`elapsed_s` can measure from, where the device keeps times)."""

    def wait(self, event: Event) -> None:
        """Later work on this stream starts only after ``event`` completed (the host does not wait)."""


class Streams(Protocol):
    def current(self) -> Stream:
        """The stream the engine's forward pass runs on, as of now."""

    def new_stream(self, *, low_priority: bool) -> Stream:
        """A stream of kvstrata's own (copies at low priority yield to the forward)."""


class _Done:
    """An event that is complete from the start."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _Done()


class _InlineStream:
    def submit(self, fn: Callable[[], None]) -> None:
        fn()

    def record(self, timed: bool = False) -> Event:
        return _DONE

    def wait(self, event: Event) -> None:
        return None


class InlineStreams:
    """Host memory as the device: work runs when submitted, on the calling thread."""

    def __init__(self) -> None:
        self._stream = _InlineStream()

    def current(self) -> Stream:
        return self._stream

    def new_stream(self, *, low_priority: bool) -> Stream:
        return self._stream


class _CudaStream:
    __slots__ = ("torch_stream",)

    def __init__(self, torch_stream: Any) -> None:
        self.torch_stream = torch_stream

    def submit(self, fn: Callable[[], None]) -> None:
        import torch

        with torch.cuda.stream(self.torch_stream):
            fn()

    def record(self, timed: bool = False) -> Event:
        import torch

        # blocking: the I/O thread's synchronize() sleeps until the copy ran instead of
        # spinning a core (query(), all the step thread calls, is the same either way)
        event = torch.cuda.Event(blocking=True, enable_timing=timed)
        event.record(self.torch_stream)
        return event

    def wait(self, event: Event) -> None:
        if event is not _DONE:
            self.torch_stream.wait_event(event)


class CudaStreams:
    """CUDA streams of one device (torch's; events are ``torch.cuda.Event``)."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def current(self) -> Stream:
        import torch

        return _CudaStream(torch.cuda.current_stream(self.device))

    def new_stream(self, *, low_priority: bool) -> Stream:
        import torch

        least, _greatest = torch.cuda.Stream.priority_range()
        compute = torch.cuda.current_stream(self.device).priority
        priority = copy_priority(least, compute, low_priority=low_priority)
        return _CudaStream(torch.cuda.Stream(device=self.device, priority=priority))


def elapsed_s(start: Event, end: Event) -> float | None:
    """Device seconds between two completed timed events of one stream (CUDA's own clock:
    the work between them, not the time it waited in the queue before ``start``); None
    where the device keeps no times (inline work: time it on the host instead)."""
    measure = getattr(start, "elapsed_time", None)
    if measure is None or not end.query():
        return None
    try:
        return float(measure(end)) / 1e3
    except RuntimeError:  # an event recorded without timing
        return None


def copy_priority(least: int, compute: int, *, low_priority: bool) -> int:
    """The CUDA priority of a copy stream: never above the compute stream's.

    CUDA: lower numbers are higher priorities, ``least`` (0, the default, which
    vLLM's compute stream runs at) is the lowest there is. Stores run at ``least``:
    below the forward when the engine raised its compute stream, else equal (nothing
    is lower than the default; the thread-block cap of the copy kernels is what leaves
    the SMs to the forward then). Loads run at the compute stream's priority: a load
    that preempted the forward would slow every running request to let one waiting
    request in a step earlier."""
    if low_priority:
        return least
    return min(compute, least)


def streams_for(device: Any) -> "Streams":
    """CUDA streams for a CUDA device, inline execution for anything else."""
    import torch

    return CudaStreams(device) if torch.device(device).type == "cuda" else InlineStreams()


def to_device(values: Any, device: Any) -> Any:
    """An int64 index (a list or a CPU tensor) on ``device``, copied without a host wait.

    A CUDA copy from pageable host memory first synchronises its stream (CUDA's
    documented behaviour for pageable H2D ``cudaMemcpyAsync``), and kvstrata's copy
    streams are parked behind the compute stream's events: the step thread would wait
    for the forward. The index goes through a page-locked buffer instead (torch's
    caching host allocator keeps it alive until the copy ran)."""
    import torch

    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    dev = torch.device(device)
    if dev.type != "cuda" or t.device == dev:
        return t.to(dev)
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)
