"""A chunk's boundary, read off its graph: what the gradient of a map reaches, vs the loop."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import Tensor

import gradmap

F64 = torch.float64
_HIDDEN: collections.deque[Tensor] = collections.deque()  # the scan of f does not look into it


def _loop(f, xs):
    return [f(x) for x in xs]


def _run(mapper, make_f, xs_n=6, wrt_extra=()):
    torch.manual_seed(3)
    w = torch.randn(3, dtype=F64, requires_grad=True)
    xs = [torch.randn(3, dtype=F64, requires_grad=True) for _ in range(xs_n)]
    f, extra = make_f(w)
    ys = mapper(f, xs)
    wrt = [w, *xs, *extra]
    return list(torch.autograd.grad(torch.stack(ys).pow(2).sum(), wrt, allow_unused=True))


MAPPERS = {
    "serial": lambda f, xs: gradmap.tmap(f, xs, executor="serial", chunksize=2),
    "threads": lambda f, xs: gradmap.tmap(f, xs, workers=2, chunksize=2),
    "tsum-like": lambda f, xs: gradmap.tmap(f, xs, chunksize=1),
}


@pytest.mark.parametrize("mapper", list(MAPPERS))
def test_parameter_used_directly_and_through_a_tensor_made_from_it(mapper):
    """``h = g(w)`` made before the call and ``w`` itself both reach a chunk: ``w``'s gradient
    through ``h`` is counted once (NOTE [nothing past the boundary]), and ``h`` gets its own."""

    def make(w):
        h = (w * 2).exp()
        return (lambda x: (x * w * h).sum() + (h * w).sum()), [h]

    ref = _run(_loop, make)
    got = _run(MAPPERS[mapper], make)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mapper", list(MAPPERS))
def test_tensor_reachable_only_through_a_global_container(mapper):
    def make(w):
        _HIDDEN.clear()
        _HIDDEN.append(w.sin() * 3)  # non-leaf, made before the call, held by a global deque

        def f(x):
            return (x * _HIDDEN[0]).sum()

        return f, [_HIDDEN[0]]

    try:
        ref = _run(_loop, make)
        got = _run(MAPPERS[mapper], make)
    finally:
        _HIDDEN.clear()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mapper", list(MAPPERS))
def test_hooks_and_retained_grads_of_boundary_tensors_as_in_the_loop(mapper):
    def run(mapper_fn):
        torch.manual_seed(4)
        w = torch.randn(3, dtype=F64, requires_grad=True)
        h = w * 2
        h.retain_grad()
        calls = {"w": 0, "h": 0}

        def count(name):
            def hook(g):
                calls[name] += 1
                return g * 2  # a hook that changes the gradient

            return hook

        w.register_hook(count("w"))
        h.register_hook(count("h"))
        xs = [torch.randn(3, dtype=F64) for _ in range(5)]
        ys = mapper_fn(lambda x: (x * h * w).sum(), xs)
        torch.stack(ys).sum().backward()
        return calls, w.grad, h.grad

    ref = run(_loop)
    got = run(MAPPERS[mapper])
    assert got[0] == ref[0]
    torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2])


@pytest.mark.parametrize("mapper", list(MAPPERS))
def test_f_returning_an_item_or_a_closure_tensor_as_it_is(mapper):
    def make(w):
        h = w * 3

        def f(x):
            return {"x": x, "h": h, "w": w, "y": (x * w).sum()}

        return f, [h]

    def run(mapper_fn):
        torch.manual_seed(5)
        w = torch.randn(3, dtype=F64, requires_grad=True)
        xs = [torch.randn(3, dtype=F64, requires_grad=True) for _ in range(4)]
        f, (h,) = make(w)
        out = mapper_fn(f, xs)
        loss = sum((o["x"] * o["h"]).sum() + o["w"].sum() * o["y"] for o in out)
        return torch.autograd.grad(loss, [w, h, *xs])

    for a, b in zip(run(MAPPERS[mapper]), run(_loop)):
        torch.testing.assert_close(a, b)


def test_nested_map_over_rows_of_a_tensor_made_in_the_outer_element():
    """The inner map's boundary (rows cut from ``z``) is inner to the outer chunk: the inner
    map's blocking hooks must not block the outer pullback."""
    torch.manual_seed(6)
    w = torch.randn(3, 3, dtype=F64, requires_grad=True)
    bags = [torch.randn(k, 3, dtype=F64, requires_grad=True) for k in (2, 3, 1, 4)]

    def outer(mapper_inner):
        def f(bag):
            z = bag @ w
            return torch.stack(mapper_inner(lambda row: row.tanh().sum() * z.sum(), z)).sum()

        return f

    ref_ys = [outer(_loop)(b) for b in bags]
    ref = torch.autograd.grad(sum(ref_ys), [w, *bags])
    inner = lambda g, it: gradmap.tmap(g, it, workers=2, chunksize=1)  # noqa: E731
    ys = gradmap.tmap(outer(inner), bags, workers=2, chunksize=1)
    got = torch.autograd.grad(sum(ys), [w, *bags])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("workers", [1, 2])
def test_tsum_runs_boundary_hooks_and_retained_grads_once_as_in_the_loop(workers):
    def run(total):
        torch.manual_seed(4)
        w = torch.randn(3, dtype=F64, requires_grad=True)
        h = w * 2
        h.retain_grad()
        calls = {"w": 0, "h": 0}

        def count(name):
            def hook(g):
                calls[name] += 1
                return g * 2

            return hook

        w.register_hook(count("w"))
        h.register_hook(count("h"))
        xs = [torch.randn(3, dtype=F64) for _ in range(6)]
        total(lambda x: (x * h * w).sum(), xs).backward()
        return calls, w.grad, h.grad

    ref = run(lambda f, xs: torch.stack([f(x) for x in xs]).sum())
    got = run(lambda f, xs: gradmap.tsum(f, xs, workers=workers, chunksize=1))
    assert got[0] == ref[0]
    torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2])
