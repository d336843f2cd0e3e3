"""Reliability: injected faults, interrupts, load, bad input and properties, each under a hard
deadline, so that a hang fails the test instead of blocking the run.

Every case checks what the caller sees (the exception, its type and the note naming the element),
what is left behind (threads, half-consumed input, gradients) and that the executor still gives
the plain loop's gradients afterwards.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import gradmap
from gradmap import _executors

from support import (
    EXECUTORS,
    Boom,
    assert_threads_back,
    deadline,
    executor_kwargs,
    gradmap_notes,
    gradmap_threads,
    settle_threads,
)

# -- helpers --------------------------------------------------------------------------------------

MAX_WORKERS = 4  # the most workers any test here asks of the shared pool


def _loop_grads(f: Callable[[int], Tensor], n: int, w: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(torch.stack([f(i) for i in range(n)]).sum(), w)
    return g


def _assert_usable(kwargs: dict[str, Any], w: Tensor) -> None:
    """A normal map and backward on the executor gives the loop's gradients."""

    def f(i: int) -> Tensor:
        return (w * (i + 1)).sin().sum()

    ys = gradmap.tmap(f, range(13), chunksize=3, **kwargs)
    (g,) = torch.autograd.grad(torch.stack(ys).sum(), w)
    torch.testing.assert_close(g, _loop_grads(f, 13, w))


N_FAULT = 13  # with chunksize 4: chunks [0..3] [4..7] [8..11] [12]; by default: one per element


# -- 1. fault injection: forward ------------------------------------------------------------------


@pytest.mark.parametrize("chunksize", [4, None])
@pytest.mark.parametrize("mode", ["graph", "no_grad", "remat"])
@pytest.mark.parametrize("name", EXECUTORS)
@deadline(60)
def test_forward_fault_at_every_element(name: str, mode: str, chunksize: int | None) -> None:
    w = torch.linspace(0.5, 1.5, 5, requires_grad=True)
    with executor_kwargs(name) as (kwargs, pools):
        baseline = settle_threads(*pools, workers=MAX_WORKERS)
        for bad in range(N_FAULT):
            ran: list[int] = []

            def f(i: int, bad: int = bad, ran: list[int] = ran) -> Tensor:
                ran.append(i)
                if i == bad:
                    raise Boom(f"element {i} failed")
                return (w * i).sum()

            grad_mode = torch.no_grad() if mode == "no_grad" else contextlib.nullcontext()
            with grad_mode, pytest.raises(Boom, match=f"^element {bad} failed") as info:
                gradmap.tmap(
                    f, range(N_FAULT), chunksize=chunksize, remat=mode == "remat", **kwargs
                )
            assert str(info.value) == f"element {bad} failed"
            notes = gradmap_notes(info.value)
            assert len(notes) == 1, notes
            assert f"forward pass of element {bad} (of {N_FAULT})" in notes[0]
            if name == "serial":
                assert ran == list(range(bad + 1))  # nothing after the failure ran
            assert_threads_back(baseline)
        _assert_usable(kwargs, w)
        assert_threads_back(baseline)


# -- 1. fault injection: backward -----------------------------------------------------------------


