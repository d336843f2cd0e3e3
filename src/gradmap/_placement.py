"""Forward placement: run a map's forward in one thread or on the pool, by measurement. The
same table keeps the caller's own measurement with worker processes (``caller_seconds``).

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
    the choice is measured per ``f``, as wall seconds per element of the forward pass (for
    ``tsum``, of the pass with the pullbacks that overlap it):
    - a new ``f`` runs its first forward in one thread, whatever the executor (it also learns
      whether ``f`` draws random numbers, swaps a module's parameters, or writes process-wide
      state: one that does keeps one thread for its forwards, NOTE [parameters swapped by
      functional_call], NOTE [random numbers per element], NOTE [process-wide state f
      writes]); then its next ``EXPLORE`` calls alternate, pool then one
      thread, and each side keeps its *best* time per element;
    - from then on it runs on the pool if the pool's best time per element was below ``FASTER``
      times one thread's, else in one thread;
    - every ``REMEASURE`` calls both sides are measured afresh the same way, in case the
      elements changed; and at once when a call on the chosen side takes ``CHANGED`` times more
      or less per element than that side's measurement (the same ``f`` over other elements).
      The bench's ragged and small bags share one ``f``: before counts and changes told their
      histories apart, the pool chosen for ragged bags ran small bags' forwards 1.5x slower
      than one thread until the next ``REMEASURE``.
    Two samples a side, not one: a process's first calls run 1.2-4x slower than its later ones
    (allocator, caches; measured on 2 cores: a GRU ``tsum``'s second call, the only pool sample
    of an earlier rule, took 181 ms where later calls took 165; a ragged bags ``tsum``'s third
    call, 108 ms against 40), and a single slow sample sent a GRU's ``tsum`` to one thread,
    1.65x the loop where the pool gives 2.2x. A sample's noise only ever adds time, so the best
    of two is the better estimate.
    An earlier rule kept the pool when the pass's threads were busy for 1.35x its wall time or
    more; the neural ODE forward (`gradmap bench`) reached that while running 2.6x *slower* than
    in one thread (busy is not fast: two threads trading the GIL burn CPU on the hand-offs), so
    the rule compares the times themselves.
    On a free-threaded CPython (``sys._is_gil_enabled()`` false) forwards always use the pool.
    A user who passes ``workers`` or an executor forces the pool (from the second call, for an
    ``f`` that draws no random numbers); ``executor="serial"`` or ``workers=1`` forces one
    thread. Forced maps keep a history of their own (for the random numbers), so that they do
    not take the measuring turns of the same ``f``'s free maps. ``f`` is told apart by its code
    object (a bound method or ``functools.partial`` by its function's), so a lambda made anew
    each step keeps its history; ``tmap`` and ``tsum``, with a graph or without, and ``remat``
    keep separate histories (their passes differ), and so do maps over element counts more than
    a factor of two apart (other data, most likely).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

__all__ = [
    "Placement",
    "caller_seconds",
    "key_of",
    "learn_caller_seconds",
    "placement_for",
    "tell_of_processes",
    "user_stacklevel",
]

FASTER = 0.9
EXPLORE = 4  # calls after the first: pool, one thread, pool, one thread
REMEASURE = 50
CHANGED = 2.0

_lock = threading.Lock()
os.register_at_fork(after_in_child=_lock._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]
#: What was measured of the maps of each ``f``, by ``(key_of(f), kind)``: the forward's placement
#: on threads (``placement_for``), and the caller's forward seconds per element when it runs
#: chunks beside worker processes (``caller_seconds``).
_history: dict[Any, _History] = {}
_MAX_HISTORY = 1024


def _gil_enabled() -> bool:
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


def key_of(f: Any) -> Any:
    """What tells ``f`` apart across calls: its code object (NOTE [forward placement])."""
    while isinstance(f, functools.partial):
        f = f.func
    f = getattr(f, "__func__", f)
    code = getattr(f, "__code__", None)
    if code is not None:
        return code
    call = getattr(type(f), "forward", None) or type(f).__dict__.get("__call__")
    return getattr(call, "__code__", type(f))


class _History:
    __slots__ = ("caller", "calls", "many", "one", "random", "shared", "swaps", "uniform")
    # calls: maps of this f so far (set back to 1 when its elements changed: measure afresh)

    def __init__(self) -> None:
        self.caller: float | None = None  # latest seconds per element in the caller, processes
        self.calls = 0
        self.one: float | None = None  # best seconds per element in one thread
        self.many: float | None = None  # best seconds per element on the pool
        self.random = False
        self.swaps = False  # f swaps a module's parameters (NOTE [parameters swapped by ...])
        #: What process-wide state f was seen to write (NOTE [process-wide state f writes])
        self.shared: str | None = None
        self.uniform = False  # the latest backward gave every result one cotangent

    @property
    def parallel(self) -> bool | None:
        if self.one is None or self.many is None:
            return None
        return self.many < FASTER * self.one


class Placement:
    """Where one map's forward runs, and what it learns about ``f``."""

    def __init__(
        self,
        many: bool,
        history: _History | None,
        measure: bool,
        watch: bool = False,
        first: bool = False,
    ) -> None:
        self.many = many
        self._history = history
        self._measure = measure
        self._watch = watch  # a chosen side: timed to see whether the elements changed
        #: The first map of its history, in one thread, whose later maps may use many: its
        #: forward is watched for process-wide state (NOTE [process-wide state f writes]).
        self.first = first

    def timed(self, run: Callable[[], Any], n: int) -> Any:
        """Run a forward pass of ``n`` elements; record its time if it was measured."""
        if not (self._measure or self._watch):
            return run()
        start = time.perf_counter()
        out = run()
        if n:
            per_element = (time.perf_counter() - start) / n
            if self._measure:
                self.record(per_element)
            else:
                self._check(per_element)
        return out

    def record(self, per_element: float) -> None:
        """Record a measured pass's seconds per element."""
        history = self._history
        if history is None:
            return
        if self.many:
            history.many = per_element if history.many is None else min(history.many, per_element)
        else:
            history.one = per_element if history.one is None else min(history.one, per_element)

    def _check(self, per_element: float) -> None:
        """After a pass on the chosen side: elements that now take ``CHANGED`` times more or
        less per element than that side's measurement are others; measure both sides again."""
        history = self._history
        if history is None:
            return
        known = history.many if self.many else history.one
        if known is None or known / CHANGED <= per_element <= known * CHANGED:
            return
        with _lock:
            history.calls = 1  # the next calls measure both sides afresh
            history.one = history.many = None

    @property
    def held_by_gil(self) -> bool:
        """Whether this map's forward runs in one thread because the pool was measured to be no
        faster (a chosen side, not a measuring turn; not a forced one)."""
        history = self._history
        return self._watch and not self.many and history is not None and history.parallel is False

    @property
    def seeds_each(self) -> bool:
        """Whether a forward in one thread seeds every element: unless ``f``'s first call, which
        seeded each, saw it draw nothing (NOTE [random numbers per element])."""
        history = self._history
        return history is None or history.calls <= 1 or history.random

    def learned_random(self, drew: bool) -> None:
        if drew and self._history is not None:
            self._history.random = True

    @property
    def swaps(self) -> bool:
        """Whether ``f`` was seen to swap a module's parameters (``functional_call``)."""
        return self._history is not None and self._history.swaps

    def learned_swaps(self) -> None:
        """``f`` swapped: its forwards stay in one thread (NOTE [parameters swapped by
        functional_call] in ``_torch/_swaps``)."""
        if self._history is not None:
            self._history.swaps = True

    @property
    def shared(self) -> str | None:
        """What process-wide state ``f`` was seen to write, if any (NOTE [process-wide state f
        writes] in ``_torch/_shared``)."""
        return None if self._history is None else self._history.shared

    def learned_shared(self, found: str) -> None:
        """``f`` writes process-wide state: its forwards stay in one thread."""
        if self._history is not None:
            self._history.shared = found


