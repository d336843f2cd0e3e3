"""Behaviour of ``gradmap.tmap`` against the plain loop ``[f(*args) for args in zip(*its)]``.

The loop is the only reference: results, their structure and every gradient (first and second
order, via ``.backward()`` and ``torch.autograd.grad``) must equal the loop's, on every executor.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
import warnings
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradmap

from support import collect, loop, native_walk

pytestmark = pytest.mark.usefixtures("both_walks")

Tensor = torch.Tensor
Point = namedtuple("Point", ["x", "y"])

#: A module-level global that ``f`` reads (the capture must see it).
GLOBAL_W = torch.linspace(-1.0, 1.0, 3).requires_grad_()


# -- helpers -----------------------------------------------------------------------------------


def weighted_loss(results: list[Any], kind: str = "weighted") -> Tensor:
    """A scalar loss over the floating tensors of the results.

    ``kind``: ``all`` (plain sum), ``weighted`` (element i weighted by i + 1), ``subset`` (every
    other element), ``one`` (element 1 only).
    """
    terms = []
    for i, r in enumerate(results):
        if kind == "subset" and i % 2:
            continue
        if kind == "one" and i != 1:
            continue
        weight = float(i + 1) if kind == "weighted" else 1.0
        for leaf in pytree.tree_leaves(r):
            if isinstance(leaf, Tensor) and leaf.is_floating_point():
                terms.append(weight * leaf.float().sum())
    return torch.stack(terms).sum()


def assert_grads_equal(actual: list[Tensor | None], expected: list[Tensor | None]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if e is None:
            assert a is None, f"gradient {i}: the loop has None, tmap has {a}"
        else:
            assert a is not None, f"gradient {i}: tmap has None, the loop has {e}"
            torch.testing.assert_close(a, e, msg=lambda m, i=i: f"gradient {i}: {m}")


def grads_of(loss: Tensor, wrt: list[Tensor], mode: str, **kwargs: Any) -> list[Tensor | None]:
    """Gradients of ``loss`` by ``loss.backward()`` (reading ``.grad``) or ``autograd.grad``."""
    if mode == "backward":
        for t in wrt:
            t.grad = None
        loss.backward(**kwargs)
        return [None if t.grad is None else t.grad.clone() for t in wrt]
    return list(torch.autograd.grad(loss, wrt, **kwargs))


def run_in_thread(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Run ``fn`` on a daemon thread; fail (instead of hanging) if it does not finish in time."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"did not finish within {timeout} s (deadlock?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


class CountBackward(torch.autograd.Function):
    """Identity whose backward logs ``tag``: counts the backward work per element."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tag: Any, log: list[Any]) -> Tensor:
        ctx.tag, ctx.log = tag, log
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        ctx.log.append(ctx.tag)
        return g, None, None


class MulFn(torch.autograd.Function):
    """A user-defined ``x * w`` with a hand-written backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g * w, g * x


class Affine:
    """A callable object holding tensors as attributes."""

    def __init__(self) -> None:
        self.w = torch.randn(3, 2, requires_grad=True)
        self.b = torch.randn(2, requires_grad=True)

    def __call__(self, x: Tensor) -> Tensor:
        return (x @ self.w + self.b).pow(2).sum()


def _uses_global(x: Tensor) -> Tensor:
    return (x * GLOBAL_W).exp().sum()


# -- the gradient cases --------------------------------------------------------------------------


@dataclass
class Case:
    f: Callable[..., Any]
    iterables: list[Any]
    wrt: list[Tensor]


def _rand_items(n: int, *shape: int, grad: bool = True) -> list[Tensor]:
    return [torch.randn(*shape, requires_grad=grad) for _ in range(n)]


def case_items() -> Case:
    xs, ms = _rand_items(5, 3), _rand_items(5, 2, 3)
    return Case(lambda x, m: (m @ x).tanh().sum(), [xs, ms], xs + ms)


def case_module() -> Case:
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    xs = _rand_items(5, 3, 4)
    return Case(net, [xs], list(net.parameters()) + xs)


def case_module_closure() -> Case:
    lin = nn.Linear(4, 3)
    xs = _rand_items(5, 2, 4)
    return Case(lambda x: lin(x).relu().sum(0), [xs], list(lin.parameters()) + xs)


def case_closure_tensor() -> Case:
    w = torch.randn(3, requires_grad=True)
    xs = _rand_items(5, 3, grad=False)
    return Case(lambda x: (x * w).sin().sum(), [xs], [w])


def case_callable_attribute() -> Case:
    obj = Affine()
    xs = _rand_items(5, 4, 3)
    return Case(obj, [xs], [obj.w, obj.b, *xs])


def case_global() -> Case:
    GLOBAL_W.grad = None
    xs = _rand_items(5, 3)
    return Case(_uses_global, [xs], [GLOBAL_W, *xs])


def case_nonleaf_before_call() -> Case:
    a = torch.randn(3, requires_grad=True)
    h = a.exp() * 2  # computed before the call: its graph must run once, with the summed grad
    xs = _rand_items(5, 3)
    return Case(lambda x: (x * h).cos().sum(), [xs], [a, *xs])


def case_derived_captured() -> Case:
    a = torch.randn(3, requires_grad=True)
    b = 2 * a  # derived from a outside f; f uses both
    xs = _rand_items(5, 3)
    return Case(lambda x: (x * a + b * x**2).sum(), [xs], [a, *xs])


def case_returns_captured() -> Case:
    w = torch.randn(3, requires_grad=True)
    xs = _rand_items(5, 3)
    return Case(lambda x: (w, (x * w).sum()), [xs], [w, *xs])


def case_returns_input() -> Case:
    xs = _rand_items(5, 3)
    return Case(lambda x: (x, x.pow(2).sum()), [xs], xs)


def case_custom_function() -> Case:
    w = torch.randn(3, requires_grad=True)
    xs = _rand_items(5, 3)
    return Case(lambda x: MulFn.apply(x, w).sin().sum(), [xs], [w, *xs])


def case_checkpoint() -> Case:
    w = torch.randn(3, 3, requires_grad=True)
    xs = _rand_items(5, 3)

    def f(x: Tensor) -> Tensor:
        return checkpoint(lambda a: torch.tanh(w @ a).pow(2).sum(), x, use_reentrant=False)

    return Case(f, [xs], [w, *xs])


def case_tensor_iterable() -> Case:
    w = torch.randn(4, requires_grad=True)
    big = torch.randn(6, 4, requires_grad=True)
    return Case(lambda row: (row * w).tanh().sum(), [big], [big, w])


def case_pytree() -> Case:
    xs = _rand_items(4, 3)
    ys = _rand_items(4, 2)
    items = [
        {"a": x, "b": (y, "tag"), "c": None, "p": Point(x * 1.0, 7)}
        for x, y in zip(xs, ys, strict=True)
    ]

    def f(item: dict[str, Any]) -> dict[str, Any]:
        x, (y, _), p = item["a"], item["b"], item["p"]
        return {"s": (x * y.sum()).sin(), "pair": [p.x.exp(), "str"], "none": None, "n": p.y}

    return Case(f, [items], xs + ys)


def case_shared_item() -> Case:
    x = torch.randn(3, requires_grad=True)
    others = _rand_items(4, 3)
    # x is an item of every element and a closure tensor of f as well.
    return Case(lambda a, b: ((a * x).sin() + b * x).sum(), [[x] * 4, others], [x, *others])


def case_duplicate_result() -> Case:
    xs = _rand_items(5, 3)
    return Case(lambda x: (lambda y: (y, [y, x.sum()]))(x.exp()), [xs], xs)


CASES = {name[len("case_") :]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_case(build: Callable[[], Case], mapper: Callable[..., list[Any]], mode: str, kind: str):
    torch.manual_seed(1)
    case = build()
    loss = weighted_loss(mapper(case.f, *case.iterables), kind)
    extra = {"allow_unused": True} if mode == "grad" else {}
    return grads_of(loss, case.wrt, mode, **extra)


@pytest.mark.parametrize("mode", ["backward", "grad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_loop(tmap_kwargs, case, mode):
    """Gradients to items, parameters, closures, attributes, globals... equal the loop's."""
    build = CASES[case]
    expected = _run_case(build, loop, mode, "weighted")
    actual = _run_case(
        build, lambda f, *its: gradmap.tmap(f, *its, **tmap_kwargs), mode, "weighted"
    )
    assert_grads_equal(actual, expected)


