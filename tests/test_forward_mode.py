"""Forward-mode AD and torch.func through tmap: the plain loop's tangents and gradients.

Under a torch.func transform or a forward-AD dual level, tmap runs as the plain loop in the
caller's thread (NOTE [torch.func and forward AD] in the rule), so these compare exactly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import gradmap

W = torch.randn(3, 3)


def f(x):
    return torch.sin(x @ W).sum() * x.sum()


def mapped(xs):
    return torch.stack(gradmap.tmap(f, xs))


def looped(xs):
    return torch.stack([f(x) for x in xs])


def test_func_jvp_matches_loop():
    xs, v = torch.randn(5, 3), torch.randn(5, 3)
    y1, t1 = torch.func.jvp(mapped, (xs,), (v,))
    y2, t2 = torch.func.jvp(looped, (xs,), (v,))
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(t1, t2)


def test_dual_tensors_match_loop():
    xs, v = torch.randn(5, 3), torch.randn(5, 3)
    with fwAD.dual_level():
        t1 = fwAD.unpack_dual(mapped(fwAD.make_dual(xs, v))).tangent
        t2 = fwAD.unpack_dual(looped(fwAD.make_dual(xs, v))).tangent
    torch.testing.assert_close(t1, t2)


def test_func_grad_and_vjp_match_loop():
    xs = torch.randn(5, 3)
    torch.testing.assert_close(
        torch.func.grad(lambda a: mapped(a).sum())(xs),
        torch.func.grad(lambda a: looped(a).sum())(xs),
    )
    _, pull1 = torch.func.vjp(mapped, xs)
    _, pull2 = torch.func.vjp(looped, xs)
    u = torch.randn(5)
    torch.testing.assert_close(pull1(u)[0], pull2(u)[0])


def test_hessian_vector_product_via_double_backward():
    xs = torch.randn(4, 3, requires_grad=True)
    v = torch.randn(4, 3)

    def hvp(fn):
        (g,) = torch.autograd.grad(fn(xs).sum(), xs, create_graph=True)
        return torch.autograd.grad((g * v).sum(), xs)[0]

    torch.testing.assert_close(hvp(mapped), hvp(looped))


# -- torch.func inside f, on threads: NOTE [parameters swapped by functional_call] -----------------


def _per_sample_model() -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    ).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    scale = torch.ones(1, dtype=torch.float64, requires_grad=True)
    return model, params, scale


def _two_threads(pool: str, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Map arguments for two threads, one element a chunk: gradmap's pool or a user's."""
    if pool == "threads":
        return {"executor": "threads", "workers": 2, "chunksize": 1}
    user = stack.enter_context(concurrent.futures.ThreadPoolExecutor(2))
    return {"executor": user, "chunksize": 1}


@pytest.mark.parametrize("api", ["tmap", "tsum"])
@pytest.mark.parametrize("pool", ["threads", "user-pool"])
def test_functional_call_of_a_shared_module_inside_f_matches_the_loop(api, pool):
    """Per-sample gradients by ``torch.func.grad(functional_call(model, ...))`` on one shared
    module: every chunk thread swaps the module's parameters. Without the guard, 2 threads gave
    other values than the loop in about one call of three and left functorch wrappers in the
    module."""
    model, params, scale = _per_sample_model()
    own = {k: v for k, v in model.named_parameters()}
    xs = [torch.randn(8, dtype=torch.float64) * (1 + i % 5) for i in range(48)]

    def f(x):
        def loss(p, x):
            return (torch.func.functional_call(model, p, (x,)) ** 2).sum()

        g = torch.func.grad(loss)(params, x)
        return sum((v**2).sum() for v in g.values()) * scale

    expected = torch.stack([f(x) for x in xs])
    (expected_grad,) = torch.autograd.grad(expected.sum(), scale)
    with contextlib.ExitStack() as stack:
        kwargs = _two_threads(pool, stack)
        for _ in range(6):
            if api == "tmap":
                ys = torch.stack(gradmap.tmap(f, xs, **kwargs))
                torch.testing.assert_close(ys, expected)
                total = ys.sum()
            else:
                total = gradmap.tsum(f, xs, **kwargs)
                torch.testing.assert_close(total, expected.sum(0))
            (g,) = torch.autograd.grad(total, scale)
            torch.testing.assert_close(g, expected_grad)
    assert all(p is own[k] for k, p in model.named_parameters())


