"""The chunk engine and plan, framework-free: order, failures, cancellation, helping."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time

import pytest

from gradmap._engine import run_chunks, run_pipeline
from gradmap._executors import FuturesExecutor, SerialExecutor, ThreadExecutor
from gradmap._placement import CHANGED, EXPLORE, REMEASURE, placement_for
from gradmap._plan import TARGET_CHUNKS, plan_chunks


@pytest.mark.parametrize("n", [0, 1, 5, 63, 64, 65, 1000, 100_003])
def test_plan_covers_elements_once(n):
    plan = plan_chunks(n)
    covered = [i for k in range(plan.count) for i in range(*plan.bounds(k))]
    assert covered == list(range(n))
    assert plan.count <= TARGET_CHUNKS


def test_plan_depends_on_count_only():
    assert plan_chunks(1000) == plan_chunks(1000)
    assert plan_chunks(10, chunksize=3).count == 4
    assert plan_chunks(10, chunksize=3).bounds(3) == (9, 10)


@pytest.mark.parametrize("executor", [SerialExecutor(), ThreadExecutor(4), ThreadExecutor(1)])
def test_results_in_chunk_order(executor):
    out = run_chunks(executor, 50, lambda k, run: k * k)
    assert out == [k * k for k in range(50)]


def test_reverse_claims_last_chunk_first():
    seen: list[int] = []
    run_chunks(SerialExecutor(), 5, lambda k, run: seen.append(k), reverse=True)
    assert seen == [4, 3, 2, 1, 0]


def test_lowest_failure_wins_and_the_rest_is_not_started():
    started: list[int] = []

    def chunk(k, run):
        started.append(k)
        if k == 3:
            raise KeyError(k)
        return k

    with pytest.raises(KeyError):
        run_chunks(SerialExecutor(), 10, chunk)
    assert started == [0, 1, 2, 3]


def test_caller_alone_finishes_when_pool_is_busy():
    """A user pool with one thread, busy, passed with ``caller_helps=True``: the caller runs
    every chunk itself."""
    gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait)  # occupy the only thread
        ex = FuturesExecutor(pool, workers=4, caller_helps=True)
        out = run_chunks(ex, 8, lambda k, run: threading.current_thread().name)
        gate.set()
    assert set(out) == {threading.current_thread().name}


def test_user_pool_runs_every_chunk_and_the_caller_waits():
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="user") as pool:
        for workers in (None, 1, 2, 5):
            out = run_chunks(
                FuturesExecutor(pool, workers), 7, lambda k, run: threading.current_thread().name
            )
            assert all(name.startswith("user") for name in out), out
        # a task of the pool that calls a map works on its chunks (no thread waits on a chunk
        # nobody started)
        inner = pool.submit(
            run_chunks, FuturesExecutor(pool, 2), 4, lambda k, run: threading.current_thread()
        )
        assert len(inner.result(10)) == 4


def test_context_entered_by_every_thread():
    entered: list[bool] = []

    class Ctx:
        def __init__(self, is_caller):
            self.is_caller = is_caller

        def __enter__(self):
            entered.append(self.is_caller)

        def __exit__(self, *exc):
            return None

    barrier = threading.Barrier(2, timeout=5)

    def chunk(k, run):
        if k < 2:
            barrier.wait()  # two threads must work at once
        return k

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run_chunks(FuturesExecutor(pool, workers=2, caller_helps=True), 4, chunk, context=Ctx)
    assert sorted(entered) == [False, True]


def test_shared_pool_caller_waits_unless_nested():
    """With gradmap's pool, a top-level caller does no chunk itself; a nested caller does."""
    caller = threading.current_thread().name
    names = run_chunks(ThreadExecutor(2), 6, lambda k, run: threading.current_thread().name)
    assert caller not in names

    def outer(k, run):
        me = threading.current_thread().name
        inner = run_chunks(ThreadExecutor(1), 3, lambda j, r: threading.current_thread().name)
        return me in inner

    assert all(run_chunks(ThreadExecutor(2), 2, outer))


# -- the produce/consume pipeline of tsum ----------------------------------------------------------

PIPELINE_EXECUTORS = [
    SerialExecutor(),
    ThreadExecutor(1),
    ThreadExecutor(3),
    FuturesExecutor(concurrent.futures.ThreadPoolExecutor(2)),
]


