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

__all__ = ["Event", "Stream", "Streams", "InlineStreams", "CudaStreams", "streams_for"]


class Event(Protocol):
    def query(self) -> bool:
        """True once the work submitted before :meth:`Stream.record` ran. Never blocks."""

    def synchronize(self) -> None:
        """Block the calling thread until :meth:`query` would be True (never on the step thread)."""


class Stream(Protocol):
    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn``'s device work on this stream, after everything submitted before."""

    def record(self) -> Event:
        """An event that completes when the work submitted so far has run."""

    def wait(self, event: Event) -> None:
        """Later work on this stream starts only after ``event`` completed (the host does not wait)."""


class Streams(Protocol):
    def current(self) -> Stream:
        """The stream the engine's forward pass runs on, as of now."""

    def new_stream(self, *, low_priority: bool) -> Stream:
        """A stream of tierkv's own (copies at low priority yield to the forward)."""


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

    def record(self) -> Event:
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

    def record(self) -> Event:
        import torch

        event = torch.cuda.Event()
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

        # torch: lower numbers are higher priorities; 0 is the default (and lowest) priority.
        low, high = torch.cuda.Stream.priority_range()
        return _CudaStream(torch.cuda.Stream(device=self.device, priority=low if low_priority else high))


def streams_for(device: Any) -> "Streams":
    """CUDA streams for a CUDA device, inline execution for anything else."""
    import torch

    return CudaStreams(device) if torch.device(device).type == "cuda" else InlineStreams()
