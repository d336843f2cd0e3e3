"""Errors: the element is named, the traceback kept, the rest cancelled, nothing left running."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import traceback

import pytest
import torch

import gradmap

from support import Boom, notes


def _raise_at(bad: int, w: torch.Tensor):
    def f(i: int) -> torch.Tensor:
        if i == bad:
            raise Boom(f"bad element {i}")
        return (w * i).sum()

    return f


@pytest.mark.parametrize("bad", [0, 5, 9])
def test_forward_error_names_element_and_keeps_type(tmap_kwargs, bad):
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(Boom, match=f"bad element {bad}") as info:
        gradmap.tmap(_raise_at(bad, w), range(10), **tmap_kwargs)
    assert f"element {bad} (of 10)" in notes(info.value)
    assert "forward" in notes(info.value)
    # The worker's frames are kept: the traceback reaches the line in f that raised.
    frames = [fr.name for fr in traceback.extract_tb(info.value.__traceback__)]
    assert "f" in frames


def test_forward_error_without_grad(tmap_kwargs):
    w = torch.ones(3)
    with torch.no_grad(), pytest.raises(Boom) as info:
        gradmap.tmap(_raise_at(3, w), range(8), **tmap_kwargs)
    assert "element 3 (of 8)" in notes(info.value)


def test_lowest_failing_element_is_reported(tmap_kwargs):
    def f(i: int) -> torch.Tensor:
        if i in (2, 7):
            raise Boom(str(i))
        return torch.zeros(())

    with pytest.raises(Boom) as info:
        gradmap.tmap(f, range(8), **tmap_kwargs)
    # Chunk 1 (elements 2, 3) fails first in element order; 7 may or may not have run.
    assert str(info.value) == "2"


def test_remaining_elements_are_cancelled():
    started: list[int] = []
    lock = threading.Lock()

    def f(i: int) -> torch.Tensor:
        with lock:
            started.append(i)
        if i == 0:
            raise Boom("first")
        time.sleep(0.01)
        return torch.zeros(())

    with pytest.raises(Boom):
        gradmap.tmap(f, range(200), workers=2, chunksize=1)
    assert len(started) < 50  # the rest never started


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Boom("backward failed")


@pytest.mark.parametrize("bad", [0, 3, 7])
def test_backward_error_names_element(tmap_kwargs, bad):
    w = torch.ones(2, requires_grad=True)

    def f(i: int) -> torch.Tensor:
        y = w * i
        if i == bad:
            y = _FailingBackward.apply(y)
        return y.sum()

    ys = gradmap.tmap(f, range(8), **tmap_kwargs)
    with pytest.raises(Boom, match="backward failed") as info:
        torch.stack(ys).sum().backward()
    assert f"element {bad} (of 8)" in notes(info.value)
    assert "backward" in notes(info.value)


class _FailingBackwardOf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, i):
        ctx.i = i
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Boom(f"backward of element {ctx.i}")


@pytest.mark.parametrize("chunksize", [None, 1, 12])
def test_backward_errors_of_several_elements_raise_the_loops(tmap_kwargs, chunksize):
    """NOTE [the error of the loop's element]: the loop's backward runs the elements made last
    first, so its error is the last failing element's (threads raised the first's)."""
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def f(i: int) -> torch.Tensor:
        y = w * i
        if i in (3, 10):
            y = _FailingBackwardOf.apply(y, i)
        return y.sum()

    with pytest.raises(Boom) as loop:
        torch.stack([f(i) for i in range(12)]).sum().backward()
    ys = gradmap.tmap(f, range(12), **{**tmap_kwargs, "chunksize": chunksize})
    with pytest.raises(Boom) as info:
        torch.stack(ys).sum().backward()
    assert str(info.value) == str(loop.value) == "backward of element 10"
    assert "backward pass of element 10 (of 12)" in notes(info.value)


def test_pool_usable_after_errors(tmap_kwargs):
    w = torch.ones(3, requires_grad=True)
    for _ in range(3):
        with pytest.raises(Boom):
            gradmap.tmap(_raise_at(1, w), range(6), **tmap_kwargs)
    ys = gradmap.tmap(lambda i: (w * i).sum(), range(6), **tmap_kwargs)
    (g,) = torch.autograd.grad(torch.stack(ys).sum(), w)
    torch.testing.assert_close(g, torch.full((3,), 15.0))


def test_no_thread_leaked():
    w = torch.ones(3, requires_grad=True)
    gradmap.tmap(lambda i: (w * i).sum(), range(8), workers=4)  # warm the shared pool
    baseline = threading.active_count()
    for _ in range(20):
        with pytest.raises(Boom):
            gradmap.tmap(_raise_at(2, w), range(8), workers=4)
        ys = gradmap.tmap(lambda i: (w * i).sum(), range(8), workers=4)
        torch.stack(ys).sum().backward()
    assert threading.active_count() == baseline


def test_keyboard_interrupt_in_f_cancels_and_pool_stays_usable():
    def f(i: int) -> torch.Tensor:
        if i == 3:
            raise KeyboardInterrupt
        return torch.zeros(())

    with pytest.raises(KeyboardInterrupt):
        gradmap.tmap(f, range(100), workers=2, chunksize=1)
    assert len(gradmap.tmap(lambda i: i, range(10), workers=2)) == 10


def test_f_not_callable():
    with pytest.raises(TypeError, match="f must be callable"):
        gradmap.tmap(3, [1, 2])  # type: ignore[arg-type]


def test_bad_executor_name():
    names = r"\['processes', 'ray', 'serial', 'threads'\]"
    with pytest.raises(ValueError, match=rf"expected one of {names}"):
        gradmap.tmap(lambda x: x, [1], executor="procs")


@pytest.mark.parametrize("workers", [0, -1])
def test_bad_workers(workers):
    with pytest.raises(ValueError, match="workers must be at least 1"):
        gradmap.tmap(lambda x: x, [1], workers=workers)


def test_bad_chunksize():
    with pytest.raises(ValueError, match="chunksize must be at least 1"):
        gradmap.tmap(lambda x: x, [1], chunksize=0)


def test_shut_down_executor():
    pool = concurrent.futures.ThreadPoolExecutor(2)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="has been shut down"):
        gradmap.tmap(lambda x: x, [1, 2], executor=pool)


def test_process_pool_rejected():
    with (
        concurrent.futures.ProcessPoolExecutor(1) as pool,
        pytest.raises(TypeError, match="ProcessPoolExecutor"),
    ):
        gradmap.tmap(lambda x: x, [1, 2], executor=pool)


def test_zero_dim_tensor_iterable():
    with pytest.raises(TypeError, match="0-d tensor"):
        gradmap.tmap(lambda x: x, torch.tensor(1.0))


def test_iterable_raising_midway_runs_nothing():
    calls: list[int] = []

    def items():
        yield 1
        yield 2
        raise Boom("reading failed")

    with pytest.raises(Boom) as info:
        gradmap.tmap(calls.append, items())
    assert calls == []
    assert "element 2" in notes(info.value)


@pytest.mark.parametrize(
    "iterables",
    [([1, 2, 3], [1, 2]), ([1, 2], (x for x in range(3))), ((x for x in range(2)), [1, 2, 3])],
)
def test_strict_names_lengths(iterables):
    with pytest.raises(ValueError, match="different lengths") as info:
        gradmap.tmap(lambda a, b: a, *iterables, strict=True)
    assert "iterable 0 has" in str(info.value) and "iterable 1 has" in str(info.value)


def test_not_iterable():
    with pytest.raises(TypeError, match="iterable 1 is not iterable"):
        gradmap.tmap(lambda a, b: a, [1], 5)


@pytest.mark.parametrize("api", ["tmap", "tsum"])
@pytest.mark.parametrize("grad", [True, False])
def test_an_f_that_leaves_grad_mode_changed_is_named(tmap_kwargs, api, grad):
    # NOTE [grad mode left changed by f]: on threads the rest of each chunk ran without a graph,
    # and tsum's backward gave the chunks' first elements' gradient alone, with no error.
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(8)]

    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(w @ x).sum()
        if float(x[0]) == float(xs[3][0]):
            torch.set_grad_enabled(not grad)  # left so by mistake
        return y

    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError) as info:
        getattr(gradmap, api)(f, xs, **tmap_kwargs)
    assert f"left grad mode {'off' if grad else 'on'}" in str(info.value)
    assert "element 3 (of 8)" in str(info.value), info.value
    assert torch.is_grad_enabled()  # the caller's, as it was