@pytest.mark.parametrize("executor", PIPELINE_EXECUTORS, ids=repr)
def test_pipeline_consumes_every_product_in_chunk_order(executor):
    produced: list[int] = []
    consumers: set[int] = set()

    def consume(k: int, product: int) -> int:
        consumers.add(threading.get_ident())
        return product + 1

    out = run_pipeline(executor, 40, lambda k, stopped: produced.append(k) or k * 10, consume)
    assert produced == list(range(40))  # in order, in the caller's thread
    assert out == [k * 10 + 1 for k in range(40)]


@pytest.mark.parametrize("executor", PIPELINE_EXECUTORS, ids=repr)
@pytest.mark.parametrize("where", ["produce", "consume"])
def test_pipeline_reports_the_lowest_failing_chunk(executor, where):
    class Boom(Exception):
        pass

    def produce(k: int, stopped) -> int:
        if where == "produce" and k in (7, 12):
            raise Boom(k)
        return k

    def consume(k: int, product: int) -> int:
        if where == "consume" and k in (7, 12):
            raise Boom(k)
        return k

    with pytest.raises(Boom) as info:
        run_pipeline(executor, 20, produce, consume)
    assert info.value.args == (7,)


def test_pipeline_stops_producing_after_a_failure():
    produced: list[int] = []

    def produce(k: int, stopped) -> int:
        produced.append(k)
        if k == 3:
            raise ValueError(k)
        return k

    with pytest.raises(ValueError):
        run_pipeline(SerialExecutor(), 10, produce, lambda k, p: p)
    assert produced == [0, 1, 2, 3]


# -- forward placement ---------------------------------------------------------------------------


def _calls(f, count):
    return [placement_for(f, forced_many=False, forced_one=False) for _ in range(count)]


#: Placement measures only where the GIL makes one thread faster (NOTE [forward placement]).
GIL_ONLY = pytest.mark.skipif(
    not getattr(sys, "_is_gil_enabled", lambda: True)(),
    reason="free-threaded CPython: forwards always use the pool",
)


def _explore(f, one, many):
    """The first ``1 + EXPLORE`` calls of a new ``f``: one thread, then the pool and one thread
    in turn, recording ``one`` and ``many`` (lists of seconds per element, taken in order)."""
    one, many = list(one), list(many)
    first = placement_for(f, forced_many=False, forced_one=False)
    assert not first.many
    first.record(one.pop(0))
    for turn in range(EXPLORE):
        p = placement_for(f, forced_many=False, forced_one=False)
        assert p.many == (turn % 2 == 0)
        p.record(many.pop(0) if p.many else one.pop(0))


@GIL_ONLY
def test_placement_measures_one_thread_then_both_sides_in_turn():
    def f(x):  # a new code object: no history yet
        return x

    # Slower on the pool (a GIL-bound forward), whatever the first, cold call took.
    _explore(f, one=[9e-3, 2e-3, 1.9e-3], many=[3e-3, 2.5e-3])
    assert not placement_for(f, forced_many=False, forced_one=False).many


@GIL_ONLY
def test_placement_takes_each_sides_best_sample():
    """A process's first calls run slower than its later ones: one slow sample of the pool
    (here its first) must not send a forward that is faster there to one thread."""

    def f(x):
        return x

    _explore(f, one=[4e-3, 2e-3, 2.1e-3], many=[2.4e-3, 1.2e-3])
    assert placement_for(f, forced_many=False, forced_one=False).many


@GIL_ONLY
def test_placement_keeps_the_pool_for_a_faster_forward_and_remeasures():
    def g(x):
        return x

    _explore(g, one=[2e-3, 2.1e-3, 2e-3], many=[1e-3, 1.1e-3])  # twice as fast on the pool
    assert all(p.many for p in _calls(g, REMEASURE - 2 - EXPLORE))  # calls 6 .. REMEASURE - 1
    for turn in range(EXPLORE):  # calls REMEASURE .. : both sides measured afresh
        p = placement_for(g, forced_many=False, forced_one=False)
        assert p.many == (turn % 2 == 0)
        p.record(1.95e-3 if p.many else 2e-3)  # no longer faster than 0.9 x one thread
    assert not placement_for(g, forced_many=False, forced_one=False).many