@pytest.mark.parametrize("mode", ["backward", "grad"])
@pytest.mark.parametrize("kind", ["all", "subset", "one"])
@pytest.mark.parametrize("case", ["module", "items", "returns_captured"])
def test_partial_losses_match_loop(tmap_kwargs, case, kind, mode):
    """Losses from all results, a subset of them, or one result: gradients equal the loop's."""
    build = CASES[case]
    expected = _run_case(build, loop, mode, kind)
    actual = _run_case(build, lambda f, *its: gradmap.tmap(f, *its, **tmap_kwargs), mode, kind)
    assert_grads_equal(actual, expected)


def test_reentrant_checkpoint_matches_loop(tmap_kwargs):
    """``checkpoint(use_reentrant=True)`` inside f: ``loss.backward()`` works as in the loop."""

    def build() -> Case:
        w = torch.randn(3, 3, requires_grad=True)
        xs = _rand_items(4, 3)

        def f(x: Tensor) -> Tensor:
            return checkpoint(lambda a: torch.tanh(w @ a).sum(), x, use_reentrant=True)

        return Case(f, [xs], [w, *xs])

    expected = _run_case(build, loop, "backward", "all")
    actual = _run_case(
        build, lambda f, *its: gradmap.tmap(f, *its, **tmap_kwargs), "backward", "all"
    )
    assert_grads_equal(actual, expected)


# -- iterables -----------------------------------------------------------------------------------


def test_lists_tuples_range_results_equal_loop(tmap_kwargs):
    """Lists, tuples and ranges zip like the builtin map; results are a list in order."""
    xs = [torch.randn(3) for _ in range(7)]
    f = lambda x, k, s: x * k + len(s)  # noqa: E731
    its = (xs, tuple(range(10, 17)), ["a", "bb", "ccc", "d", "ee", "f", "gg"])
    out = gradmap.tmap(f, *its, **tmap_kwargs)
    assert isinstance(out, list)
    for a, e in zip(out, loop(f, *its), strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert gradmap.tmap(lambda i: i * i, range(5), **tmap_kwargs) == [0, 1, 4, 9, 16]


def test_empty_iterable_gives_empty_list(tmap_kwargs):
    assert gradmap.tmap(lambda x: x, [], **tmap_kwargs) == []


def test_generator_consumed_once(tmap_kwargs):
    """A generator is read once, in order; gradients through its items equal the loop's."""
    xs = [torch.randn(3, requires_grad=True) for _ in range(6)]
    pulled: list[int] = []

    def gen() -> Iterator[Tensor]:
        for i, x in enumerate(xs):
            pulled.append(i)
            yield x

    f = lambda x: (x**3).sum()  # noqa: E731
    out = gradmap.tmap(f, gen(), **tmap_kwargs)
    assert pulled == list(range(6))
    got = torch.autograd.grad(torch.stack(out).sum(), xs)
    want = torch.autograd.grad(torch.stack(loop(f, xs)).sum(), xs)
    assert_grads_equal(list(got), list(want))


def test_tensor_iterable_gradient_reaches_whole_tensor(tmap_kwargs):
    """A tensor is mapped over dim 0 and its gradient is the loop's over ``big`` itself."""
    big = torch.randn(7, 3, requires_grad=True)
    f = lambda row: (row.sin() * torch.arange(3.0)).sum()  # noqa: E731
    out = gradmap.tmap(f, big, **tmap_kwargs)
    assert len(out) == 7
    (got,) = torch.autograd.grad(weighted_loss(out), big)
    (want,) = torch.autograd.grad(weighted_loss(loop(f, big)), big)
    torch.testing.assert_close(got, want)


def test_several_iterables_stop_at_shortest(tmap_kwargs):
    xs = [torch.randn(2, requires_grad=True) for _ in range(5)]
    out = gradmap.tmap(lambda x, k, s: x * k, xs, range(3), "abcdefgh", **tmap_kwargs)
    assert len(out) == 3
    for i, y in enumerate(out):
        torch.testing.assert_close(y, xs[i] * i)


@pytest.mark.parametrize(
    ("make", "lengths"),
    [
        (lambda: ([1, 2, 3], [1, 2]), ("3", "2")),
        (lambda: (torch.zeros(4, 2), [1, 2, 3, 4, 5]), ("4", "5")),
        (lambda: ([1, 2], (i for i in range(5))), ("2",)),
        (lambda: ((i for i in range(5)), [1, 2]), ("2",)),
    ],
)
def test_strict_raises_value_error_naming_lengths(tmap_kwargs, make, lengths):
    with pytest.raises(ValueError, match="length") as info:
        gradmap.tmap(lambda *a: 0, *make(), strict=True, **tmap_kwargs)
    for n in lengths:
        assert n in str(info.value)


def test_strict_equal_lengths_is_fine(tmap_kwargs):
    out = gradmap.tmap(
        lambda a, b: a + b, [1, 2, 3], (i for i in range(3)), strict=True, **tmap_kwargs
    )
    assert out == [1, 3, 5]


# -- pytrees and pass-through --------------------------------------------------------------------


def test_pytree_items_and_results_keep_structure_and_objects(tmap_kwargs):
    """Items and results of any pytree; non-tensors reach f and come back as the same objects."""
    marker = object()
    const = torch.arange(3)  # an int tensor made outside f
    frozen = torch.ones(2)  # a float tensor that does not require grad
    xs = [torch.randn(2, requires_grad=True) for _ in range(5)]
    items = [{"x": x, "tag": marker, "none": None, "pt": Point(x, i)} for i, x in enumerate(xs)]
    seen: list[Any] = []

    def f(item: dict[str, Any]) -> Any:
        seen.append(item["tag"])
        assert item["none"] is None
        x, pt = item["x"], item["pt"]
        return (
            {"y": x * pt.y, "marker": item["tag"], "idx": torch.tensor([pt.y])},
            [const, frozen, None, pt.y],
            Point(x.exp(), "s"),
        )

    out = gradmap.tmap(f, items, **tmap_kwargs)
    ref = loop(f, items)
    assert all(s is marker for s in seen)
    assert len(out) == len(ref) == 5
    for o, r in zip(out, ref, strict=True):
        assert pytree.tree_structure(o) == pytree.tree_structure(r)
        assert type(o[2]) is Point
        assert o[0]["marker"] is marker
        assert o[1][0] is const and o[1][1] is frozen and o[1][2] is None
        assert o[0]["idx"].dtype == torch.int64 and not o[0]["idx"].requires_grad
        torch.testing.assert_close(o[0]["idx"], r[0]["idx"])
        assert o[0]["y"].requires_grad
    got = torch.autograd.grad(weighted_loss(out), xs)
    want = torch.autograd.grad(weighted_loss(ref), xs)
    assert_grads_equal(list(got), list(want))


def test_non_differentiable_results_pass_through(tmap_kwargs):
    """With grad on, results that do not require grad are f's own tensors, untouched."""
    made: list[Tensor] = []

    def f(x: Tensor) -> Tensor:
        y = (x * 2).long()
        made.append(y)
        return y

    out = gradmap.tmap(f, [torch.randn(3) for _ in range(5)], **tmap_kwargs)
    assert {id(y) for y in out} == {id(y) for y in made}
    assert all(not y.requires_grad and y.dtype == torch.int64 for y in out)


def test_items_not_requiring_grad_reach_f_untouched(tmap_kwargs):
    xs = [torch.randn(3) for _ in range(5)]
    seen: list[Tensor] = []
    gradmap.tmap(lambda x: seen.append(x), xs, **tmap_kwargs)
    assert {id(x) for x in seen} == {id(x) for x in xs}


# -- backward work ---------------------------------------------------------------------------------


def test_upstream_graph_runs_once(tmap_kwargs):
    """A non-leaf tensor computed before the call: its upstream graph runs once, as in the loop."""

    def run(mapper: Callable[..., list[Any]]) -> tuple[list[Any], int, Tensor]:
        torch.manual_seed(2)
        a = torch.randn(3, requires_grad=True)
        log: list[Any] = []
        hook_calls: list[int] = []
        h = CountBackward.apply(a, "upstream", log)
        h.register_hook(lambda g: hook_calls.append(1))
        xs = [torch.randn(3) for _ in range(6)]
        out = mapper(lambda x: (x * h).sin().sum(), xs)
        torch.stack(out).sum().backward()
        return log, len(hook_calls), a.grad

    log_l, hooks_l, grad_l = run(loop)
    log_t, hooks_t, grad_t = run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs))
    assert log_l == ["upstream"] and hooks_l == 1
    assert log_t == ["upstream"]
    assert hooks_t == 1
    torch.testing.assert_close(grad_t, grad_l)


