"""Resolving the executor argument, and the thread budget."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, ClassVar

import pytest
import torch

import gradmap
from gradmap._executors import available_cores
from gradmap._resolve import EXECUTORS, resolve_executor

from support import deadline


def resolve(executor: Any, workers: Any) -> gradmap.Executor:
    """The executor ``gradmap.tmap`` runs on for these arguments."""
    return resolve_executor(executor, workers, EXECUTORS, "gradmap.tmap")


def test_default_is_shared_threads_on_all_cores():
    ex = resolve(None, None)
    assert isinstance(ex, gradmap.ThreadExecutor)
    assert ex.workers == available_cores()
    assert resolve("threads", 3).workers == 3


def test_serial_has_one_worker_and_reverse_backward():
    ex = resolve("serial", None)
    assert ex.workers == 1 and ex.reverse_backward


def test_user_executor_workers_are_its_threads():
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        ex = resolve(pool, None)
        assert isinstance(ex, gradmap.FuturesExecutor) and ex.workers == 3
        assert not ex.caller_works()
        assert resolve(pool, 2).workers == 2
        helping = gradmap.FuturesExecutor(pool, caller_helps=True)
        assert helping.workers == 4 and helping.caller_works()


class _Marked(torch.autograd.Function):
    """The identity, noting the thread its backward runs in."""

    threads: ClassVar[list[str]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Marked.threads.append(threading.current_thread().name)
        return g


@pytest.mark.parametrize("workers", [None, 1, 2])
@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_user_executor_runs_every_chunk_from_the_first_call(api, workers):
    """Users pass an executor to set per-thread state: every forward and every pullback of every
    call runs on its threads, the first call included, with the loop's gradients."""
    local = threading.local()
    forwards: list[tuple[str, Any]] = []
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(k % 3 + 1, 3, dtype=torch.float64) for k in range(9)]

    def f(x: torch.Tensor) -> torch.Tensor:
        forwards.append((threading.current_thread().name, getattr(local, "mark", None)))
        return (torch.tanh(x * _Marked.apply(w)) ** 2).sum()

    (expected,) = torch.autograd.grad(sum(f(x) for x in xs), w)
    with concurrent.futures.ThreadPoolExecutor(
        2, thread_name_prefix="user-pool", initializer=lambda: setattr(local, "mark", "set")
    ) as pool:
        for _ in range(3):
            forwards.clear()
            _Marked.threads.clear()
            if api == "tmap":
                loss = sum(gradmap.tmap(f, xs, executor=pool, workers=workers))
            else:
                loss = gradmap.tsum(f, xs, executor=pool, workers=workers)
            (g,) = torch.autograd.grad(loss, w)
            torch.testing.assert_close(g, expected)
            assert len(forwards) == len(xs) and len(_Marked.threads) >= 1
            assert {mark for _, mark in forwards} == {"set"}
            assert all(name.startswith("user-pool") for name, _ in forwards), forwards
            assert all(name.startswith("user-pool") for name in _Marked.threads), _Marked.threads


@deadline(60)
def test_map_called_from_a_task_of_a_one_thread_user_executor():
    """A task on the user's executor that calls a map on that same executor works on its chunks
    (the executor's only thread is the task's own): no deadlock, the loop's gradients."""
    w = torch.ones(3, requires_grad=True)

    def task() -> torch.Tensor:
        ys = gradmap.tmap(lambda i: (w * i).sum(), range(8), executor=pool, chunksize=1)
        return torch.autograd.grad(gradmap.tsum(lambda y: y, ys, executor=pool), w)[0]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        torch.testing.assert_close(pool.submit(task).result(30), torch.full((3,), 28.0))


@deadline(120)
def test_a_task_on_a_thread_just_started_is_known_as_the_executors_own():
    """A new pool starts a thread for the first task and lists it only after starting it: a
    task that calls a map at once must still be known as running on the pool (before, a fresh
    1-thread pool hung within 1-12 tries, the caller waiting for a helper queued behind itself)."""
    w = torch.ones(3, requires_grad=True)
    for _ in range(100):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            task = pool.submit(
                lambda pool=pool: torch.autograd.grad(
                    gradmap.tsum(lambda i: (w * i).sum(), range(4), executor=pool), w
                )[0]
            )
            torch.testing.assert_close(task.result(30), torch.full((3,), 6.0))


