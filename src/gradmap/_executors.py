"""Executors: where the chunks of a map run.

gradmap needs very little from an executor: a way to start a *helper* (a callable that pulls
chunks from a shared counter until none are left) and a few facts about it, stated as class
attributes in the manner of joblib's backends. The caller's own thread always works too, so an
executor may run fewer helpers than asked, or none, and a map still finishes.

NOTE [caller helps, no deadlock]:
    A map never waits on a chunk that nobody can start. Helpers claim chunks from a shared counter;
    a thread only ever waits for chunks that another thread has already claimed and is running.
    Whenever a waiting caller could be holding up its own helpers, it works on chunks itself:
    - a caller that is working on a chunk of another map (a ``tmap`` nested inside ``f``) always
      helps, so a nested call cannot deadlock, however small or busy the pool: in the worst case
      it runs every nested chunk itself, and its queued helpers find nothing left to do;
    - a caller that is one of a user executor's own threads (a map called from a task on that
      executor) helps, so maps called from its tasks cannot deadlock however busy it is: a thread
      of the pool never waits for a chunk that nobody started.
    Otherwise a top-level caller starts ``workers`` helpers and waits. gradmap's own pool never
    blocks on anything but running chunks, so its queue always drains, and the caller's own
    thread settings stay untouched. A user's executor runs every chunk of every call (NOTE [a
    user's executor runs every chunk]); the caller waits for it as ``executor.map`` would.

NOTE [a user's executor runs every chunk]:
    Users pass their own ``concurrent.futures`` executor to set per-thread state (an
    ``initializer`` that calls ``torch.set_num_threads(1)``, thread-local state ``f`` reads), so
    every chunk of every call runs on its threads: forwards (also the one-thread forwards of
    NOTE [forward placement], which run on one of its threads), ``tsum``'s producer and
    pullbacks, and the backward's pullbacks. The caller runs chunks only where it is one of the
    executor's threads, or works on a chunk of a map itself (a map nested in ``f``; NOTE [caller
    helps, no deadlock]), or under a ``torch.func`` transform, saved-tensor hooks or a torch mode
    (NOTE [state only the caller's thread has]).
    ``FuturesExecutor(pool, caller_helps=True)`` keeps the caller working alongside, for a pool
    whose threads may be taken by tasks that wait on the caller.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import os
import threading
import weakref
from collections.abc import Callable
from typing import ClassVar

__all__ = [
    "Executor",
    "SerialExecutor",
    "ThreadExecutor",
    "FuturesExecutor",
    "RemoteExecutor",
    "available_cores",
]


def available_cores() -> int:
    """The number of CPU cores this process may run on (its affinity mask, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class Executor:
    """The protocol gradmap runs chunks on.

    Subclasses set the capability attributes and implement
    [`submit`][gradmap.Executor.submit]. ``workers`` is the number of threads, the caller's
    included, that may run chunks of one map at once.

    Attributes:
        shares_memory: chunks run in the caller's process, so a chunk's autograd graph can stay
            where it was built and be pulled back later by the same or another thread.
        reverse_backward: pull chunks back in reverse element order (the serial reference does,
            as ChainRules' ``map`` rule does, for an ``f`` with state across elements).
        caller_helps: the caller's thread works on chunks (and ``workers - 1`` helpers are
            started); otherwise ``workers`` helpers do the work while the caller waits. A caller
            that is itself working on a map's chunk always helps (see the NOTE above).

    """

    shares_memory: ClassVar[bool] = True
    reverse_backward: ClassVar[bool] = False
    caller_helps: ClassVar[bool] = True
    name: ClassVar[str] = "executor"

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def submit(self, helper: Callable[[], None]) -> None:
        """Start ``helper`` on another thread. It is never required to run."""
        raise NotImplementedError

    def caller_works(self) -> bool:
        """Whether the calling thread works on the chunks of a map on this executor (a caller
        that is working on a chunk of another map always does, whatever this says)."""
        return self.caller_helps

    def for_pullbacks(self) -> Executor:
        """Where the pullbacks of a backward pass run, given that the chunks' forwards ran here
        (NOTE [pullbacks on threads of their own]): this executor, but for gradmap's pool."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(workers={self.workers})"


class SerialExecutor(Executor):
    """The reference: every chunk runs in the caller's thread, in element order; the backward
    runs in reverse element order."""

    reverse_backward = True
    name = "serial"

    def __init__(self, workers: int | None = None) -> None:
        super().__init__(1)  # one thread, whatever ``workers`` says

    def submit(self, helper: Callable[[], None]) -> None:  # pragma: no cover - never called
        raise AssertionError("the serial executor has no helpers")


# NOTE [pullbacks on threads of their own]:
#     A chunk's graph lives in the memory of the thread that ran its forward: glibc's malloc
#     gives each thread an arena of its own, and a block goes back to the arena it came from,
#     under that arena's lock. When the pullbacks ran on the pool threads that had run the
#     forwards, each pullback freed the saved tensors of chunks made by the other thread into
#     that thread's arena while that thread allocated its own pullback's tensors from it: the
#     two threads took turns on one lock (``__lll_lock_wait_private`` under ``free`` was the
#     largest native frame of a per-sequence GRU's backward, sampled with py-spy). Measured
#     without gradmap on 2 cores, two persistent threads pulling back 64 GRU chunks took 245-290
#     ms after forwards run on one of them, and 193-211 ms after forwards in a third thread
#     (trees: 173-199 ms against 146). So the backward passes of ``tmap`` on gradmap's pool run
#     on a second pool of threads that run no forward: their own allocations never meet the
#     frees of the graphs. (``tsum`` pulls each chunk back in the thread that ran its forward, or
#     keeps the graph for its producer to free: NOTE [graphs freed by the producer].) A user's
#     executor runs both passes on its own threads, as its owner chose.
_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_pool_sizes: dict[str, int] = {}
_pool_lock = threading.Lock()
_pool_thread = threading.local()


def _mark_pool_thread() -> None:
    _pool_thread.is_gradmap = True


def in_gradmap_pool() -> bool:
    """Whether the calling thread is one of gradmap's own pool threads."""
    return getattr(_pool_thread, "is_gradmap", False)


def _shared_pool(threads: int, role: str = "gradmap") -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool of ``role`` (``"gradmap"``, or ``"gradmap-pullback"``: NOTE
    [pullbacks on threads of their own]), with at least ``threads`` threads.

    Created on first use and reused after; a call that needs more threads than it has replaces it
    with a larger one (the old one finishes what it was given and its threads exit). Threads start
    lazily, as the pool needs them, and are joined at interpreter exit.
    """
    pool = _pools.get(role)
    if pool is not None and _pool_sizes[role] >= threads:
        return pool
    with _pool_lock:
        pool = _pools.get(role)
        if pool is None or _pool_sizes[role] < threads:
            old = pool
            size = _pool_sizes[role] = max(threads, _pool_sizes.get(role, 0))
            pool = _pools[role] = concurrent.futures.ThreadPoolExecutor(
                max_workers=size,
                thread_name_prefix=role,
                initializer=_mark_pool_thread,
            )
            if old is not None:
                old.shutdown(wait=False)
        return pool


# NOTE [after a fork]:
#     A child forked from a process that used gradmap (``multiprocessing``'s default start on
#     Linux, ``os.fork``) inherits gradmap's objects but only the forking thread: its pools'
#     threads, worker processes' writer threads and any lock another thread held are not there
#     for it. A call in the child then waited forever on a pool whose threads existed only in
#     the parent. So each module that keeps such state sets it aside in the child, at the fork
#     (``os.register_at_fork``): the pools are dropped unused (their parent's threads and worker
#     processes stay the parent's: nothing is stopped or closed from the child) and made anew on
#     first use, and module locks are made free again.
_left_in_the_parent: list[object] = []


def _after_fork_in_child() -> None:
    _left_in_the_parent.append(dict(_pools))  # never shut down from here (NOTE [after a fork])
    _pools.clear()
    _pool_sizes.clear()
    _pool_lock._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_pools(threads: int) -> list[concurrent.futures.ThreadPoolExecutor]:
    """Both of gradmap's pools, each with at least ``threads`` threads (for tests)."""
    return [_shared_pool(threads, role) for role in ("gradmap", "gradmap-pullback")]


class ThreadExecutor(Executor):
    """The default: a shared, lazily created thread pool, reused across calls.

    ``workers=4`` runs chunks on four pool threads while the caller waits (a caller that is itself
    a worker, in a nested map, works too). The caller's own thread settings are never touched.
    """

    caller_helps = False
    name = "threads"
    _role = "gradmap"

    def __init__(self, workers: int | None = None) -> None:
        super().__init__(available_cores() if workers is None else workers)

    def submit(self, helper: Callable[[], None]) -> None:
        while True:
            pool = _shared_pool(self.workers, self._role)
            try:
                pool.submit(helper)
                return
            except RuntimeError:
                if pool is _pools.get(self._role):  # not replaced by a larger pool meanwhile
                    raise

    def for_pullbacks(self) -> Executor:
        return _PullbackThreads(self.workers)


class _PullbackThreads(ThreadExecutor):
    """The pool threads that run the pullbacks of a map on ``ThreadExecutor``'s (NOTE
    [pullbacks on threads of their own])."""

    _role = "gradmap-pullback"


_helper_threads = threading.local()


class FuturesExecutor(Executor):
    """A user's `concurrent.futures.Executor`, used as given and never shut down by gradmap.

    Every chunk of every call runs on its threads (NOTE [a user's executor runs every chunk]):
    the caller waits, unless it is one of the executor's own threads, in which case it works on
    chunks too. ``workers`` defaults to its ``max_workers``.

    Arguments:
        executor: the executor.
        workers: threads that run chunks of one map at once; ``None`` for ``max_workers`` (plus
            one with ``caller_helps``).
        caller_helps: the caller's thread works on chunks too (the behaviour before every chunk
            ran on the executor): for a pool whose threads may all be taken by tasks that wait
            on the caller.
    """

    name = "futures"

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        workers: int | None = None,
        caller_helps: bool = False,
        *,
        api: str = "gradmap.tmap",
    ) -> None:
        if isinstance(executor, concurrent.futures.ProcessPoolExecutor):
            others = "" if api.startswith("gradmap.jax.") else ", executor='processes' or 'ray'"
            raise TypeError(
                f"{api}: a ProcessPoolExecutor cannot hold a chunk's graph (what its backward "
                "needs) between the forward and the backward: it does not share memory with "
                f"the caller. Use executor=None (threads), a ThreadPoolExecutor{others}."
            )
        if _is_shut_down(executor):
            raise RuntimeError(
                f"{api}: the executor {executor!r} has been shut down. Pass an executor "
                "that is still running, or executor=None for gradmap's shared thread pool."
            )
        if workers is None:
            workers = getattr(executor, "_max_workers", None) or available_cores()
            workers = int(workers) + (1 if caller_helps else 0)
        super().__init__(workers)
        self.executor = executor
        self.caller_helps = bool(caller_helps)  # type: ignore[misc]
        self.api = api
        # A ThreadPoolExecutor lists its threads; for other executors, the threads that ran a
        # helper remember it (a weak set per thread).
        self._listed = hasattr(executor, "_threads")

    def submit(self, helper: Callable[[], None]) -> None:
        try:
            if self._listed:
                self.executor.submit(helper)
            else:
                self.executor.submit(self._marked, helper)
        except RuntimeError as exc:
            if _is_shut_down(self.executor) or "shutdown" in str(exc):
                raise RuntimeError(
                    f"{self.api}: the executor {self.executor!r} was shut down during the call. "
                    "Pass an executor that stays running, or executor=None."
                ) from exc
            raise

    def _marked(self, helper: Callable[[], None]) -> None:
        seen = getattr(_helper_threads, "executors", None)
        if seen is None:
            seen = _helper_threads.executors = weakref.WeakSet()
        with contextlib.suppress(TypeError):  # an executor without weak references
            seen.add(self.executor)
        helper()

    def owns_current_thread(self) -> bool:
        """Whether the calling thread is one of the executor's own."""
        threads = getattr(self.executor, "_threads", None)
        if threads is not None:
            me = threading.current_thread()
            if me in threads:
                return True
            # A ThreadPoolExecutor adds a new thread to its set only after starting it, under
            # its lock, so a task may run (and call a map) before its own thread is listed:
            # once the lock is free, the set is complete.
            lock = getattr(self.executor, "_shutdown_lock", None)
            if lock is not None:
                with lock:
                    if me in threads:
                        return True
        seen = getattr(_helper_threads, "executors", None)
        try:
            return seen is not None and self.executor in seen
        except TypeError:  # pragma: no cover - an executor without weak references
            return False

    def caller_works(self) -> bool:
        return self.caller_helps or self.owns_current_thread()

    def one_thread(self) -> FuturesExecutor:
        """The same executor, running one chunk at a time on one of its threads."""
        one = copy.copy(self)
        one.workers = 1
        return one

    def named(self, api: str) -> FuturesExecutor:
        """The same executor, naming ``api`` in its errors."""
        if api == self.api:
            return self
        other = copy.copy(self)
        other.api = api
        return other

    def __repr__(self) -> str:
        helps = ", caller_helps=True" if self.caller_helps else ""
        return f"FuturesExecutor({self.executor!r}, workers={self.workers}{helps})"