def test_elements_without_gradient_do_no_backward_work(tmap_kwargs):
    """Unused results: those elements' pullbacks never run. A zero cotangent reaches a custom
    Function's backward, as in the loop (NOTE [chunks whose backward is user code]); elements
    whose graphs are PyTorch's own ops do no work for zeros (``test_zero_cotangent_*``)."""
    log: list[int] = []
    w = torch.randn(3, requires_grad=True)
    xs = [torch.randn(3) for _ in range(8)]
    out = gradmap.tmap(
        lambda i, x: (CountBackward.apply(x * w, i, log)).sum(), range(8), xs, **tmap_kwargs
    )
    loss = out[0] + 3 * out[2] + 0 * out[5] + out[7]  # 1, 3, 4, 6 unused; 5 gets a zero
    (got,) = torch.autograd.grad(loss, w)
    assert sorted(log) == [0, 2, 5, 7]  # the loop's: 1, 3, 4, 6 unused
    (want,) = torch.autograd.grad(xs[0] @ w + 3 * (xs[2] @ w) + xs[7] @ w, w)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_zero_cotangent_gives_zero_gradient_like_loop(tmap_kwargs, mode):
    """An element whose result gets a zero cotangent: the loop's gradient is zeros, not None."""

    def run(mapper: Callable[..., list[Any]]) -> list[Tensor | None]:
        torch.manual_seed(3)
        w = torch.randn(3, requires_grad=True)
        xs = [torch.randn(3, requires_grad=True) for _ in range(4)]
        out = mapper(lambda x: (x * w).pow(2).sum(), xs)
        # Chunks of 2 (or 1): elements 2 and 3 (a whole chunk) get zero cotangents only.
        loss = out[0] + 0 * out[1] + 0 * (out[2] + out[3])
        return grads_of(loss, [*xs, w], mode)

    expected = run(loop)
    actual = run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs))
    assert_grads_equal(actual, expected)


def test_zero_cotangent_everywhere_gives_zero_parameter_gradient(tmap_kwargs):
    """Every cotangent zero: the loop's parameter gradient is a zero tensor, not None."""
    w = torch.randn(3, requires_grad=True)
    xs = [torch.randn(3) for _ in range(4)]
    out = gradmap.tmap(lambda x: (x * w).sum(), xs, **tmap_kwargs)
    (torch.stack(out).sum() * 0).backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, torch.zeros(3))


def test_a_sparse_tensor_that_requires_grad_gets_the_loops_gradient_map_after_map(tmap_kwargs):
    """A sparse COO tensor that requires grad, in f's closure and as every element's item:
    ``sum(ys).backward()`` twice in a row (the second map's losses are pulled back early, as the
    first backward learnt: NOTE [tmap's losses pulled back early]) gives the loop's gradient,
    sparse as the loop's is (sizing the early gradients asked ``nbytes``, which sparse tensors
    lack)."""
    g = torch.Generator().manual_seed(5)
    dense = torch.randn(4, 4, generator=g, dtype=torch.float64).relu()
    s = dense.to_sparse().requires_grad_()
    t = (dense.T + 1.0).relu().to_sparse().requires_grad_()
    xs = [torch.randn(4, 1, generator=g, dtype=torch.float64) for _ in range(6)]

    def f(x: Tensor, item: Tensor) -> Tensor:
        return (torch.sparse.mm(s, x).tanh() ** 2).sum() + torch.sparse.mm(item, x).sum()

    sum(loop(f, xs, [t] * len(xs))).backward()
    want = [s.grad.to_dense(), t.grad.to_dense()]
    for _ in range(2):
        s.grad = t.grad = None
        sum(gradmap.tmap(f, xs, [t] * len(xs), **tmap_kwargs)).backward()
        assert s.grad.layout == t.grad.layout == torch.sparse_coo
        torch.testing.assert_close([s.grad.to_dense(), t.grad.to_dense()], want)


