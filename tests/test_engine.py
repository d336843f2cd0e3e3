"""The chunk engine and plan, framework-free: order, failures, cancellation, helping."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from gradmap._engine import run_chunks
from gradmap._executors import FuturesExecutor, SerialExecutor, ThreadExecutor
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
    """A user pool with one thread, busy: the caller runs every chunk itself."""
    gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait)  # occupy the only thread
        ex = FuturesExecutor(pool, workers=4)
        out = run_chunks(ex, 8, lambda k, run: threading.current_thread().name)
        gate.set()
    assert set(out) == {threading.current_thread().name}


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
        run_chunks(FuturesExecutor(pool, workers=2), 4, chunk, context=Ctx)
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