@GIL_ONLY
def test_placement_measures_again_when_the_elements_change():
    """The same ``f`` over other elements (bags of other sizes): a pass on the chosen side that
    takes CHANGED times more or less per element than measured starts the measurements again."""

    def h(x):
        return x

    _explore(h, one=[2e-3, 2e-3, 2e-3], many=[1e-3, 1e-3])  # the pool wins on these elements
    chosen = placement_for(h, forced_many=False, forced_one=False)
    assert chosen.many
    chosen._check(1.2e-3)  # as measured: nothing changes
    assert placement_for(h, forced_many=False, forced_one=False).many
    changed = placement_for(h, forced_many=False, forced_one=False)
    changed._check(1e-3 / (CHANGED * 1.5))  # elements much smaller than before
    turns = _calls(h, EXPLORE)
    assert [p.many for p in turns] == [True, False] * (EXPLORE // 2)  # both sides afresh
    for p in turns:
        p.record(3e-4 if p.many else 2e-4)  # one thread wins on the new elements
    assert not placement_for(h, forced_many=False, forced_one=False).many


def test_placement_times_the_pass_per_element():
    def k(x):
        return x

    measured = placement_for(k, forced_many=False, forced_one=False)
    seen: list[float] = []
    measured.record = seen.append  # type: ignore[method-assign]
    assert measured.timed(lambda: time.sleep(0.02) or "out", 4) == "out"
    assert len(seen) == 1 and 0.004 < seen[0] < 0.05  # about 20 ms over 4 elements


def test_placement_forced_and_random():
    def h(x):
        return x

    assert not placement_for(h, forced_many=False, forced_one=True).many
    first = placement_for(h, forced_many=True, forced_one=False)
    assert not first.many  # the first call learns whether f draws random numbers
    assert placement_for(h, forced_many=True, forced_one=False).many
    first.learned_random(True)
    assert not placement_for(h, forced_many=True, forced_one=False).many


@GIL_ONLY
def test_forced_maps_leave_the_measuring_turns_of_free_ones():
    """Maps of one ``f`` with ``workers=`` and without, interleaved: the forced ones (which
    measure nothing) do not take the free ones' measuring turns."""

    def h(x):
        return x

    first = placement_for(h, forced_many=False, forced_one=False)
    first.record(2e-3)
    for turn in range(EXPLORE):
        assert placement_for(h, forced_many=True, forced_one=False).many or turn == 0
        p = placement_for(h, forced_many=False, forced_one=False)
        assert p.many == (turn % 2 == 0) and p._measure
        p.record(1e-3 if p.many else 2e-3)
    assert placement_for(h, forced_many=False, forced_one=False).many


def test_placement_seeds_each_element_until_f_is_seen_to_draw_nothing():
    """NOTE [random numbers per element]: the first call seeds every element (and learns);
    later calls of an ``f`` that drew nothing seed each chunk once, in a forced single thread
    too (the serial executor); an ``f`` that drew seeds every element."""

    def quiet(x):
        return x

    def noisy(x):
        return x

    first = placement_for(quiet, forced_many=False, forced_one=False)
    assert first.seeds_each
    first.learned_random(False)
    assert not placement_for(quiet, forced_many=False, forced_one=False).seeds_each
    alone = placement_for(quiet, forced_many=False, forced_one=True)  # (a history of its own)
    assert alone.seeds_each and not alone.many
    alone.learned_random(False)
    assert not placement_for(quiet, forced_many=False, forced_one=True).seeds_each
    placement_for(noisy, forced_many=False, forced_one=False).learned_random(True)
    assert placement_for(noisy, forced_many=False, forced_one=False).seeds_each


def test_last_wins_waits_for_the_chunks_after_a_failure_not_yet_claimed():
    """A backward pass (``last_wins``) reports the highest failing chunk's error: after a failure
    in chunk 0, the caller's wait must not end while chunk 1 is still to be claimed -- in the
    moment between a helper's failing chunk and its next claim no other thread holds a chunk
    (on free-threaded CPython the caller woke there and raised chunk 0's error)."""
    from contextlib import nullcontext

    from gradmap._engine import ChunkRun

    def fail(k, _run):  # type: ignore[no-untyped-def]
        raise ValueError(f"chunk {k}")

    run = ChunkRun(range(2), fail, last_wins=True)
    first = threading.Thread(target=lambda: run._run_one(run._claim()))  # chunk 0, then stops
    first.start()
    first.join()
    waiter = threading.Thread(target=run.wait)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "the wait ended with chunk 1 still to run"
    rest = threading.Thread(target=run.work, args=(nullcontext(),))
    rest.start()
    rest.join()
    waiter.join(5)
    assert not waiter.is_alive()
    with pytest.raises(ValueError, match="chunk 1"):
        run.finish()