def test_serial_pulls_back_in_reverse_element_order():
    """The serial executor's backward runs the elements from the last to the first."""
    for chunksize in (1, 2, 3, None):
        order: list[int] = []

        def f(i: int, x: Tensor, order: list[int] = order) -> Tensor:
            y = x * 1.5
            y.register_hook(lambda g: order.append(i))
            return y.sum()

        xs = [torch.randn(2, requires_grad=True) for _ in range(7)]
        out = gradmap.tmap(f, range(7), xs, executor="serial", chunksize=chunksize)
        torch.stack(out).sum().backward()
        assert order == list(range(6, -1, -1)), f"chunksize={chunksize}"


# -- retain_graph -------------------------------------------------------------------------------


def test_second_backward_without_retain_graph_raises(tmap_kwargs):
    """As in the loop: the first backward gives the loop's gradient, a second one raises
    PyTorch's error."""
    w = torch.randn(3, requires_grad=True)
    xs = [torch.randn(3) for _ in range(5)]
    f = lambda x: (x * w).exp().sum()  # noqa: E731

    def twice(mapper: Callable[..., list[Tensor]]) -> tuple[Tensor, str]:
        w.grad = None
        loss = torch.stack(mapper(f, xs)).sum()
        loss.backward()
        assert w.grad is not None
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as e:
            loss.backward()
        return w.grad.clone(), type(e.value).__name__

    ref_grad, ref_error = twice(loop)
    got_grad, got_error = twice(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs))
    torch.testing.assert_close(got_grad, ref_grad)
    assert got_error == ref_error


class _Token:
    pass


class _Holds(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, token: _Token) -> Tensor:  # type: ignore[override]
        ctx.token = token
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return g, None


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_backward_result_by_result_like_loop(tmap_kwargs, how):
    """``for y in ys: y.backward()`` works in the loop (each element has its own graph), and so
    on a map (NOTE [a backward of some results]); a result gone through twice raises PyTorch's
    error as in the loop; the graphs are freed once every result is gone through."""

    def run(mapper: Callable[..., list[Tensor]]) -> tuple[list[Tensor], str, bool, bool]:
        torch.manual_seed(6)
        w = torch.randn(3, requires_grad=True)
        xs = [torch.randn(3) for _ in range(5)]
        made: list[Any] = []

        def f(x: Tensor) -> Tensor:
            token = _Token()  # held by the element's graph (a node's context) while it lives
            made.append(weakref.ref(token))
            return _Holds.apply((x * w).exp(), token).sum()

        ys = mapper(f, xs)
        order = [3, 0, 4]
        grads = []
        for i in order:
            if how == "backward":
                ys[i].backward()
            else:
                grads.append(torch.autograd.grad(ys[i], w)[0])
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            ys[0].backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as e:
            ys[0].backward()
        alive = any(r() is not None for r in made)
        rest = torch.stack([ys[1], ys[2] * 2]).sum()
        if how == "backward":
            rest.backward()
            grads.append(w.grad)
        else:
            grads.append(torch.autograd.grad(rest, w)[0])
        error = type(e.value).__name__
        del ys, rest, e  # (the error's traceback holds the tensor it was raised for)
        collect()
        return grads, error, alive, any(r() is not None for r in made)

    got, got_error, got_alive, got_left = run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs))
    ref, ref_error, ref_alive, ref_left = run(loop)
    assert_grads_equal(got, ref)
    assert got_error == ref_error
    assert ref_alive and got_alive  # the results not gone through keep their graphs
    if getattr(sys, "_is_gil_enabled", lambda: True)():
        # (free-threaded CPython frees a pool thread's objects when that thread runs again:
        # ``measured`` in test_leaks.py)
        assert not ref_left and not got_left, "graphs outlive the last backward"


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward waits ``delay`` seconds."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, delay: float) -> Tensor:  # type: ignore[override]
        ctx.delay = delay
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.delay)
        return g, None


