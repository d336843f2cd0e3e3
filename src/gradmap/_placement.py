"""Forward placement: run a map's forward in one thread or on the pool, by measurement.

NOTE [forward placement]:
    On CPython with the GIL, a forward made of many small torch ops is held by Python dispatch:
    each op drops and re-takes the GIL, and two threads running such forwards are *slower* than
    one (measured, no gradmap involved: ragged bags 33 -> 44 ms, small bags 104 -> 217, tree 275
    -> 358, neural ODE 1541 -> 2214 on 2 cores). A forward of large ops (one ``nn.GRU`` per
    sequence) releases the GIL for most of its time and runs 2.4x faster on 2 threads. The
    backward is different: the autograd engine runs in C++ without the GIL, so chunk pullbacks
    scale on threads either way.

    So the forward of each map runs either in *one* thread (one of gradmap's pool threads, chunk
    after chunk, while the caller waits: it computes with one intra-op thread as every pool thread
    does, so results are bitwise the same whichever placement ran) or on *many* (the pool), and
    the choice is measured per ``f``:
    - a new ``f`` runs its first forward in one thread, whatever the executor: this learns
      whether ``f`` draws random numbers, and one that does keeps one thread for its forwards
      (NOTE [random numbers per element]);
    - its second forward runs on the pool, timing each thread's CPU time: the *parallelism* of
      the pass is the CPU seconds of all its threads over its wall seconds. A GIL-bound forward
      stays near 1 (only one thread runs at a time); a GIL-free one approaches the thread count.
      At ``PARALLEL_THRESHOLD`` or more, ``f`` keeps the pool; below, one thread;
    - the measurement is repeated every ``REMEASURE`` calls, in case the elements changed.
    On a free-threaded CPython (``sys._is_gil_enabled()`` false) forwards always use the pool.
    A user who passes ``workers`` or an executor forces the pool (from the second call, for an
    ``f`` that draws no random numbers); ``executor="serial"`` or ``workers=1`` forces one
    thread. ``f`` is told apart by its code object (a bound method or ``functools.partial`` by
    its function's), so a lambda made anew each step keeps its history.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Placement", "placement_for"]

PARALLEL_THRESHOLD = 1.35
REMEASURE = 50

_lock = threading.Lock()
_history: dict[Any, _History] = {}
_MAX_HISTORY = 1024


def _gil_enabled() -> bool:
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


def _key(f: Any) -> Any:
    while isinstance(f, functools.partial):
        f = f.func
    f = getattr(f, "__func__", f)
    code = getattr(f, "__code__", None)
    if code is not None:
        return code
    call = getattr(type(f), "forward", None) or type(f).__dict__.get("__call__")
    return getattr(call, "__code__", type(f))


class _History:
    __slots__ = ("calls", "parallel", "random")

    def __init__(self) -> None:
        self.calls = 0
        self.parallel: bool | None = None
        self.random = False


class Placement:
    """Where one map's forward runs, and what it learns about ``f``."""

    def __init__(self, many: bool, history: _History | None, measure: bool) -> None:
        self.many = many
        self._history = history
        self._measure = measure
        self._cpu = 0.0
        self._cpu_lock = threading.Lock()

    @contextmanager
    def thread(self) -> Iterator[None]:
        """Entered by each thread of a measured pass, around its share of the work."""
        if not self._measure:
            yield
            return
        start = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - start
            with self._cpu_lock:
                self._cpu += spent

    def timed(self, run: Callable[[], Any]) -> Any:
        """Run a forward pass; record its parallelism if it was measured."""
        if not self._measure:
            return run()
        start = time.perf_counter()
        out = run()
        wall = time.perf_counter() - start
        if wall > 0:
            self.record(self._cpu / wall)
        return out

    def record(self, parallelism: float) -> None:
        """Keep the pool for later calls if a measured pass reached ``PARALLEL_THRESHOLD``."""
        if self._history is not None:
            self._history.parallel = parallelism >= PARALLEL_THRESHOLD

    def learned_random(self, drew: bool) -> None:
        if drew and self._history is not None:
            self._history.random = True


def placement_for(f: Any, *, forced_many: bool, forced_one: bool) -> Placement:
    """Choose where the forward of a map of ``f`` runs (NOTE [forward placement])."""
    if forced_one:
        return Placement(False, None, False)
    key = _key(f)
    with _lock:
        history = _history.get(key)
        if history is None:
            if len(_history) >= _MAX_HISTORY:
                _history.clear()
            history = _history[key] = _History()
        history.calls += 1
        calls = history.calls
    if history.random or calls == 1:
        return Placement(False, history, False)
    if forced_many or not _gil_enabled():
        return Placement(True, history, False)
    if history.parallel is None or calls % REMEASURE == 0:
        return Placement(True, history, True)
    return Placement(history.parallel, history, False)