@pytest.mark.parametrize("how", ["plain", "remat", "create_graph"])
@pytest.mark.parametrize("pool", ["threads", "user-pool"])
def test_an_f_that_reads_the_module_outside_its_swap_matches_the_loop(how, pool):
    """The per-element-weights (MAML) pattern: ``f`` reads ``named_parameters()`` outside the
    swap, then ``functional_call``s with weights made from them. The lock covers the swap only:
    that read took another thread's swapped-in tensors (wrong values and gradients, no error, in
    about one map in six on threads). An ``f`` seen to swap keeps its forwards in one thread and
    its recomputes one at a time (NOTE [parameters swapped by functional_call])."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()
    params = list(net.parameters())
    items = [(torch.randn(8, 1, dtype=torch.float64), 0.5 + 0.25 * i) for i in range(8)]
    scope: dict[str, Any] = {"net": net, "functional_call": torch.func.functional_call}
    exec(  # a code object of its own: no history of earlier tests
        "def f(item):\n"
        "    x, s = item\n"
        "    weights = {k: v * s for k, v in net.named_parameters()}\n"
        "    return functional_call(net, weights, (x,)).pow(2).mean()\n",
        scope,
    )
    f = scope["f"]
    expected = torch.stack([f(item) for item in items])
    ref = torch.autograd.grad(expected.sum(), params, create_graph=how == "create_graph")
    ref2 = torch.autograd.grad(sum(g.sum() for g in ref), params) if how == "create_graph" else ()
    with contextlib.ExitStack() as stack:
        kwargs = _two_threads(pool, stack)
        for _ in range(30):
            ys = torch.stack(gradmap.tmap(f, items, remat=how == "remat", **kwargs))
            torch.testing.assert_close(ys, expected)
            got = torch.autograd.grad(ys.sum(), params, create_graph=how == "create_graph")
            torch.testing.assert_close(got, ref)
            if how == "create_graph":
                got2 = torch.autograd.grad(sum(g.sum() for g in got), params)
                torch.testing.assert_close(got2, ref2)


def test_an_f_that_starts_swapping_on_several_threads_is_told_so():
    """An ``f`` whose first map swapped nothing runs on the pool later; a forward there that
    swapped may have read other elements' parameters: it raises, saying so, and the next map
    runs in one thread (NOTE [parameters swapped by functional_call])."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1).double()
    items = [torch.randn(4, 3, dtype=torch.float64) for _ in range(8)]
    scope: dict[str, Any] = {"net": net, "fc": torch.func.functional_call, "swap": [False]}
    exec(
        "def f(x):\n"
        "    if not swap[0]:\n"
        "        return net(x).sum()\n"
        "    return fc(net, {k: v * 2 for k, v in net.named_parameters()}, (x,)).sum()\n",
        scope,
    )
    f = scope["f"]
    kwargs: dict[str, Any] = {"executor": "threads", "workers": 2, "chunksize": 1}
    gradmap.tmap(f, items, **kwargs)  # (its first forward: one thread)
    scope["swap"][0] = True
    with pytest.raises(RuntimeError, match="f swapped a module's parameters"):
        gradmap.tmap(f, items, **kwargs)
    expected = torch.stack([f(x) for x in items])
    torch.testing.assert_close(torch.stack(gradmap.tmap(f, items, **kwargs)), expected)


def test_a_map_inside_a_swapped_module_runs_in_its_caller():
    """A ``tmap`` called inside the forward of a module run by ``functional_call`` on a chunk's
    thread runs every chunk in that thread: no chunk waits for the swap its caller holds."""
    model, params, scale = _per_sample_model()

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x):
            return torch.stack(gradmap.tmap(self.body, list(x), workers=2, chunksize=1)).sum()

    inner = Inner()
    named = {"body." + k: v for k, v in params.items()}
    xs = [torch.randn(4, 8, dtype=torch.float64) for _ in range(6)]

    def f(x):
        return torch.func.functional_call(inner, named, (x,)) * scale

    expected = sum(f(x) for x in xs)
    got = gradmap.tsum(f, xs, workers=2, chunksize=1)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(
        torch.autograd.grad(got, scale)[0], torch.autograd.grad(expected, scale)[0]
    )