class FailBackwardAt(torch.autograd.Function):
    """The identity, whose backward raises for element ``bad``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, i: int, bad: int) -> Tensor:  # type: ignore[override]
        ctx.i, ctx.bad = i, bad
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None]:  # type: ignore[override]
        if ctx.i == ctx.bad:
            raise Boom(f"backward of element {ctx.i} failed")
        return g, None, None


def _backward_fault_run(name: str, chunksize: int | None, how: str) -> None:
    w = torch.linspace(0.5, 1.5, 5, requires_grad=True)
    with executor_kwargs(name) as (kwargs, pools):
        baseline = settle_threads(*pools, workers=MAX_WORKERS)
        for bad in range(N_FAULT):

            def f(i: int, bad: int = bad) -> Tensor:
                return FailBackwardAt.apply((w * (i + 1)).sin(), i, bad).sum()

            ys = gradmap.tmap(
                f, range(N_FAULT), chunksize=chunksize, remat=how == "remat", **kwargs
            )
            loss = torch.stack(ys).sum()
            with pytest.raises(Boom, match=f"^backward of element {bad} failed") as info:
                if how == "create_graph":
                    torch.autograd.grad(loss, w, create_graph=True)
                else:
                    loss.backward()
            assert str(info.value) == f"backward of element {bad} failed"
            assert w.grad is None  # nothing reached the parameter: no half-done backward
            notes = gradmap_notes(info.value)
            assert len(notes) == 1, notes
            assert f"backward pass of element {bad} (of {N_FAULT})" in notes[0], notes
            assert_threads_back(baseline)
        _assert_usable(kwargs, w)
        assert_threads_back(baseline)


@pytest.mark.parametrize("chunksize", [4, None])
@pytest.mark.parametrize("name", EXECUTORS)
@deadline(60)
def test_backward_fault_at_every_element(name: str, chunksize: int | None) -> None:
    _backward_fault_run(name, chunksize, "stored")


@pytest.mark.parametrize("how", ["create_graph", "remat"])
@deadline(60)
def test_backward_fault_at_every_element_recomputed(how: str) -> None:
    _backward_fault_run("threads", 4, how)


@pytest.mark.parametrize("name", ["threads", "user-pool"])
@deadline(30)
def test_two_faults_the_lowest_element_is_reported(name: str) -> None:
    nine_failed = threading.Event()

    def f(i: int) -> Tensor:
        if i == 0:  # the first chunk is slow: it is still running when element 9 fails
            nine_failed.wait(5)
            time.sleep(0.05)
        if i in (2, 9):
            if i == 9:
                nine_failed.set()
            raise Boom(f"element {i} failed")
        return torch.zeros(())

    with executor_kwargs(name) as (kwargs, pools):
        settle_threads(*pools, workers=MAX_WORKERS)
        kwargs.setdefault("workers", 2)
        with pytest.raises(Boom) as info:
            gradmap.tmap(f, range(N_FAULT), chunksize=4, **kwargs)
    assert str(info.value) == "element 2 failed", gradmap_notes(info.value)


@deadline(30)
def test_fault_in_a_nested_map_names_both_elements() -> None:
    w = torch.ones(2, requires_grad=True)

    def inner(j: int) -> Tensor:
        if j == 3:
            raise Boom("inner failed")
        return (w * j).sum()

    def outer(i: int) -> Tensor:
        return torch.stack(gradmap.tmap(inner, range(i + 1), workers=2, chunksize=1)).sum()

    with pytest.raises(Boom, match="inner failed") as info:
        gradmap.tmap(outer, range(6), workers=MAX_WORKERS, chunksize=1)
    notes = gradmap_notes(info.value)
    assert len(notes) == 2, notes
    assert "element 3 (of 4)" in notes[0]  # the inner map of outer element 3 fails first
    assert "element 3 (of 6)" in notes[1]
    _assert_usable({"workers": MAX_WORKERS}, w)


# -- 1. KeyboardInterrupt in the caller's thread --------------------------------------------------


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("SIGALRM")


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, ran: list[int], i: int) -> Tensor:  # type: ignore[override]
        ctx.ran, ctx.i = ran, i
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        ctx.ran.append(ctx.i)
        for _ in range(5):
            time.sleep(0.001)
        return g, None, None


N_LONG = 2000  # at ~5 ms an element, the full map would take seconds


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("name", EXECUTORS)
@deadline(60, main_thread=True)
def test_keyboard_interrupt_in_caller_cancels_the_rest(name: str, phase: str) -> None:
    w = torch.ones(3, requires_grad=True)
    ran: list[int] = []

    def slow_forward(i: int) -> Tensor:
        ran.append(i)
        for _ in range(5):
            time.sleep(0.001)
        return (w * i).sum()

    def slow_backward(i: int) -> Tensor:
        return SlowBackward.apply(w * i, ran, i).sum()

    caller_threads = torch.get_num_threads()
    previous = signal.signal(signal.SIGALRM, _raise_interrupt)
    try:
        with executor_kwargs(name) as (kwargs, pools):
            baseline = settle_threads(*pools, workers=MAX_WORKERS)
            ys = None
            if phase == "backward":
                ys = gradmap.tmap(slow_backward, range(N_LONG), **kwargs)
            start = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, 0.15)
            try:
                with pytest.raises(KeyboardInterrupt):
                    if ys is None:
                        gradmap.tmap(slow_forward, range(N_LONG), **kwargs)
                    else:
                        torch.stack(ys).sum().backward()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            elapsed = time.monotonic() - start
            count = len(ran)
            time.sleep(0.05)
            assert len(ran) == count, "elements still ran after the interrupt reached the caller"
            assert count < N_LONG // 10, f"{count} of {N_LONG} elements ran"
            assert elapsed < 2.0
            assert w.grad is None
            ys = None
            assert torch.get_num_threads() == caller_threads
            _assert_usable(kwargs, w)
            assert_threads_back(baseline)
    finally:
        signal.signal(signal.SIGALRM, previous)


# -- 1. an interrupt at any point of the engine's bookkeeping --------------------------------------

_INJECT = textwrap.dedent(
    """
    import concurrent.futures, json, os, sys, threading
    import torch, gradmap

    SRC = os.path.dirname(gradmap.__file__)
    w = torch.ones(3, requires_grad=True)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    EXECUTORS = {"serial": "serial", "threads": "threads", "user-pool": pool}

    def attempt(k, ex, out):
        count = [0]

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(SRC):
                count[0] += 1
                if count[0] == k:
                    back = frame.f_back
                    out["at"] = f"{frame.f_code.co_name} called from {back.f_code.co_name}"
                    raise KeyboardInterrupt("injected")
            return None

        threads = torch.get_num_threads()
        sys.settrace(tracer)
        try:
            ys = gradmap.tmap(lambda i: (w * i).sum(), range(4), executor=ex, chunksize=1)
            torch.autograd.grad(torch.stack(ys).sum(), w)
            out["outcome"] = "completed"
        except KeyboardInterrupt:
            out["outcome"] = "KeyboardInterrupt"
        except BaseException as exc:
            out["outcome"] = repr(exc)
        finally:
            sys.settrace(None)
        out["calls"] = count[0]
        out["threads_changed"] = torch.get_num_threads() != threads

    def usable(ex):
        ok = []
        def go():
            ys = gradmap.tmap(lambda i: (w * i).sum(), range(4), executor=ex, chunksize=1)
            ok.append(torch.autograd.grad(torch.stack(ys).sum(), w)[0].tolist() == [6.0] * 3)
        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(5)
        return ok == [True]

    report = {}
    for name, ex in EXECUTORS.items():
        points, bad, k = 0, [], 1
        while True:
            out = {}
            t = threading.Thread(target=attempt, args=(k, ex, out), daemon=True)
            t.start()
            t.join(3)
            if t.is_alive():
                bad.append({"k": k, "at": out.get("at"), "problem": "hang"})
                break  # a stuck thread may hold what the next attempt needs
            if out["outcome"] == "completed" and out["calls"] < k:
                break  # no k-th call: every point was tried
            points += 1
            problem = None
            if out["outcome"] not in ("completed", "KeyboardInterrupt"):
                problem = out["outcome"]
            elif out["threads_changed"]:
                problem = "the caller's intra-op thread count was left changed"
            elif not usable(ex):
                problem = "the executor is not usable afterwards"
            if problem:
                bad.append({"k": k, "at": out.get("at"), "problem": problem})
            k += 1
        report[name] = {"points": points, "bad": bad}
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)
    """
)


def _inject_interrupts() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _INJECT], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


@deadline(300)
def test_interrupt_at_any_call_in_the_caller_leaves_nothing_behind() -> None:
    """A signal handler runs at a function's entry (or a loop's back edge): inject the interrupt
    at the entry of each gradmap function called in the caller's thread, in turn, in a separate
    process (a hang leaves a stuck thread behind)."""
    report = _inject_interrupts()
    for name, entry in report.items():
        assert entry["points"] > 20, report  # the injection reached the engine
        assert entry["bad"] == [], f"{name}: {entry['bad']}"


# -- 1. saturated and nested executors ------------------------------------------------------------


@deadline(30)
def test_busy_user_pool_does_not_block() -> None:
    """A user pool whose only thread is busy, passed with ``caller_helps=True``: the caller
    does every chunk itself."""
    w = torch.ones(3, requires_grad=True)
    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        blocker = pool.submit(release.wait, 20)
        try:
            helping = gradmap.FuturesExecutor(pool, caller_helps=True)
            ys = gradmap.tmap(lambda i: (w * i).sum(), range(20), executor=helping, chunksize=1)
            (g,) = torch.autograd.grad(torch.stack(ys).sum(), w)
            torch.testing.assert_close(g, torch.full((3,), 190.0))
        finally:
            release.set()
        blocker.result(5)


@deadline(60)
def test_nested_maps_under_many_callers_do_not_deadlock() -> None:
    w = torch.linspace(0.5, 1.5, 4, requires_grad=True)

    def inner(j: int) -> Tensor:
        return (w * j).cos().sum()

    def outer(i: int) -> Tensor:
        return torch.stack(gradmap.tmap(inner, range(i % 5 + 1), workers=2)).sum()

    expected = _loop_grads(lambda i: sum(inner(j) for j in range(i % 5 + 1)), 12, w)
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(10):
                ys = gradmap.tmap(outer, range(12), workers=MAX_WORKERS, chunksize=1)
                (g,) = torch.autograd.grad(torch.stack(ys).sum(), w)
                torch.testing.assert_close(g, expected)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_many_callers_sharing_a_model_and_a_tensor_made_before_the_calls() -> None:
    """Eight threads map over one shared model whose f uses ``shared = w * 2``, made once before
    the calls, with tmap, tsum and nested maps on mixed executors, each asking
    ``autograd.grad(..., retain_graph=True)``: each gets the loop's gradients (a map must change
    nothing another map shares: the shared tensor's graph is run by each caller's own backward)."""
    torch.manual_seed(12)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    shared = w * 2
    params = [*net.parameters(), w]
    data = [[torch.randn(k % 4 + 1, 4, dtype=torch.float64) for k in range(9)] for _ in range(8)]

    def f(x: Tensor) -> Tensor:
        return net(x * shared).tanh().sum()

    def nested(x: Tensor) -> Tensor:
        return torch.stack(gradmap.tmap(lambda row: f(row.unsqueeze(0)), x, workers=2)).sum()

    def loss(c: int, xs: list[Tensor], mapped: bool) -> Tensor:
        g = nested if c % 4 == 3 else f
        if not mapped:
            return sum((g(x) for x in xs), torch.zeros((), dtype=torch.float64))
        executor = [None, "serial", "threads", None][c % 4]
        if c % 2:
            return gradmap.tsum(g, xs, executor=executor, chunksize=2)
        return torch.stack(gradmap.tmap(g, xs, executor=executor, chunksize=2)).sum()

    expected = [
        torch.autograd.grad(loss(c, xs, False), params, retain_graph=True)
        for c, xs in enumerate(data)
    ]
    barrier = threading.Barrier(len(data))
    errors: list[BaseException] = []

    def caller(c: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                got = torch.autograd.grad(loss(c, data[c], True), params, retain_graph=True)
                for a, b in zip(got, expected[c]):
                    torch.testing.assert_close(a, b)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(len(data))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert errors == [], errors[0]


# -- 2. load --------------------------------------------------------------------------------------


class _Workload:
    """A map whose loop gradients are known: items of varying sizes, some requiring grad."""

    def __init__(self, n: int, max_rows: int, generator: torch.Generator) -> None:
        self.weight = torch.randn(8, 6, generator=generator, requires_grad=True)
        self.bias = torch.randn(8, generator=generator, requires_grad=True)
        rows = torch.randint(1, max_rows + 1, (n,), generator=generator).tolist()
        self.items = [
            torch.randn(r, 6, generator=generator, requires_grad=i % 2 == 0)
            for i, r in enumerate(rows)
        ]
        self.scale = torch.rand(n, generator=generator) + 0.5
        self.inputs = [self.weight, self.bias, *(x for x in self.items if x.requires_grad)]
        self.expected = self.grads([self.f(x) for x in self.items])

    def f(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.weight.T + self.bias).pow(2).mean()

    def grads(self, ys: list[Tensor]) -> tuple[Tensor, ...]:
        loss = (torch.stack(ys) * self.scale).sum()
        return torch.autograd.grad(loss, self.inputs)


LOAD_CALLERS = 8
LOAD_CALLS = 50


@deadline(120)
def test_load_many_callers_mixed_executors_and_sizes() -> None:
    generator = torch.Generator().manual_seed(7)
    workloads = [
        _Workload(3, 2, generator),  # tiny: fewer elements than workers
        _Workload(17, 12, generator),
        _Workload(40, 30, generator),  # more elements than the automatic chunk count
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as shared:
        executors: list[dict[str, Any]] = [
            {"executor": "serial"},
            {"executor": "threads"},
            {"executor": None, "workers": MAX_WORKERS, "chunksize": 1},
            {"executor": shared},
            {"executor": shared, "workers": 2, "chunksize": 5},
        ]
        baseline = settle_threads(shared, workers=MAX_WORKERS)
        start = threading.Barrier(LOAD_CALLERS)
        failures: list[str] = []
        calls = [0] * LOAD_CALLERS

        def caller(t: int) -> None:
            start.wait()
            for c in range(LOAD_CALLS):
                load = workloads[(t + c) % len(workloads)]
                kwargs = executors[(3 * t + c) % len(executors)]
                try:
                    got = load.grads(gradmap.tmap(load.f, load.items, **kwargs))
                    for g, e in zip(got, load.expected, strict=True):
                        torch.testing.assert_close(g, e)
                except BaseException as exc:
                    failures.append(f"caller {t} call {c} {kwargs}: {exc!r}")
                calls[t] += 1

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(LOAD_CALLERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert sum(calls) == LOAD_CALLERS * LOAD_CALLS
        assert_threads_back(baseline)


@deadline(60)
def test_load_callers_growing_the_shared_pool() -> None:
    """Callers asking for more and more workers make the shared pool replace itself under load."""
    w = torch.linspace(0.5, 1.5, 4, requires_grad=True)

    def f(i: int) -> Tensor:
        return (w * i).sin().sum()

    expected = _loop_grads(f, 20, w)
    failures: list[str] = []

    def caller(t: int) -> None:
        for c in range(25):
            workers = 1 + (t * 5 + c * 3) % 8
            try:
                ys = gradmap.tmap(f, range(20), workers=workers, chunksize=[None, 1, 3][c % 3])
                (g,) = torch.autograd.grad(torch.stack(ys).sum(), w)
                torch.testing.assert_close(g, expected)
            except BaseException as exc:
                failures.append(f"caller {t} call {c} workers={workers}: {exc!r}")

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(LOAD_CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    most = sum(p._max_workers for p in _executors.shared_pools(1))  # type: ignore[attr-defined]
    stop = time.monotonic() + 5
    while time.monotonic() < stop:  # the replaced pools' threads have exited
        ours = gradmap_threads()
        if len(ours) <= most:
            break
        time.sleep(0.01)
    assert len(ours) <= most, [t.name for t in ours]


@deadline(30)
def test_threads_started_during_a_map_keep_the_intra_op_default() -> None:
    def fresh_thread_setting() -> int:
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        return seen[0]

    default = fresh_thread_setting()
    w = torch.ones(3, requires_grad=True)
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:

        def mapping() -> None:
            while not stop.is_set():
                gradmap.tmap(lambda i: (w * i).sum(), range(8), executor=pool, chunksize=1)

        mapper = threading.Thread(target=mapping)
        mapper.start()
        try:
            seen = {}
            end = time.monotonic() + 3
            while time.monotonic() < end:
                n = fresh_thread_setting()
                seen[n] = seen.get(n, 0) + 1
        finally:
            stop.set()
            mapper.join()
    assert seen == {default: sum(seen.values())}, f"fresh threads saw {seen}"
    assert fresh_thread_setting() == default


# -- 4. bad input ---------------------------------------------------------------------------------


class _Source:
    """A generator of items that records how far it was read."""

    def __init__(self, n: int = 5) -> None:
        self.read = 0
        self.n = n

    def __iter__(self) -> Iterator[Tensor]:
        for i in range(self.n):
            self.read += 1
            yield torch.full((2,), float(i), requires_grad=True)


def _shut_down_pool() -> concurrent.futures.ThreadPoolExecutor:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.shutdown()
    return pool


_BAD_ARGUMENTS = [
    pytest.param({"f": 3}, TypeError, "f must be callable, got int", id="f-not-callable"),
    pytest.param({"workers": 0}, ValueError, "workers must be at least 1, got 0", id="workers-0"),
    pytest.param(
        {"workers": -2}, ValueError, "workers must be at least 1, got -2", id="workers-neg"
    ),
    pytest.param({"workers": 2.0}, TypeError, "workers must be an int or None", id="workers-float"),
    pytest.param({"workers": "2"}, TypeError, "workers must be an int or None", id="workers-str"),
    pytest.param({"workers": True}, TypeError, "workers must be an int or None", id="workers-bool"),
    pytest.param({"executor": "procs"}, ValueError, "unknown executor 'procs'", id="executor-name"),
    pytest.param({"executor": 3}, TypeError, "executor must be None, a name", id="executor-type"),
    pytest.param(
        {"executor": _shut_down_pool}, RuntimeError, "has been shut down", id="executor-shut-down"
    ),
    pytest.param(
        {"chunksize": 0}, ValueError, "chunksize must be at least 1, got 0", id="chunksize-0"
    ),
    pytest.param(
        {"chunksize": -1}, ValueError, "chunksize must be at least 1, got -1", id="chunksize-neg"
    ),
    pytest.param(
        {"chunksize": 1.5}, TypeError, "chunksize must be an int or None", id="chunksize-float"
    ),
    pytest.param(
        {"chunksize": "4"}, TypeError, "chunksize must be an int or None", id="chunksize-str"
    ),
]


@pytest.mark.parametrize(("change", "error", "message"), _BAD_ARGUMENTS)
@deadline(30)
def test_bad_argument_is_named(change: dict[str, Any], error: type, message: str) -> None:
    calls: list[Any] = []
    kwargs: dict[str, Any] = {k: v() if callable(v) else v for k, v in change.items()}
    f = kwargs.pop("f", calls.append)
    with pytest.raises(error, match=message):
        gradmap.tmap(f, _Source(), **kwargs)
    assert calls == []


@pytest.mark.parametrize(("change", "error", "message"), _BAD_ARGUMENTS)
@deadline(30)
def test_bad_argument_reads_no_item(change: dict[str, Any], error: type, message: str) -> None:
    """Arguments are checked before anything is read: a generator passed in is left untouched."""
    source = _Source()
    kwargs: dict[str, Any] = {k: v() if callable(v) else v for k, v in change.items()}
    f = kwargs.pop("f", lambda x: x)
    with pytest.raises(error):
        gradmap.tmap(f, source, **kwargs)
    assert source.read == 0


@deadline(30)
def test_strict_length_mismatch_runs_nothing() -> None:
    calls: list[Any] = []
    before = threading.active_count()
    with pytest.raises(ValueError, match="iterable 0 has 3, iterable 1 has 2"):
        gradmap.tmap(lambda a, b: calls.append(a), [1, 2, 3], [1, 2], strict=True)
    with pytest.raises(ValueError, match="different lengths"):
        gradmap.tmap(lambda a, b: calls.append(a), iter(range(3)), [1, 2, 3, 4], strict=True)
    assert calls == []
    assert threading.active_count() <= before


@pytest.mark.parametrize("position", [0, 2, 4])
@deadline(30)
def test_iterable_raising_midway_runs_nothing(position: int) -> None:
    calls: list[Any] = []

    def items() -> Iterator[int]:
        yield from range(position)
        raise Boom("cannot read")

    with pytest.raises(Boom, match="cannot read") as info:
        gradmap.tmap(lambda x, y: calls.append(x), range(9), items())
    assert calls == []
    assert any(f"element {position}" in n and "nothing ran" in n for n in gradmap_notes(info.value))


@deadline(30)
def test_zero_dim_tensor_iterable() -> None:
    calls: list[Any] = []
    source = _Source()
    with pytest.raises(TypeError, match="iterable 1 is a 0-d tensor"):
        gradmap.tmap(lambda a, b: calls.append(a), source, torch.tensor(2.0))
    assert calls == [] and source.read == 0


@pytest.mark.parametrize("name", EXECUTORS)
@deadline(30)
def test_results_of_different_structure_per_element(name: str) -> None:
    """Results are per element: f may return a different pytree for each; gradients flow."""
    w = torch.linspace(-1, 1, 3, requires_grad=True)
    xs = [torch.full((3,), float(i + 1), requires_grad=True) for i in range(7)]

    def f(x: Tensor) -> Any:
        k = int(x[0].item()) % 4
        if k == 0:
            return (w * x).sum()
        if k == 1:
            return {"a": w * x, "tag": "one", "b": (x.sum(), None)}
        if k == 2:
            return [w.exp() * x, 2]
        return None

    def loss(ys: list[Any]) -> Tensor:
        total = torch.zeros(())
        for y in ys:
            if isinstance(y, Tensor):
                total = total + y
            elif isinstance(y, dict):
                total = total + y["a"].sum() * 2 + y["b"][0]
            elif isinstance(y, list):
                total = total + y[0].pow(2).sum()
        return total

    want = [f(x) for x in xs]
    expected = torch.autograd.grad(loss(want), [w, *xs], allow_unused=True)
    with executor_kwargs(name) as (kwargs, _):
        got = gradmap.tmap(f, xs, chunksize=2, **kwargs)
        grads = torch.autograd.grad(loss(got), [w, *xs], allow_unused=True)
    assert [type(y) for y in got] == [type(y) for y in want]
    for g, e in zip(got, want):
        if isinstance(e, dict):
            assert g.keys() == e.keys() and g["tag"] == "one" and g["b"][1] is None
            torch.testing.assert_close(g["a"], e["a"])
        elif isinstance(e, list):
            assert len(g) == 2 and g[1] == 2
            torch.testing.assert_close(g[0], e[0])
        elif isinstance(e, Tensor):
            torch.testing.assert_close(g, e)
    for g, e in zip(grads, expected, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            torch.testing.assert_close(g, e)
    # Stacking unlike results is the user's business: it fails as it does on the loop's.
    with pytest.raises((RuntimeError, TypeError)) as in_the_loop:
        torch.stack(want)  # type: ignore[arg-type]
    with pytest.raises(type(in_the_loop.value)):
        torch.stack(got)  # type: ignore[arg-type]


@deadline(30)
def test_zero_cotangent_skips_the_element_and_gives_zeros() -> None:
    """Documented: an element whose cotangents are all zero does no backward work and gets zero
    gradients. Where the loop would multiply that zero by an infinite local derivative (sqrt at
    0) it gets nan; gradmap gives 0 there, by design (the issue asks for the skip)."""
    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    (loop,) = torch.autograd.grad(torch.stack([xi.sqrt() for xi in x]).sum() * 0, x)
    (got,) = torch.autograd.grad(torch.stack(gradmap.tmap(torch.sqrt, x)).sum() * 0, x)
    torch.testing.assert_close(got, torch.zeros(3))
    assert torch.isnan(loop[0]) and not torch.isnan(loop[1:]).any()  # the difference, stated


# -- 5. properties --------------------------------------------------------------------------------

_USER_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)

_EXECUTOR_CHOICES: list[dict[str, Any]] = [
    {"executor": "serial"},
    {"executor": "threads"},
    {"executor": "threads", "workers": 1},
    {"executor": None, "workers": 2},
    {"executor": None, "workers": 4},
    {"executor": _USER_POOL},
    {"executor": _USER_POOL, "workers": 1},
]

# An element's items: one of these shapes, built from (leaf kinds); "g" requires grad.
_ITEM_SHAPES = ["g", ("g", "n"), {"x": "g", "k": "int"}, ["g", ("n", "g")], {"x": ("g",)}]


def _make_item(shape: Any, size: int, base: float) -> Any:
    if shape == "g":
        return torch.linspace(base, base + 1, size).requires_grad_()
    if shape == "n":
        return torch.linspace(-base, 1, size)
    if shape == "int":
        return int(base * 10) % 7
    if isinstance(shape, dict):
        return {k: _make_item(v, size, base + 0.1 * j) for j, (k, v) in enumerate(shape.items())}
    built = [_make_item(s, size, base + 0.1 * j) for j, s in enumerate(shape)]
    return tuple(built) if isinstance(shape, tuple) else built


def _grad_leaves(tree: Any) -> list[Tensor]:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return [x for x in leaves if isinstance(x, Tensor) and x.requires_grad]


_PARAM = torch.linspace(-0.5, 0.5, 4).requires_grad_()


def _property_f(item: Any) -> dict[str, Any]:
    xs = [x for x in torch.utils._pytree.tree_leaves(item) if isinstance(x, Tensor)]
    s = sum((x.sum() for x in xs), torch.zeros(()))
    v = torch.sin(_PARAM * s) + _PARAM.pow(2) * len(xs)
    return {"sum": s * _PARAM[0], "pair": (v, v.cos().sum()), "n": len(xs)}


def _outputs(ys: list[dict[str, Any]]) -> list[Tensor]:
    return [t for y in ys for t in (y["sum"], y["pair"][0], y["pair"][1])]


@st.composite
def _maps(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(0, 50))
    shapes = draw(st.lists(st.sampled_from(range(len(_ITEM_SHAPES))), min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    items = [_make_item(_ITEM_SHAPES[s], k, 0.1 * i) for i, (s, k) in enumerate(zip(shapes, sizes))]
    used = draw(st.lists(st.booleans(), min_size=3 * n, max_size=3 * n))
    weights = draw(st.lists(st.floats(0.5, 2.0), min_size=3 * n, max_size=3 * n))
    return {"items": items, "used": used, "weights": weights}


def _property_grads(ys: list[Any], m: dict[str, Any]) -> list[Tensor | None]:
    terms = [
        (t * w).sum() for t, u, w in zip(_outputs(ys), m["used"], m["weights"], strict=True) if u
    ]
    inputs = [_PARAM, *_grad_leaves(m["items"])]
    if not terms:
        return [None] * len(inputs)
    return list(torch.autograd.grad(sum(terms), inputs, allow_unused=True))


@deadline(120)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=_maps(),
    kwargs=st.sampled_from(_EXECUTOR_CHOICES),
    chunksize=st.one_of(st.none(), st.integers(1, 7)),
    remat=st.booleans(),
)
def test_property_gradients_equal_the_loop(
    m: dict[str, Any], kwargs: dict[str, Any], chunksize: int | None, remat: bool
) -> None:
    ys = gradmap.tmap(_property_f, m["items"], chunksize=chunksize, remat=remat, **kwargs)
    want = [_property_f(x) for x in m["items"]]
    assert [y["n"] for y in ys] == [y["n"] for y in want]
    for g, e in zip(_outputs(ys), _outputs(want)):
        torch.testing.assert_close(g, e)
    for g, e in zip(_property_grads(ys, m), _property_grads(want, m), strict=True):
        assert (g is None) == (e is None), (g, e)
        if g is not None:
            # The shared parameter's gradient sums up to 150 terms in another order than the
            # loop's (chunk by chunk): float32 rounding reached 2.8e-6 relative in one CI-sized
            # draw, above assert_close's 1.3e-6. A wrong gradient is off by far more.
            torch.testing.assert_close(g, e, rtol=2e-5, atol=1e-4)


@deadline(120)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=_maps(), chunksize=st.one_of(st.none(), st.integers(1, 7)))
def test_property_parameter_gradients_bitwise_equal_across_workers(
    m: dict[str, Any], chunksize: int | None
) -> None:
    results = []
    for workers in (1, 2, 4):
        ys = gradmap.tmap(
            _property_f, m["items"], executor="threads", workers=workers, chunksize=chunksize
        )
        results.append(_property_grads(ys, m))
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first, other, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b), (a - b).abs().max()