class RemoteExecutor(Executor):
    """Chunks run in other processes (Ray's actors, gradmap's worker processes): the base of the
    executors whose chunks the rule in ``gradmap._remote`` runs, through their ``transport()``.

    Attributes:
        timeout: seconds a pass may go without any chunk finishing; ``None``: no limit.
        start_timeout: seconds a pass may wait for workers to (re)start.
        share: how ``f``'s leaf tensors travel by reference (``gradmap._remote._pickling.Share``),
            or ``None`` to send their bytes with every call.
    """

    shares_memory = False
    caller_helps = False
    timeout: float | None = None
    start_timeout: float = 120.0
    share: Callable[[object], object] | None = None

    def submit(self, helper: Callable[[], None]) -> None:
        raise TypeError(
            f"gradmap: {type(self).__name__} runs chunks in other processes, through "
            "gradmap._remote, not on helper threads"
        )

    def transport(self, f: object = None, api: str = "", n: int = 0) -> object:
        """The transport to the workers a map of ``f`` (``api``, ``n`` elements) uses, starting
        them if needed."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the workers; the next map starts new ones."""

    def __enter__(self) -> RemoteExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        """``with ProcessExecutor(...) as ex:`` stops the workers at the block's end."""
        self.shutdown()


def _is_shut_down(executor: concurrent.futures.Executor) -> bool:
    return bool(getattr(executor, "_shutdown", False) or getattr(executor, "_broken", False))
