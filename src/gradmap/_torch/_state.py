"""The caller's thread-local PyTorch state, carried into the threads that run its chunks.

NOTE [thread-local state]:
    Grad mode, inference mode and autocast are per thread in PyTorch: a pool thread starts with
    grad mode on, no autocast, whatever the caller set. A map must behave as the loop in the
    caller's thread would, so each thread that works on a pass enters the caller's state first and
    leaves it (restoring its own) when the pass is done. The default dtype and anomaly mode are
    process-wide and need nothing.

NOTE [intra-op threads]:
    ``torch.set_num_threads`` is per thread under OpenMP (the CPU build's backend). gradmap's own
    pool threads run PyTorch ops on one intra-op thread, set once when a thread first works on a
    chunk and kept for its life; the parallelism comes from the workers. Two reasons: ``workers``
    threads times one intra-op thread never oversubscribes the cores with the default ``workers``
    (the available cores); and reductions and matrix products sum in an order that depends on the
    intra-op thread count, so a count that varied with ``workers`` would make gradients differ in
    the last bits between worker counts.

    No other thread's setting is touched: not the caller's (which works on chunks only in a nested
    map, already inside a pool thread, or with a user's executor), not a user executor's threads
    (give such an executor ``initializer=lambda: torch.set_num_threads(1)`` to get the same
    budget). ``torch.set_num_threads`` also stores the value that a *new* thread copies at its
    first parallel op; a short-lived thread sets that back right after a pool thread changes its
    own, so at most a thread starting in that instant, once per pool thread, sees the change.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch

from .._errors import add_note
from .._executors import in_gradmap_pool

__all__ = ["ThreadState"]

_AUTOCAST_DEVICES = ("cpu", "cuda")
INTRA_OP_THREADS = 1


class ThreadState:
    """A snapshot of the caller's state, entered by every thread of one pass."""

    def __init__(self, grad_enabled: bool | None = None) -> None:
        self.grad_enabled = torch.is_grad_enabled() if grad_enabled is None else grad_enabled
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (dev, torch.get_autocast_dtype(dev))
            for dev in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(dev)
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        #: Chunks cast for themselves: autocast's cache off (NOTE [autocast's weight cache]).
        self.own_casts = False

    @contextmanager
    def autocast_context(self) -> Iterator[None]:
        """Exactly the snapshot's autocast in this thread (turning off any other)."""
        wanted = dict(self.autocast)
        with ExitStack() as stack:
            for dev in _AUTOCAST_DEVICES:
                if dev in wanted:
                    cache = self.autocast_cache and not self.own_casts
                    stack.enter_context(torch.autocast(dev, dtype=wanted[dev], cache_enabled=cache))
                elif torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, enabled=False))
            yield

    def explain_recompute(self, exc: BaseException, api: str) -> None:
        """Add to a recompute's error, in a ``create_graph`` backward of a map that ran under
        autocast with its cache of casts on, what that cache did (NOTE [autocast's weight
        cache])."""
        if (
            isinstance(exc, RuntimeError)
            and str(exc).startswith(f"{api}: recomputing f")
            and self.autocast
            and self.autocast_cache
            and not self.own_casts
        ):
            add_note(
                exc,
                f"{api}: the map ran under torch.autocast with its cache of casts on: a weight "
                "is cast once and the cast shared by the elements, which a recompute cannot "
                "reach again. Use torch.autocast(..., cache_enabled=False) around the map (or "
                "remat=True, under which every chunk casts for itself) for a create_graph=True "
                "backward.",
            )

    def enter(self, is_caller: bool) -> AbstractContextManager[None]:
        """Enter the snapshot in this thread; the caller's thread already has it."""
        if in_gradmap_pool():
            threads = torch.get_num_threads()
            if threads != INTRA_OP_THREADS:
                _set_own_intra_op_threads(INTRA_OP_THREADS, threads)
        if is_caller or self._current():
            if self.own_casts:
                return _casts_uncached()
            return nullcontext()  # a chunk's few microseconds count on small elements
        return self._enter()

    def _current(self) -> bool:
        """Whether this thread is in the snapshot's state already."""
        return (
            not self.inference
            and not self.autocast
            and not torch.is_inference_mode_enabled()
            and torch.is_grad_enabled() == self.grad_enabled
            and not any(torch.is_autocast_enabled(dev) for dev in _AUTOCAST_DEVICES)
        )

    @contextmanager
    def _enter(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            stack.enter_context(self.autocast_context())
            yield


@contextmanager
def _casts_uncached() -> Iterator[None]:
    """Autocast's cache of casts off in this thread (NOTE [autocast's weight cache]).

    NOTE [autocast's weight cache]:
        Under ``torch.autocast`` a weight (a leaf that requires grad) is cast to the lower
        precision once per autocast region, and the cast reused: in a map the cast belongs to
        the element, and the chunk, that first made it, and the other chunks reach it as a
        tensor made elsewhere. A recompute (``remat=True``) runs in another region, or finds
        the cast in the cache where its forward made it, and so reaches other tensors than its
        forward did: the recompute failed with an error that blamed a cache ``f`` empties or a
        non-deterministic ``f`` (a helper's ``nn.Linear`` under ``autocast(bfloat16)``; the
        loop works). So under ``remat`` every chunk casts for itself, with the cache off: the
        same values (a cast is exact), each element's cast in its own graph as in a loop
        without the cache, at the cost of a cast per element and weight. Other maps keep the
        cache (a large model's casts per element would cost more than the map gains); a
        ``create_graph=True`` backward of such a map recomputes too, and its error says to
        turn the cache off (``torch.autocast(..., cache_enabled=False)``)."""
    if not torch.is_autocast_cache_enabled():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


def _set_own_intra_op_threads(n: int, inherited: int) -> None:
    """``torch.set_num_threads(n)`` for this thread only: the value new threads copy is set back
    to ``inherited`` from a short-lived thread (see NOTE [intra-op threads])."""
    torch.set_num_threads(n)
    restorer = threading.Thread(target=torch.set_num_threads, args=(inherited,), daemon=True)
    restorer.start()
    restorer.join()