@pytest.mark.parametrize("remat", [False, True])
def test_two_threads_pull_back_different_results_at_once(tmap_kwargs, remat):
    """Two user threads pull back the even and the odd results of one map at the same time, as
    they may two sets of elements' graphs in the loop: each gets the loop's gradient. The even
    elements' backward is slow, so the odd backward -- which spends the map's last results --
    ends while the even one still runs; it must not free what that one needs (NOTE [one
    backward of a join at a time]; with ``remat`` the even pullbacks failed with it freed)."""
    torch.manual_seed(2)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(8)]

    def f(x: Tensor, i: int) -> Tensor:
        return _SlowBackward.apply((x * w).exp(), 0.2 if i % 2 == 0 else 0.0).sum()

    ys = gradmap.tmap(f, xs, range(8), remat=remat, **tmap_kwargs)
    got: dict[int, Any] = {}

    def pull(parity: int) -> None:
        time.sleep(0.05 * parity)  # the even backward first
        try:
            got[parity] = torch.autograd.grad(sum(ys[i] for i in range(parity, 8, 2)), w)[0]
        except Exception as exc:  # (reported below)
            got[parity] = exc

    threads = [threading.Thread(target=pull, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for parity in (0, 1):
        ref = torch.autograd.grad(sum(f(xs[i], i) for i in range(parity, 8, 2)), w)[0]
        assert not isinstance(got[parity], Exception), repr(got[parity])
        torch.testing.assert_close(got[parity], ref)


class _AddsTerm(torch.autograd.Function):
    """The identity, whose backward adds a term of its own: not zero for a zero gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return g + 0.5 * x


@pytest.mark.parametrize("kind", ["hook", "function", "retain_grad"])
def test_zero_cotangents_run_backward_user_code_as_in_the_loop(tmap_kwargs, kind):
    """An element whose results get zero cotangents does no backward work -- unless its graph
    runs user code, which in the loop runs with the zeros (NOTE [chunks whose backward is user
    code]): a hook adding to the gradient, a custom Function adding a term, a retained
    gradient of zeros. (Tensor hooks are seen by the native walk only.)"""
    if kind != "function" and not native_walk():
        pytest.skip("the Python walk does not see hooks on tensors f made")

    def run(mapper: Callable[..., list[Tensor]]) -> list[Any]:
        w = torch.ones(2, dtype=torch.float64, requires_grad=True)
        calls: list[Any] = []
        kept: dict[int, Tensor] = {}

        def f(i: int) -> Tensor:
            h = w * (i + 1)
            if kind == "hook":
                h.register_hook(lambda g: (calls.append((i, g.tolist())), g + 1.0)[1])
            elif kind == "function":
                h = _AddsTerm.apply(h)
            else:
                h.retain_grad()
                kept[i] = h
            return h.sum()

        ys = mapper(f, range(4))
        (0 * ys[0] + ys[1] + 0 * ys[3]).backward()
        return [w.grad, sorted(calls), *(kept[i].grad for i in sorted(kept))]

    got = run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs))
    ref = run(loop)
    assert got[1] == ref[1]
    torch.testing.assert_close([got[0], *got[2:]], [ref[0], *ref[2:]])


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("later_use", [False, True])
def test_a_result_f_retains_the_gradient_of_gets_the_loops(tmap_kwargs, later_use, remat):
    """``h.retain_grad(); return h`` in f: the result the user holds retains its gradient, all
    of it -- from the user's loss, and from f's own later use of it (NOTE [results that retain
    their gradient])."""

    def run(mapper: Callable[..., list[Any]]) -> list[Any]:
        w = torch.ones(2, dtype=torch.float64, requires_grad=True)

        def f(i: int) -> tuple[Tensor, Tensor]:
            h = w * (i + 1)
            h.retain_grad()
            return h, h.sum() * 2 if later_use else h.detach().sum()

        ys = mapper(f, range(3))
        loss = sum((h * (k + 1)).sum() + s for k, (h, s) in enumerate(ys))
        loss.backward(retain_graph=True)
        loss.backward()  # (the retained gradients add up)
        return [w.grad, *(h.grad for h, _ in ys), [h.retains_grad for h, _ in ys]]

    got = run(lambda f, xs: gradmap.tmap(f, xs, remat=remat, **tmap_kwargs))
    ref = run(loop)
    assert got[-1] == ref[-1] == [True] * 3
    torch.testing.assert_close(got[:-1], ref[:-1])


def test_retain_graph_twice_accumulates_like_loop(tmap_kwargs):
    def run(mapper: Callable[..., list[Any]]) -> list[Tensor]:
        torch.manual_seed(4)
        w = torch.randn(3, requires_grad=True)
        xs = [torch.randn(3, requires_grad=True) for _ in range(5)]
        loss = weighted_loss(mapper(lambda x: (x * w).exp().sum(), xs))
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()
        return [w.grad, *(x.grad for x in xs)]

    assert_grads_equal(run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs)), run(loop))


# -- second order ---------------------------------------------------------------------------------


def _hvp_run(mapper: Callable[..., list[Any]], mode: str) -> list[Tensor | None]:
    torch.manual_seed(5)
    lin = nn.Linear(3, 4)
    xs = [torch.randn(2, 3, requires_grad=True) for _ in range(5)]
    f = lambda x: lin(x).tanh().pow(2).sum() * x.sum()  # noqa: E731
    wrt = [*lin.parameters(), *xs]
    loss = weighted_loss(mapper(f, xs))
    if mode == "grad":
        first = torch.autograd.grad(loss, wrt, create_graph=True)
    else:
        for t in wrt:
            t.grad = None
        loss.backward(create_graph=True)
        first = tuple(t.grad for t in wrt)
    vs = [torch.ones_like(t) * 0.5 for t in wrt]
    hv = sum((g * v).sum() for g, v in zip(first, vs, strict=True))
    result = list(torch.autograd.grad(hv, wrt)) + [g.detach() for g in first]
    for t in wrt:
        t.grad = None  # break the .grad <-> graph cycle of backward(create_graph=True)
    return result


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("mode", ["backward", "grad"])
def test_hessian_vector_product_matches_loop(tmap_kwargs, mode):
    """create_graph=True: the first and second order (items and parameters) equal the loop's."""
    expected = _hvp_run(loop, mode)
    actual = _hvp_run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs), mode)
    assert_grads_equal(actual, expected)


def test_double_backward_through_tensor_iterable_matches_loop(tmap_kwargs):
    """create_graph=True through a tensor iterable and a closure tensor: the loop's Hessian."""

    def run(mapper: Callable[..., list[Any]]) -> list[Tensor | None]:
        torch.manual_seed(12)
        big = torch.randn(5, 3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        out = mapper(lambda row: (row**3 * w).sum() * row.sum(), big)
        g = torch.autograd.grad(weighted_loss(out), [big, w], create_graph=True)
        return list(torch.autograd.grad(g[0].sin().sum() + g[1].pow(2).sum(), [big, w]))

    assert_grads_equal(run(lambda f, it: gradmap.tmap(f, it, **tmap_kwargs)), run(loop))


def test_leaf_results_are_handed_out_as_they_are(tmap_kwargs):
    """NOTE [leaves returned as they are]: a leaf ``f`` returns -- its item, a parameter, one it
    made -- is the loop's very object, and its ``.grad`` the loop's."""
    w = torch.randn(2, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(2, dtype=torch.float64, requires_grad=True) for _ in range(4)]

    def f(i: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        made = torch.full((2,), float(i), dtype=torch.float64, requires_grad=True)
        return xs[i], w, made, (made * w).sum()

    def run(mapper: Callable[..., Any]) -> list[Any]:
        for t in (w, *xs):
            t.grad = None
        rs = mapper(f, range(4))
        assert all(r[0] is xs[i] and r[1] is w and r[2].is_leaf for i, r in enumerate(rs))
        sum(
            (r[0] * r[1]).sum() + r[2].pow(2).sum() * (i + 1) + r[3] for i, r in enumerate(rs)
        ).backward()
        return [w.grad, *(x.grad for x in xs), *(r[2].grad for r in rs)]

    assert_grads_equal(run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs)), run(loop))