def test_user_executor_is_not_shut_down():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gradmap.tmap(lambda x: x * 2, torch.arange(6.0), executor=pool)
        assert pool.submit(lambda: 7).result() == 7


@pytest.mark.parametrize("bad", [1.5, "2", True])
def test_workers_type(bad):
    with pytest.raises(TypeError, match="workers must be an int"):
        resolve(None, bad)


def test_bad_executor_type():
    with pytest.raises(TypeError, match="executor must be"):
        resolve(42, None)


def test_caller_thread_settings_untouched_by_a_pool_map():
    before = torch.get_num_threads()
    seen = gradmap.tmap(lambda i: torch.get_num_threads(), range(8), workers=2, chunksize=1)
    assert torch.get_num_threads() == before
    assert set(seen) == {1}


def test_intra_op_threads_restored_after_map():
    before = torch.get_num_threads()
    gradmap.tmap(lambda x: x * 2, torch.arange(8.0), workers=2)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_intra_op_budget_inside_workers(executor):
    seen = gradmap.tmap(lambda i: torch.get_num_threads(), range(8), executor=executor, chunksize=1)
    # The serial reference runs as the caller's loop would; pools use one intra-op thread.
    assert set(seen) == ({torch.get_num_threads()} if executor == "serial" else {1})


@deadline(60)
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_pullbacks_run_on_threads_that_ran_no_forward(workers: int, api: str) -> None:
    # NOTE [pullbacks on threads of their own]: a chunk's graph is freed where no forward
    # allocates. (tsum pulls back during the forward; results that are not losses wait for
    # the sum's backward, which runs as tmap's does.)
    seen: dict[str, set[str]] = {"forward": set(), "backward": set()}

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            seen["forward"].add(threading.current_thread().name)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            seen["backward"].add(threading.current_thread().name)
            return g

    w = torch.linspace(0.5, 1.5, 3, requires_grad=True)

    def f(i: int) -> torch.Tensor:
        return Mark.apply(w * i).sin()  # not a loss: tsum pulls it back in its backward

    want = sum(torch.autograd.grad(f(i).sum(), w)[0] for i in range(16))
    seen["forward"].clear()
    seen["backward"].clear()
    for _ in range(3):  # the first calls measure where the forward runs
        if api == "tmap":
            total = torch.stack(gradmap.tmap(f, range(16), workers=workers)).sum()
        else:
            total = gradmap.tsum(f, range(16), workers=workers).sum()
        (g,) = torch.autograd.grad(total, w)
        torch.testing.assert_close(g, want)
    assert seen["forward"] and all(n.startswith("gradmap_") for n in seen["forward"]), seen
    assert seen["backward"] and all(n.startswith("gradmap-pullback_") for n in seen["backward"]), (
        seen
    )


# -- after a fork ---------------------------------------------------------------------------------


def _forked_map(executor: str) -> tuple[float, float]:
    w = torch.linspace(-1.0, 1.0, 3, requires_grad=True)
    xs = [torch.full((3,), 0.1 * i) for i in range(16)]
    total = gradmap.tsum(lambda x: (x * w).sin().sum(), xs, executor=executor, chunksize=2)
    (grad,) = torch.autograd.grad(total, w)
    return float(total.detach()), float(grad.sum())


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_maps_on_pools_of_its_own():
    """A child forked after the parent's pools started (``multiprocessing``'s default start on
    Linux) runs its maps on threads of its own, not on the parent's, which it does not have
    (NOTE [after a fork]); the parent's pool goes on working."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    want = _forked_map("threads")  # the parent's pool threads now exist
    with multiprocessing.get_context("fork").Pool(1) as children:
        got = children.apply_async(_forked_map, ("threads",)).get(timeout=120)
    assert got == pytest.approx(want)
    assert _forked_map("threads") == pytest.approx(want)
