"""Running the chunks of one pass (forward or backward) on an executor.

Framework-free: a chunk is an index and a callable; what happens inside is the adapter's business.

One pass is a [`ChunkRun`][]: a counter of chunks not yet claimed, the results, and the first
failure. Helpers (and the caller, when it helps) claim chunks from the counter until none are
left (see NOTE [caller helps, no deadlock] in ``_executors``). When a chunk fails, later chunks are
no longer claimed and stop before their next element, while earlier ones run on, so that the
error reported is the lowest element's, as in the loop; in a backward pass (``last_wins``) the
other way round: the loop's backward runs the last element's first (NOTE [the error of the
loop's element] in ``_remote/_schedule``). The caller waits for every chunk another thread is
running, so nothing is left running or half-done when the error reaches it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Generic, TypeVar

from ._executors import Executor
from ._scoped import scoped

__all__ = ["ChunkRun", "alone", "on_a_chunk", "run_chunks", "working_on_a_chunk"]

T = TypeVar("T")

#: Builds the context a thread enters before it runs chunks of a pass; its argument says whether
#: the thread is the caller's (which already has the caller's state) or a helper's.
ThreadContext = Callable[[bool], AbstractContextManager[object]]


_worker = threading.local()


def on_a_chunk() -> bool:
    """Whether the calling thread is working on a chunk of some map (a nested call's caller)."""
    return getattr(_worker, "active", False)


def working_on_a_chunk() -> AbstractContextManager[None]:
    """Within it, the calling thread counts as running a chunk of some map (``on_a_chunk``): a
    map called from it runs inline (for a host that runs a worker's chunk in this thread)."""
    return scoped(_worker, "active", True)


def alone() -> AbstractContextManager[None]:
    """Within it, a map called from this thread runs every chunk in this thread, with no
    helpers (for a thread that holds a lock its chunks' threads would wait for)."""
    return scoped(_worker, "alone", True)


def _no_context(is_caller: bool) -> AbstractContextManager[object]:
    return nullcontext()


class ChunkRun(Generic[T]):
    """One pass over the chunks; shared by the threads working on it.

    A chunk in progress should call ``stopped(k)`` between elements and return early when it says
    so: after a failure in chunk ``j``, chunks after ``j`` stop and are no longer claimed, while
    chunks before ``j`` run on (one of them may fail at a lower element, which is the one the loop
    would have reported). With ``last_wins`` (a backward pass; by default, a reverse one), the
    other way round: chunks before ``j`` stop, chunks after it run on, and the highest failing
    chunk's error is reported. An interrupt stops everything.
    """

    def __init__(
        self,
        order: Sequence[int],
        run_chunk: Callable[[int, ChunkRun[T]], T],
        on_done: Callable[[int], None] | None = None,
        last_wins: bool | None = None,
    ) -> None:
        self._on_done = on_done
        self._order = order
        reverse = len(order) > 1 and order[0] > order[-1]
        self._last_wins = reverse if last_wins is None else last_wins
        self._run_chunk: Callable[[int, ChunkRun[T]], T] | None = run_chunk
        self._results: list[T | None] = [None] * len(order)
        self._failures: dict[int, BaseException] = {}
        self._next = 0
        # Claims and completions per thread: a waiting thread never waits for a chunk it claimed
        # itself (an interrupt may have cut that chunk short anywhere).
        self._claimed_by: dict[int, int] = {}
        self._done_by: dict[int, int] = {}
        self._done = 0
        self._halted = False
        self._failed: int | None = None  # the chunk whose failure is reported, so far
        self._cond = threading.Condition()

    def _beyond(self, chunk: int) -> bool:
        """Whether ``chunk`` is on the far side of the failure reported so far."""
        failed = self._failed
        if failed is None:
            return False
        return chunk < failed if self._last_wins else chunk > failed

    def stopped(self, chunk: int) -> bool:
        """Whether ``chunk`` should stop before its next element."""
        return self._halted or self._beyond(chunk)

    def _claim(self) -> int | None:
        me = threading.get_ident()
        with self._cond:
            while not self._halted and self._next < len(self._order):
                chunk = self._order[self._next]
                self._next += 1
                if self._beyond(chunk):
                    continue
                self._claimed_by[me] = self._claimed_by.get(me, 0) + 1
                return chunk
            return None

    def work(self, context: AbstractContextManager[object]) -> None:
        """Claim and run chunks until none are left; the body of every thread of the pass."""
        if self._next >= len(self._order) or self._halted:
            return  # a helper that started late: nothing left (checked again under the lock)
        try:
            with working_on_a_chunk(), context:
                while (chunk := self._claim()) is not None:
                    self._run_one(chunk)
        except BaseException as exc:  # a failure of the context, or an interrupt in between
            self._fail(-1, exc)

    def _run_one(self, chunk: int) -> None:
        run_chunk = self._run_chunk
        try:
            assert run_chunk is not None
            self._results[chunk] = run_chunk(chunk, self)
            if self._on_done is not None:
                self._on_done(chunk)
        except BaseException as exc:
            self._fail(chunk, exc)
        finally:
            me = threading.get_ident()
            with self._cond:
                self._done_by[me] = self._done_by.get(me, 0) + 1
                self._done += 1
                # NOTE [one wake-up per pass]: the waiting caller is woken when the last chunk
                # is done (or, after a failure, at each chunk, to count the others' claims),
                # not at every chunk: each wake-up took the GIL from the thread running the
                # next chunk (a forward in one pool thread: 39 ms against 31 in the caller's).
                if self._done >= len(self._order) or self._halted or self._failed is not None:
                    self._cond.notify_all()

    def _fail(self, chunk: int, exc: BaseException) -> None:
        with self._cond:
            self._failures.setdefault(chunk, exc)
            if chunk < 0 or not isinstance(exc, Exception):
                self._halted = True
            elif self._failed is None or not self._beyond(chunk):
                self._failed = chunk
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop everything: no chunk is claimed any more, running ones stop early."""
        with self._cond:
            self._halted = True
            self._cond.notify_all()

    def wait(self) -> None:
        """Wait until every chunk is done or, after a failure, until the chunks other threads
        claimed are, and no chunk on the near side of the failure is left to claim (with
        ``last_wins``, the chunks after the failing one still run: their error is the one
        reported)."""
        me = threading.get_ident()
        count = len(self._order)
        with self._cond:
            while True:
                if self._halted or self._failed is not None:
                    others = sum(
                        n - self._done_by.get(t, 0) for t, n in self._claimed_by.items() if t != me
                    )
                    if others <= 0 and (self._halted or not self._claimable()):
                        return
                elif self._done >= count:
                    return
                self._cond.wait()

    def _claimable(self) -> bool:
        """Whether a chunk not claimed yet is still to run (under ``_cond``)."""
        return any(not self._beyond(c) for c in self._order[self._next :])

    def finish(self) -> list[T]:
        """The results in chunk order, or the first failure raised; then forget everything."""
        failures, results = self._failures, self._results
        self._run_chunk = None
        self._on_done = None
        self._results = []
        self._failures = {}
        if failures:
            # An interrupt or exit wins over ordinary errors; among those, the lowest chunk (and so
            # the lowest element) is reported; with ``last_wins``, the highest.
            severe = [k for k, e in failures.items() if not isinstance(e, Exception)]
            if severe:
                raise failures[min(severe)]
            raise failures[max(failures) if self._last_wins else min(failures)]
        return results  # type: ignore[return-value]


def run_chunks(
    executor: Executor,
    count: int,
    run_chunk: Callable[[int, ChunkRun[T]], T],
    *,
    reverse: bool = False,
    context: ThreadContext = _no_context,
    on_done: Callable[[int], None] | None = None,
    last_wins: bool | None = None,
) -> list[T]:
    """Run ``run_chunk(k, run)`` for every chunk ``k`` on ``executor`` and the caller's thread.

    Arguments:
        executor: where helpers run.
        count: the number of chunks.
        run_chunk: runs one chunk; it should return early when ``run.stopped(k)`` says so.
        reverse: claim chunks from the last to the first.
        context: the context each participating thread enters around its work.
        on_done: called with the index of each chunk that finished (for progress bars).
        last_wins: the highest failing chunk's error is reported (a backward pass; ``None``:
            with ``reverse``).

    Returns:
        The results, in chunk order (whatever order they ran in).

    Raises:
        The lowest (``last_wins``: highest) failing chunk's error, after every chunk that was
        running has stopped.
    """
    order: Sequence[int] = range(count - 1, -1, -1) if reverse else range(count)
    run: ChunkRun[T] = ChunkRun(order, run_chunk, on_done, last_wins)
    helps = on_a_chunk() or executor.caller_works()
    helpers = min(executor.workers, count) - (1 if helps else 0)
    if getattr(_worker, "alone", False):
        helps, helpers = True, 0
    try:
        for _ in range(helpers):
            executor.submit(lambda: run.work(context(False)))
        if helps:
            run.work(context(True))
    except BaseException:
        # A submit that failed, or an interrupt in the caller outside any chunk: stop the rest.
        run.cancel()
        _wait_uninterrupted(run)
        run.finish()  # raises a chunk's failure if one came first
        raise
    _wait_uninterrupted(run)
    return run.finish()


def _wait_uninterrupted(run: ChunkRun[T]) -> None:
    """Wait for the helpers; an interrupt while waiting cancels the rest, then still waits."""
    try:
        run.wait()
    except BaseException:
        run.cancel()
        run.wait()
        raise


def run_pipeline(
    executor: Executor,
    count: int,
    produce: Callable[[int, Callable[[], bool]], T],
    consume: Callable[[int, T], object],
    *,
    context: ThreadContext = _no_context,
    produce_context: ThreadContext = _no_context,
) -> list[object]:
    """Produce chunk after chunk in one thread; consume each on other threads as soon as it is
    produced (a ``tsum``: forwards in one thread, pullbacks overlapping them).

    The producer is one of the executor's ``workers``: a pool thread with gradmap's own pool (the
    caller waits), the caller's thread with an executor the caller helps (the serial one, a
    user's pool) or in a call nested in a map. ``workers - 1`` helpers consume while it produces;
    once it has produced every chunk it consumes what is left alongside them. With no helpers the
    producer consumes each chunk right after producing it.

    Arguments:
        executor: where the helpers (and the producer, if it is not the caller) run.
        count: the number of chunks.
        produce: ``produce(k, stopped)`` makes chunk ``k``; it should return early when
            ``stopped()`` says so.
        consume: ``consume(k, product)``; its result is chunk ``k``'s.
        context: entered by each consuming helper around its work.
        produce_context: entered by the producer, when it is not the caller, around its work.

    Returns:
        The consumers' results, in chunk order.

    Raises:
        The failure of the lowest chunk (producing or consuming), after every thread stopped.
    """
    # Inline in a chunk's thread (a map nested in f), and within ``alone`` (a thread that holds a
    # lock its helpers would wait for, which need not be a chunk's: the caller's own forward).
    nested = on_a_chunk() or getattr(_worker, "alone", False)
    inline = nested or executor.caller_works()
    helpers = 0 if nested else max(0, min(executor.workers - 1, count - 1))
    results: list[object] = [None] * count
    failures: dict[int, BaseException] = {}
    cond = threading.Condition()
    pending: list[tuple[int, T]] = []
    # The producer is the caller (inline) or whichever submitted job starts first: a consumer
    # only ever waits while a producer runs, whatever order the executor starts jobs in (a busy
    # or shared pool may start them in any order, and a consumer waiting for a producer still
    # queued behind it would wait for ever).
    state = {"running": 0, "produced": False, "producer": inline}

    def fail(k: int, exc: BaseException) -> None:
        with cond:
            failures.setdefault(k, exc)
            cond.notify_all()

    def take(block: bool) -> tuple[int, T] | None:
        """The next product to consume; ``None`` when there is none left (or none now)."""
        with cond:
            while not pending:
                if state["produced"] or not block:
                    return None
                cond.wait()
            return pending.pop(0)

    def consume_one(job: tuple[int, T]) -> None:
        k, product = job
        if failures and min(failures) < k:
            return  # a lower chunk failed: its error is the one reported
        try:
            results[k] = consume(k, product)
        except BaseException as exc:
            fail(k, exc)

    def done() -> None:
        with cond:
            state["running"] -= 1
            cond.notify_all()

    def consumer() -> None:
        try:
            with context(False):
                while (job := take(block=True)) is not None:
                    consume_one(job)
        except BaseException as exc:
            fail(-1, exc)
        finally:
            done()

    def drive() -> None:
        try:
            for k in range(count):
                if failures:
                    break
                try:
                    product = produce(k, lambda: bool(failures))
                except BaseException as exc:
                    fail(k, exc)
                    break
                if helpers:
                    with cond:
                        pending.append((k, product))
                        cond.notify()
                else:
                    consume_one((k, product))
        finally:
            with cond:
                state["produced"] = True
                cond.notify_all()
            while (job := take(block=False)) is not None:  # its share of what is left
                consume_one(job)

    def producer() -> None:
        try:
            with working_on_a_chunk(), produce_context(False):  # a map nested in f: inline
                drive()
        except BaseException as exc:
            fail(-1, exc)
        finally:
            done()

    def job() -> None:
        with cond:
            produces = not state["producer"]
            state["producer"] = True
        if produces:
            producer()
        else:
            consumer()

    try:
        for _ in range(helpers + (0 if inline else 1)):
            with cond:
                state["running"] += 1
            try:
                executor.submit(job)
            except BaseException:
                done()
                raise
        if inline:
            drive()
    except BaseException as exc:
        fail(-1, exc)  # stop the others
        with cond:
            state["produced"] = True
            cond.notify_all()
        raise
    finally:
        with cond:
            while state["running"] > 0:
                try:
                    cond.wait()
                except BaseException as exc:  # an interrupt while waiting: stop, then wait
                    failures.setdefault(-1, exc)
                    state["produced"] = True
                    cond.notify_all()
    if failures:
        severe = [k for k, e in failures.items() if not isinstance(e, Exception)]
        raise failures[min(severe) if severe else min(failures)]
    return results