def test_results_viewing_a_tensor_made_before_refuse_in_place_changes(tmap_kwargs):
    """A result that views a tensor made before the map (NOTE [results that view a tensor made
    before the map]) raises at an in-place change to it or to the viewed tensor, where a plain
    alias lost the gradient without a word; a view of f's own tensor changes as in the loop."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    tm = lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs)  # noqa: E731
    ys = tm(lambda x: x * w, xs)
    zs = tm(lambda y: y[1:], ys)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        zs[0].mul_(2)
    ys[1].mul_(3)  # the viewed tensor: zs[1] may not be used any more
    with pytest.raises(RuntimeError, match="its base or another view of its base has been"):
        zs[1].sum()
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        tm(lambda x: x[0], xs)[0].add_(1)  # a view of a leaf: the loop raises too

    def own(mapper: Callable[..., Any]) -> list[Tensor]:
        for x in xs:
            x.grad = None
        rs = mapper(lambda x: (x * w)[1:], xs)
        rs[0].mul_(3)
        torch.stack([r.sum() for r in rs]).sum().backward()
        return [x.grad for x in xs]  # type: ignore[misc]

    assert_grads_equal(own(tm), own(loop))


@pytest.mark.parametrize("returns", ["two views", "tensor and view"])
def test_results_sharing_memory_refuse_in_place_changes(tmap_kwargs, returns):
    """Two results of one element that share memory (``y[:2], y[1:]``; ``y, y[0]``): in the loop
    a change to one reaches the other's graph; the join's aliases would share the memory, not
    the view, and the other's gradient came out wrong without a word. The change raises; the
    results, used as they are, give the loop's gradients."""

    def f(x: Tensor) -> tuple[Tensor, Tensor]:
        y = x * 1.0
        return (y[:2], y[1:]) if returns == "two views" else (y, y[0])

    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    ((a, b),) = gradmap.tmap(f, [x], **tmap_kwargs)
    with pytest.raises(RuntimeError, match="is being modified inplace"):
        a.mul_(10)
    with pytest.raises(RuntimeError, match="is being modified inplace"):
        b.mul_(10)
    ((a, b),) = gradmap.tmap(f, [x], **tmap_kwargs)
    ((c, d),) = loop(f, [x])
    got = torch.autograd.grad(a.sum() + 2 * b.sum(), x)
    torch.testing.assert_close(got, torch.autograd.grad(c.sum() + 2 * d.sum(), x))


@pytest.mark.parametrize("how", ["is_grads_batched", "jacobian", "hessian", "torch.vmap"])
@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_batched_backward_matches_loop(tmap_kwargs, how, api):
    """A backward under vmap -- ``autograd.grad(..., is_grads_batched=True)``,
    ``jacobian``/``hessian`` with ``vectorize=True``, ``torch.vmap`` over a vector-Jacobian
    product -- gets batched cotangents: the loop's Jacobians, not a failing zero check."""
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]
    w0 = torch.randn(3, dtype=torch.float64)

    def f(x: Tensor, w: Tensor) -> Tensor:
        return (x * w).sin() * w[0]

    def model(w: Tensor, mapper: Callable[..., Any]) -> Tensor:
        if api == "tsum":
            if mapper is loop:
                return sum(f(x, w) for x in xs)  # type: ignore[return-value]
            return gradmap.tsum(f, xs, [w] * len(xs), **tmap_kwargs)  # type: ignore[no-any-return]
        return torch.stack(mapper(lambda x: f(x, w).sum(), xs))

    def jac(mapper: Callable[..., Any]) -> Tensor:
        if how == "jacobian":
            return torch.autograd.functional.jacobian(
                lambda w: model(w, mapper), w0, vectorize=True
            )
        if how == "hessian":
            return torch.autograd.functional.hessian(
                lambda w: model(w, mapper).sum(), w0, vectorize=True
            )
        w = w0.clone().requires_grad_()
        y = model(w, mapper)
        eye = torch.eye(y.numel(), dtype=y.dtype)
        if how == "is_grads_batched":
            return torch.autograd.grad(y, w, eye, is_grads_batched=True)[0]
        return torch.vmap(lambda v: torch.autograd.grad(y, w, v, retain_graph=True)[0])(eye)

    ref = jac(loop)
    got = jac(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs))
    torch.testing.assert_close(got, ref)


def test_gradcheck_and_gradgradcheck(tmap_kwargs):
    """float64 gradcheck/gradgradcheck through a tensor iterable, list items and a parameter."""
    big = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    z0, z1, z2, z3 = (torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4))

    def fn(big: Tensor, w: Tensor, *zs: Tensor) -> Tensor:
        out = gradmap.tmap(
            lambda row, z: ((w @ row).tanh() * (z * row).sum()).sum(0),
            big,
            list(zs),
            **tmap_kwargs,
        )
        return torch.stack(out)

    inputs = (big, w, z0, z1, z2, z3)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


# -- thread-local state ----------------------------------------------------------------------------


def test_no_grad_records_nothing_even_in_workers(tmap_kwargs):
    w = torch.randn(3, requires_grad=True)
    modes: list[bool] = []

    def f(x: Tensor) -> Tensor:
        modes.append(torch.is_grad_enabled())
        return (x * w).sum()

    with torch.no_grad():
        out = gradmap.tmap(f, [torch.randn(3, requires_grad=True) for _ in range(8)], **tmap_kwargs)
    assert modes == [False] * 8
    assert all(not y.requires_grad and y.grad_fn is None for y in out)


def test_inference_mode_reaches_workers(tmap_kwargs):
    w = torch.randn(3, requires_grad=True)
    modes: list[bool] = []

    def f(x: Tensor) -> Tensor:
        modes.append(torch.is_inference_mode_enabled())
        return (x * w).sum()

    with torch.inference_mode():
        out = gradmap.tmap(f, [torch.randn(3) for _ in range(8)], **tmap_kwargs)
    assert modes == [True] * 8
    assert all(y.is_inference() and not y.requires_grad for y in out)


def test_grad_mode_on_in_workers_by_default(tmap_kwargs):
    modes: list[bool] = []

    def f(x: Tensor) -> Tensor:
        modes.append(torch.is_grad_enabled())
        return x * 2

    out = gradmap.tmap(f, [torch.randn(2, requires_grad=True) for _ in range(6)], **tmap_kwargs)
    assert modes == [True] * 6
    assert all(y.requires_grad for y in out)


def _autocast_run(
    mapper: Callable[..., list[Any]], cache: bool
) -> tuple[list[torch.dtype], list[Tensor | None]]:
    torch.manual_seed(6)
    w = torch.randn(8, 8, requires_grad=True)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(6)]
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        out = mapper(lambda x: (x @ w).relu(), xs)
    grads = torch.autograd.grad(weighted_loss(out), [w, *xs])
    return [y.dtype for y in out], list(grads)