def placement_for(f: Any, *, forced_many: bool, forced_one: bool, kind: Any = None) -> Placement:
    """Choose where the forward of a map of ``f`` runs (NOTE [forward placement]). ``kind`` tells
    apart passes of one ``f`` that are timed differently (``tmap`` or ``tsum``, with a graph or
    without, ``remat``): each has a history of its own."""
    if forced_one or forced_many:  # a history of its own, for the random numbers
        with _lock:
            history = _history_of(f, ("one" if forced_one else "many", kind))
            history.calls += 1
            calls = history.calls
        alone = history.random or history.swaps or history.shared
        many = forced_many and not alone and calls > 1
        return Placement(many, history, False, first=forced_many and calls == 1)
    with _lock:
        history = _history_of(f, kind)
        history.calls += 1
        calls = history.calls
        if history.random or history.swaps or history.shared:
            return Placement(False, history, False)
        if calls == 1:
            return Placement(False, history, True, first=True)
        if not _gil_enabled():
            return Placement(True, history, False)
        turn = calls - 2 if calls <= 1 + EXPLORE else calls % REMEASURE
        if turn < EXPLORE:  # measuring: the pool on even turns, one thread on odd ones
            if turn == 0 and calls > 2:
                history.one = history.many = None  # measured afresh
            return Placement(turn % 2 == 0, history, True)
    return Placement(bool(history.parallel), history, False, watch=True)


