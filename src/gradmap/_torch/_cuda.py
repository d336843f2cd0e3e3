"""CUDA on gradmap's threads: a stream per thread, and the hand-overs between them.

NOTE [CUDA streams on the pool's threads]:
    PyTorch sends the kernels of every thread to one stream (the device's current one) unless
    a thread sets its own, and runs the CUDA work of a backward on one device thread per device.
    So a map on threads whose tensors are on a GPU would run its chunks one after another on
    the device. In a pass of a process that has initialised CUDA (``in_use``: one check per
    pass; a process that never did holds no CUDA tensor, and its passes are as before):
    - each thread that runs chunks of the pass, other than the caller's, runs them under a
      stream of its own (``torch.cuda.stream``, one per thread and device, made on first use,
      kept for the thread's life), on the caller's current device;
    - that stream first waits for an event recorded on the caller's current stream when the
      pass began: the items, the cotangents and ``f``'s tensors the caller made are ready;
    - each chunk ends with its thread's stream synchronised (``Stream.synchronize``), so that
      what it hands to another thread -- results, a chunk's gradients that another thread adds
      in chunk order, a recorded graph that another thread pulls back -- is complete in host
      order, whatever stream reads it next. A block the allocator frees is reused only by the
      stream it was allocated on, and every stream's reads of another's block end before the
      chunk that made them ends, so no ``record_stream`` is needed for what lives through the
      pass (items, cotangents, parameters, records);
    - each chunk runs with ``torch.autograd.set_multithreading_enabled(False)`` (thread-local):
      its pullback runs on the pool thread that claimed it, not on the device thread.
    The caller's own chunks run on its current stream, synchronised the same way at their end.
    One device: tensors on a device other than the caller's current one run on that device's
    current stream, as without gradmap, and are synchronised at the end of the pass only
    through the values on the caller's device that depend on them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch

from .._engine import ThreadContext

__all__ = ["CudaPass", "in_use", "pass_streams"]

T = TypeVar("T")


_local = threading.local()  # .streams: {device index: the thread's own stream}


def in_use() -> bool:
    """Whether this process has initialised CUDA (only then can a map's tensors be on a GPU)."""
    return torch.cuda.is_initialized()


def own_stream(device: int) -> torch.cuda.Stream:
    """The calling thread's own stream on ``device``, made on first use."""
    streams: dict[int, torch.cuda.Stream] | None = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


class CudaPass:
    """The streams of one pass; made in the thread that runs the pass (the caller)."""

    def __init__(self) -> None:
        self.device = torch.cuda.current_device()
        self.caller = threading.get_ident()
        self.start = torch.cuda.Event()
        self.start.record(torch.cuda.current_stream(self.device))

    def context(self, inner: ThreadContext) -> ThreadContext:
        """``inner`` (a thread's context for the pass), inside the thread's own stream."""

        def entered(is_caller: bool) -> AbstractContextManager[object]:
            return self._thread(inner(is_caller))

        return entered

    @contextmanager
    def _thread(self, inner: AbstractContextManager[object]) -> Iterator[None]:
        if threading.get_ident() == self.caller:
            with inner:
                yield
            return
        stream = own_stream(self.device)
        stream.wait_event(self.start)
        with torch.cuda.device(self.device), torch.cuda.stream(stream), inner:
            yield

    def chunk(self, run: Callable[..., T]) -> Callable[..., T]:
        """``run`` (one chunk's work), its pullbacks on its own thread, its stream synchronised
        at its end (NOTE [CUDA streams on the pool's threads])."""

        def ran(*args: Any) -> T:
            try:
                with torch.autograd.set_multithreading_enabled(False):
                    return run(*args)
            finally:
                torch.cuda.current_stream(self.device).synchronize()

        return ran


def pass_streams() -> CudaPass | None:
    """A pass's streams where CUDA is in use, else ``None`` (the CPU path, unchanged)."""
    return CudaPass() if in_use() else None