@pytest.mark.filterwarnings("ignore:gradmap.tmap runs as the plain loop")
def test_state_only_the_callers_thread_has_runs_the_loop_with_a_warning(tmap_kwargs):
    """Saved-tensor hooks and torch modes live in the caller's thread alone: under them a map
    runs as the plain loop there, with the loop's values, gradients and what the hooks and modes
    see, and says so (NOTE [state only the caller's thread has])."""
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    f = lambda x: ((x * w).sin() * w).sum()  # noqa: E731
    tm = lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs)  # noqa: E731

    def lossy(mapper: Callable[..., Any]) -> Tensor:
        # Saved tensors kept in half precision: gradients that differ from the unhooked ones.
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t.to(torch.float16), lambda t: t.to(torch.float64)
        ):
            total = torch.stack(mapper(f, xs)).sum()
        return torch.autograd.grad(total, w)[0]

    with pytest.warns(RuntimeWarning, match="saved-tensor hooks"):
        got = lossy(tm)
    assert torch.equal(got, lossy(loop))

    def checkpointed(mapper: Callable[..., Any]) -> Tensor:
        total = checkpoint(lambda w: torch.stack(mapper(f, xs)).sum(), w, use_reentrant=False)
        return torch.autograd.grad(total, w)[0]

    with pytest.warns(RuntimeWarning, match="saved-tensor hooks"):
        got = checkpointed(tm)
    torch.testing.assert_close(got, checkpointed(loop))

    lin = nn.Linear(16, 16)
    items = [torch.randn(4, 16) for _ in range(6)]
    counts = []
    for mapper in (tm, loop):
        with FlopCounterMode(display=False) as flops:
            torch.stack(mapper(lambda x: lin(x).sum(), items)).sum().backward()
        counts.append(flops.get_total_flops())
    assert counts[0] == counts[1] > 0

    torch.set_default_device("cpu")  # what other threads have anyway: no fallback
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tm(f, xs)
    finally:
        torch.set_default_device(None)


def test_cpu_autocast_reaches_workers(tmap_kwargs):
    """Under CPU autocast (no weight cache), result dtypes and gradients equal the loop's."""
    dtypes_l, grads_l = _autocast_run(loop, cache=False)
    dtypes_t, grads_t = _autocast_run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs), cache=False)
    assert dtypes_l == [torch.bfloat16] * 6
    assert dtypes_t == dtypes_l
    assert_grads_equal(grads_t, grads_l)


def test_cpu_autocast_with_weight_cache_matches_loop_to_bf16_precision(tmap_kwargs):
    """Default autocast (weight cache on): the loop sums the weight's gradient in bfloat16 at
    the cached cast, tmap per element in float32; equal to bfloat16 precision."""
    dtypes_l, grads_l = _autocast_run(loop, cache=True)
    mapped = lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs)  # noqa: E731
    if not native_walk():  # a cached cast no live tensor holds: the Python walk cannot find it
        with pytest.raises(RuntimeError, match="Python walk cannot find it"):
            _autocast_run(mapped, cache=True)
        return
    dtypes_t, grads_t = _autocast_run(mapped, cache=True)
    assert dtypes_t == dtypes_l == [torch.bfloat16] * 6
    scale = grads_l[0].abs().max().item()
    torch.testing.assert_close(grads_t[0], grads_l[0], rtol=2**-7, atol=2**-7 * scale)
    assert_grads_equal(grads_t[1:], grads_l[1:])


def test_autocast_forward_with_create_graph_backward_matches_loop(tmap_kwargs):
    """Forward under autocast, then a create_graph=True backward outside it: the loop's grads."""

    def run(mapper: Callable[..., list[Any]]) -> list[Tensor | None]:
        torch.manual_seed(7)
        w = torch.randn(8, 8, requires_grad=True)
        xs = [torch.randn(4, 8) for _ in range(6)]
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            out = mapper(lambda x: (x @ w).float().pow(2).sum(), xs)
        (g,) = torch.autograd.grad(torch.stack(out).sum(), w, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), w)
        return [g.detach(), gg]

    assert_grads_equal(run(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs)), run(loop))


def test_default_dtype_reaches_workers(tmap_kwargs):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        w = torch.randn(3, requires_grad=True)
        f = lambda x: (torch.ones(3) * x * w).sum()  # noqa: E731
        out = gradmap.tmap(f, [1.0, 2.0, 3.0, 4.0], **tmap_kwargs)
        assert [y.dtype for y in out] == [torch.float64] * 4
        (got,) = torch.autograd.grad(torch.stack(out).sum(), w)
        (want,) = torch.autograd.grad(torch.stack(loop(f, [1.0, 2.0, 3.0, 4.0])).sum(), w)
        torch.testing.assert_close(got, want)
    finally:
        torch.set_default_dtype(previous)


def test_map_leaves_intra_op_threads_of_new_threads_alone():
    """A thread started while a map runs gets the process's intra-op thread count, not the
    map's per-worker budget."""

    def fresh_thread_setting() -> int:
        box: list[int] = []
        t = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
        t.start()
        t.join()
        return box[0]

    before = fresh_thread_setting()
    seen: list[int] = []
    gradmap.tmap(lambda i: seen.append(fresh_thread_setting()), range(8), workers=2, chunksize=1)
    assert seen == [before] * 8
    assert fresh_thread_setting() == before


# -- determinism -----------------------------------------------------------------------------------


def _ragged_mlp_grads(workers: int, chunksize: int | None) -> list[Tensor]:
    torch.manual_seed(8)
    mlp = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    g = torch.Generator().manual_seed(9)
    sizes = torch.randint(1, 200, (100,), generator=g).tolist()
    bags = [torch.randn(n, 16, generator=g) for n in sizes]
    out = gradmap.tmap(lambda b: mlp(b).mean(), bags, workers=workers, chunksize=chunksize)
    return list(torch.autograd.grad(weighted_loss(out), list(mlp.parameters())))


@pytest.mark.parametrize("chunksize", [None, 7])
def test_parameter_gradients_bitwise_identical_for_any_workers(chunksize):
    """Ragged MLP, 100 elements: the same bits for workers=1, 2, 4, 8 and across runs."""
    reference = _ragged_mlp_grads(1, chunksize)
    for workers in (1, 2, 4, 8):
        for run in range(2):
            grads = _ragged_mlp_grads(workers, chunksize)
            for p, (a, b) in enumerate(zip(grads, reference, strict=True)):
                same = torch.equal(a, b)  # (a bool: pytest would diff huge tensor reprs)
                assert same, (
                    f"workers={workers} run={run} param={p}: "
                    f"max diff {(a - b).abs().max().item():.3g}"
                )


# -- nesting and concurrency ---------------------------------------------------------------------


def _nested_grads(outer_map, inner_map) -> list[Tensor]:
    torch.manual_seed(10)
    w = torch.randn(3, requires_grad=True)
    lin = nn.Linear(3, 2)
    bags = [torch.randn(k, 3, requires_grad=True) for k in (1, 4, 2, 5, 3, 2)]

    def inner(row: Tensor) -> Tensor:
        return (lin(row * w).tanh()).sum()

    def outer(bag: Tensor) -> Tensor:
        return torch.stack(inner_map(inner, bag)).pow(2).sum()

    out = outer_map(outer, bags)
    return list(torch.autograd.grad(weighted_loss(out), [w, *lin.parameters(), *bags]))