#: More cores than this, and a forward held by the GIL: say that processes would use them.
MANY_CORES = 4
_told: set[Any] = set()  # ``key_of(f)`` of the functions told (NOTE [telling of processes])


def tell_of_processes(f: Any, placement: Placement, api: str, cores: int) -> None:
    """NOTE [telling of processes]: where placement keeps a default map's forwards in one thread
    because the pool was measured to be no faster (the GIL holds ``f``'s forward) and this
    process may use more than ``MANY_CORES`` cores (``cores``), say once per ``f`` (``key_of``)
    in one warning that ``executor="processes"`` would run the forwards on the other cores. gradmap
    does not switch by itself: processes do not keep every guarantee of threads (``f`` and the
    items must pickle; no ``create_graph=True`` backward; what ``f`` changes in its own objects
    stays in the worker), so the user chooses, after ``gradmap.compare(f, items)``."""
    if not placement.held_by_gil:
        return
    key = key_of(f)
    with _lock:
        if cores <= MANY_CORES or key in _told:
            return
        if len(_told) >= _MAX_HISTORY:
            _told.clear()
        _told.add(key)
    warnings.warn(
        f"{api}: f's forward is held by the GIL (measured: it ran no faster on the thread pool "
        f"than in one thread), so its forwards run in one thread while this process may use "
        f"{cores} cores; executor='processes' would run them on the other cores (f and the "
        "items must pickle, no create_graph backward, what f changes in its own objects stays "
        "in the worker): print(gradmap.compare(f, items)) times both on your f. Said once per f.",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def user_stacklevel() -> int:
    """The ``stacklevel`` of a warning that names the first line outside gradmap."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def caller_seconds(f: Any, api: str) -> float | None:
    """The caller's forward seconds per element in the latest map of ``f`` (``api``) on worker
    processes that it helped (NOTE [the caller works too] in ``_process/_local``), if any."""
    with _lock:
        history = _history.get((key_of(f), ("caller", api)))
        return None if history is None else history.caller


def learn_caller_seconds(f: Any, api: str, seconds_per_element: float) -> None:
    """Record a map's measured forward seconds per element in the caller."""
    with _lock:
        _history_of(f, ("caller", api)).caller = seconds_per_element


#: The most bytes of early gradients a ``tmap`` keeps from its forward to its backward (NOTE
#: [tmap's losses pulled back early] in ``_torch/_early``): on threads a sum per tensor the map
#: reaches, on worker processes counted as one per chunk and tensor. Past it, nothing is learnt.
EARLY_BYTES = 256 * 2**20


def uniform_cotangents(key: Any) -> bool:
    """Whether the latest backward through a ``tmap`` of the ``f`` with this ``key_of`` gave all
    its results one and the same cotangent (``sum(ys).backward()``): NOTE [tmap's losses pulled
    back early] in ``_torch/_early``. Asking takes the answer: the map that then pulls back
    early learns it again from its own backward, so that maps never pulled back (an evaluation
    with grad mode on) leave the next map without an early pullback that nothing would use."""
    with _lock:
        history = _history.get((key, "cotangents"))
        if history is None or not history.uniform:
            return False
        history.uniform = False
        return True


def learn_uniform_cotangents(key: Any, uniform: bool) -> None:
    """Record what ``uniform_cotangents`` tells."""
    with _lock:
        _history_at((key, "cotangents")).uniform = uniform


def _history_of(f: Any, kind: Any) -> _History:
    """The history of ``f``'s maps of ``kind``, made if new (under ``_lock``)."""
    return _history_at((key_of(f), kind))


def _history_at(key: Any) -> _History:
    """The history under ``key``, made if new (under ``_lock``)."""
    history = _history.get(key)
    if history is None:
        if len(_history) >= _MAX_HISTORY:
            _history.clear()
        history = _history[key] = _History()
    return history
