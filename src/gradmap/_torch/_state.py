"""The caller's thread-local PyTorch state, carried into the threads that run its chunks.

NOTE [thread-local state]:
    Grad mode, inference mode and autocast are per thread in PyTorch: a pool thread starts with
    grad mode on, no autocast, whatever the caller set. A map must behave as the loop in the
    caller's thread would, so each thread that works on a pass enters the caller's state first and
    leaves it (restoring its own) when the pass is done. The default dtype and anomaly mode are
    process-wide and need nothing.

NOTE [intra-op threads]:
    ``torch.set_num_threads`` is per thread under OpenMP (the CPU build's backend): a pool thread
    keeps its own setting. With ``workers`` threads running chunks, each thread (the caller
    included, for the duration of the pass) gets ``max(1, cores // workers)`` intra-op threads (and
    never more than the caller's own setting), so that workers x intra-op threads never exceeds
    the cores. With the default ``workers`` (all cores) that is one intra-op thread per worker. The
    caller's own setting is restored afterwards; a map on one worker leaves it alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from .._executors import available_cores

__all__ = ["ThreadState"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


class ThreadState:
    """A snapshot of the caller's state, entered by every thread of one pass."""

    def __init__(self, workers: int, grad_enabled: bool | None = None) -> None:
        self.grad_enabled = torch.is_grad_enabled() if grad_enabled is None else grad_enabled
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (dev, torch.get_autocast_dtype(dev))
            for dev in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(dev)
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        # Never more than the caller allows itself; None leaves a lone thread's setting alone.
        self.intra_op_threads: int | None = (
            None
            if workers <= 1
            else max(1, min(torch.get_num_threads(), available_cores() // workers))
        )

    @contextmanager
    def enter(self, is_caller: bool) -> Iterator[None]:
        """Enter the snapshot in this thread; the caller's thread only gets its thread budget."""
        budget = self.intra_op_threads
        previous_threads = torch.get_num_threads()
        change_threads = budget is not None and budget != previous_threads
        if change_threads:
            assert budget is not None
            torch.set_num_threads(budget)
        try:
            if is_caller:
                yield
                return
            with ExitStack() as stack:
                if self.inference:
                    stack.enter_context(torch.inference_mode())
                else:
                    stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
                for dev, dtype in self.autocast:
                    stack.enter_context(
                        torch.autocast(dev, dtype=dtype, cache_enabled=self.autocast_cache)
                    )
                yield
        finally:
            if change_threads:
                torch.set_num_threads(previous_threads)