NESTED_CONFIGS = {
    # name: (outer kwargs, inner kwargs); "pool-N" is one user ThreadPoolExecutor shared by both.
    "threads": ({"executor": "threads", "chunksize": 1}, {"executor": "threads", "chunksize": 1}),
    "workers-2": ({"workers": 2, "chunksize": 1}, {"workers": 2, "chunksize": 1}),
    "workers-8": ({"workers": 8, "chunksize": 1}, {"workers": 8, "chunksize": 1}),
    "user-pool-1": ({"executor": "pool-1", "chunksize": 1}, {"executor": "pool-1", "chunksize": 1}),
    "user-pool-2": ({"executor": "pool-2", "chunksize": 1}, {"executor": "pool-2", "chunksize": 1}),
    "serial-outer": ({"executor": "serial"}, {"workers": 2, "chunksize": 1}),
    "serial-inner": ({"workers": 2, "chunksize": 1}, {"executor": "serial"}),
}


@pytest.mark.parametrize("config", list(NESTED_CONFIGS))
def test_nested_tmap_no_deadlock_and_loop_gradients(config):
    """tmap inside f (on the same pool at both levels): it finishes, with the loop's gradients,
    including to the parameters the inner f uses."""
    expected = _nested_grads(loop, loop)
    outer_kwargs, inner_kwargs = (dict(kw) for kw in NESTED_CONFIGS[config])
    pool = None
    if str(outer_kwargs.get("executor", "")).startswith("pool-"):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=int(config[-1]))
        outer_kwargs["executor"] = inner_kwargs["executor"] = pool
    try:
        actual = run_in_thread(
            lambda: _nested_grads(
                lambda f, it: gradmap.tmap(f, it, **outer_kwargs),
                lambda f, it: gradmap.tmap(f, it, **inner_kwargs),
            ),
            timeout=60,
        )
    finally:
        if pool is not None:
            pool.shutdown(wait=False)
    assert_grads_equal(actual, expected)


@pytest.mark.parametrize("outer", ["serial", "threads"])
@pytest.mark.parametrize("inner", ["tsum", "tmap"])
def test_a_pipeline_nested_in_a_forward_in_one_thread(outer, inner):
    """A ``tsum`` (or a ``tmap`` of losses, pulled back early) inside ``f``: one pipeline of a
    forward thread and pullbacks. The outer forward in one thread holds the generator's draws
    while its chunk runs (NOTE [random numbers of recomputes]), so the inner map runs in that
    thread (before, its forward waited on a pool thread for the lock its caller held)."""
    torch.manual_seed(12)
    w = torch.randn(3, requires_grad=True)
    xs = [torch.randn(k % 4 + 2, 3) for k in range(8)]

    def inner_map(f: Callable[..., Any], rows: Any, mapped: bool) -> Tensor:
        if not mapped:
            return sum(f(r) for r in rows)
        if inner == "tsum":
            return gradmap.tsum(f, rows, executor="threads", chunksize=1)
        return torch.stack(gradmap.tmap(f, rows, executor="threads", chunksize=1)).sum()

    def total(mapped: bool) -> Tensor:
        def f(x: Tensor) -> Tensor:
            return inner_map(lambda r: (r * w).sin().sum(), x, mapped) ** 2

        if not mapped:
            return sum(f(x) for x in xs)
        return gradmap.tsum(f, xs, executor=outer, chunksize=2)

    want = torch.autograd.grad(total(False), w)
    for _ in range(3):  # (a tmap learns to pull its losses back early)
        got = run_in_thread(lambda: torch.autograd.grad(total(True), w), timeout=60)
        assert_grads_equal(list(got), list(want))


def test_concurrent_callers_get_loop_gradients(tmap_kwargs):
    """Four threads call tmap and autograd.grad at once, sharing a module: each gets the loop's."""
    torch.manual_seed(11)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    params = list(net.parameters())
    datasets = [
        [torch.randn(k % 5 + 1, 4, requires_grad=True) for k in range(12 + c)] for c in range(4)
    ]
    f = lambda x: net(x).sum()  # noqa: E731

    def grads(mapper: Callable[..., list[Any]], xs: list[Tensor]) -> list[Tensor | None]:
        return list(torch.autograd.grad(weighted_loss(mapper(f, xs)), params + xs))

    expected = [grads(loop, xs) for xs in datasets]
    barrier = threading.Barrier(4)
    results: list[Any] = [None] * 4

    def caller(c: int) -> None:
        barrier.wait()
        for _ in range(3):
            results[c] = grads(lambda f, xs: gradmap.tmap(f, xs, **tmap_kwargs), datasets[c])

    def run_all() -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as callers:
            for fut in [callers.submit(caller, c) for c in range(4)]:
                fut.result()

    run_in_thread(run_all, timeout=60)
    for c in range(4):
        assert_grads_equal(results[c], expected[c])


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_meta_tensors_get_the_loops_gradient_shapes(tmap_kwargs, api):
    """Tensors on the meta device (shapes without values, as a model is traced): the backward
    cannot look at a cotangent's values to skip zeros, and pulls back as the loop does."""
    w = torch.randn(3, device="meta", requires_grad=True)
    xs = [torch.randn(3, device="meta") for _ in range(4)]
    f = lambda x: (w * x).sum()  # noqa: E731
    want = torch.autograd.grad(torch.stack([f(x) for x in xs]).sum(), w)[0]
    out = getattr(gradmap, api)(f, xs, **tmap_kwargs)
    got = torch.autograd.grad(out if api == "tsum" else torch.stack(out).sum(), w)[0]
    assert (got.device.type, got.shape, got.dtype) == (want.device.type, want.shape, want.dtype)


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_items_that_view_one_tensor_changed_in_place(tmap_kwargs, api):
    """Items cut from one tensor that requires grad, each changed in place by ``f``: the changes
    land on the tensor they view, which autograd does not guard against threads (NOTE [items
    that view one tensor, changed in place]). One thread (the serial executor) gives the loop's
    gradients; more than one stops with an error that names the problem and the fixes."""
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    leaf = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)

    def f(x: Tensor) -> Tensor:
        x.add_(w.tanh())
        return x.sum() * 3

    def run(mapper: Callable[[list[Tensor]], Tensor]) -> tuple[Tensor, ...]:
        big = leaf * 1.0
        total = mapper([big[i] for i in range(6)])
        return torch.autograd.grad(total + big.square().sum(), [w, leaf])

    want = run(lambda xs: torch.stack([f(x) for x in xs]).sum())

    def mapped(xs: list[Tensor]) -> Tensor:
        out = getattr(gradmap, api)(f, xs, **tmap_kwargs)
        return out if api == "tsum" else torch.stack(out).sum()

    if not native_walk():  # (it cannot find the tensor the items view: it says so)
        with pytest.raises(RuntimeError, match="Python walk cannot find it"):
            run(mapped)
    elif tmap_kwargs.get("executor") == "serial":
        assert_grads_equal(list(run(mapped)), list(want))
    else:
        with pytest.raises(RuntimeError, match="view of a tensor that requires grad"):
            run(mapped)
