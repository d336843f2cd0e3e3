"""A chunk's boundary, read off its graph: what the gradient of a map reaches, vs the loop."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import Tensor

import gradmap

from support import native_walk

pytestmark = pytest.mark.usefixtures("both_walks")

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
        if not native_walk():  # the Python walk cannot find it: it says so, never guesses
            with pytest.raises(RuntimeError, match="Python walk cannot find it"):
                _run(MAPPERS[mapper], make)
            return
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


# -- found by differential testing against the loop ----------------------------------------------

SUMS = {
    "tsum": lambda f, xs, **kw: gradmap.tsum(f, xs, **kw),
    "tmap": lambda f, xs, **kw: sum(gradmap.tmap(f, xs, **kw)),
}


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("api", list(SUMS))
def test_a_parameter_used_directly_and_through_a_pre_call_tensor_counts_once(api, executor, remat):
    """tsum's early pullbacks ran past a tensor made before the call and counted the parameter's
    gradient through it twice."""

    def run(mapper):
        torch.manual_seed(5)
        q = torch.randn(3, dtype=F64, requires_grad=True)
        s = q * 2 + 1
        xs = [torch.randn(4, 3, dtype=F64) for _ in range(5)]
        total = mapper(lambda x: (torch.tanh(x * s) * q).sum(), xs)
        return torch.autograd.grad(total, [q, s])

    got = run(lambda f, xs: SUMS[api](f, xs, executor=executor, chunksize=2, remat=remat))
    ref = run(lambda f, xs: sum(f(x) for x in xs))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


_READ_IN_METHOD: dict[str, Tensor] = {}


class _ReadsGlobalsInForward(torch.nn.Module):
    def forward(self, x):
        g, s = _READ_IN_METHOD["g"], _READ_IN_METHOD["s"]
        return (torch.tanh(x * g) * s * g).sum()


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("api", list(SUMS))
def test_a_pre_call_tensor_read_only_inside_a_method_through_a_global(api, remat):
    def run(mapper):
        torch.manual_seed(6)
        q = torch.randn(3, dtype=F64, requires_grad=True)
        g = torch.randn(3, dtype=F64, requires_grad=True)
        _READ_IN_METHOD.update(g=g, s=q * 2 + 1)
        xs = [torch.randn(2, 3, dtype=F64) for _ in range(4)]
        return torch.autograd.grad(mapper(_ReadsGlobalsInForward(), xs), [g, q])

    ref = run(lambda f, xs: sum(f(x) for x in xs))
    mapped = lambda f, xs: SUMS[api](f, xs, chunksize=2, remat=remat)  # noqa: E731
    try:
        if not native_walk():
            with pytest.raises(RuntimeError, match="Python walk cannot find it"):
                run(mapped)
            return
        got = run(mapped)
    finally:
        _READ_IN_METHOD.clear()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_zero_cotangent_gives_zeros_to_what_it_reaches_and_none_elsewhere(executor):
    """The loop gives zeros to a parameter reached only by zero cotangents, and None to one no
    cotangent reaches; a chunk's zero-cotangent output must not give zeros to its neighbours'."""

    def run(mapper):
        torch.manual_seed(7)
        p0, p1, p2 = (torch.randn(3, dtype=F64, requires_grad=True) for _ in range(3))
        xs = [torch.randn(3, dtype=F64) for _ in range(2)]
        ys = mapper(lambda x: ((x * p0).sum(), (x * p1).sum(), (x * p2).sum()), xs)
        (a0, b0, _), (_, _, c1) = ys
        (0 * a0 + b0 + 0 * c1).backward()
        return [p0.grad, p1.grad, p2.grad]

    got = run(lambda f, xs: gradmap.tmap(f, xs, executor=executor, chunksize=2))
    ref = run(_loop)
    assert [g is None for g in got] == [g is None for g in ref]
    for a, b in zip(got, ref):
        if b is not None:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_zero_cotangent_under_create_graph_keeps_the_second_order_term(executor):
    def run(mapper):
        torch.manual_seed(8)
        p = torch.randn(3, dtype=F64, requires_grad=True)
        xs = [torch.randn(3, dtype=F64) for _ in range(3)]
        ys = mapper(lambda x: (x * p).pow(2).sum(), xs)
        (g,) = torch.autograd.grad(0 * ys[0] + ys[1], p, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), p)
        return [g.detach(), gg]

    got = run(lambda f, xs: gradmap.tmap(f, xs, executor=executor, chunksize=1))
    for a, b in zip(got, run(_loop)):
        torch.testing.assert_close(a, b)


class _Refuses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        raise ValueError("this element's backward is never asked for")


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_autograd_grad_with_some_inputs_runs_no_element_that_reaches_none(executor):
    """The engine prunes what leads to no input asked for; so does the map (native walk)."""
    xs = [torch.randn(3, dtype=F64, requires_grad=True) for _ in range(2)]

    def f(x):
        return _Refuses.apply(x).sum() if x is xs[1] else (x * 2).sum()

    loop = f(xs[0]) + f(xs[1])
    (want,) = torch.autograd.grad(loop, [xs[0]])
    r0, r1 = gradmap.tmap(f, xs, executor=executor, chunksize=2)
    if not native_walk():
        with pytest.raises(ValueError, match="never asked for"):
            torch.autograd.grad(r0 + r1, [xs[0]])
        return
    (got,) = torch.autograd.grad(r0 + r1, [xs[0]])
    torch.testing.assert_close(got, want)


def test_which_cotangents_are_nonzero_on_every_path():
    """The check behind skipping zero cotangents: one stack for small cotangents alike, element
    by element for the rest (None, shapes that differ, large ones, ones that require grad)."""
    from gradmap._torch._chunk import _nonzero_all

    z, o = torch.zeros(()), torch.ones(())
    assert _nonzero_all([z, o, z, o, -o]) == [False, True, False, True, True]
    assert _nonzero_all([None, o, z, o, z]) == [False, True, False, True, False]
    assert _nonzero_all([z, torch.zeros(2), o, torch.tensor([0.0, 1.0])]) == [
        False,
        False,
        True,
        True,
    ]
    rows = [torch.zeros(3), torch.tensor([0.0, 2.0, 0.0]), torch.zeros(3), torch.zeros(3)]
    assert _nonzero_all(rows) == [False, True, False, False]
    large = [torch.zeros(1000), torch.zeros(1000), torch.zeros(1000), torch.ones(1000)]
    assert _nonzero_all(large) == [False, False, False, True]
    mixed = [z, torch.tensor(0, dtype=torch.int64), torch.tensor(3.0, dtype=torch.float64), o]
    assert _nonzero_all(mixed) == [False, False, True, True]
    # a zero that requires grad still carries a second-order term
    assert _nonzero_all([z, z.clone().requires_grad_(), z, z]) == [False, True, False, False]


def _kinds(w):
    """An ``f`` whose result changes kind from element to element: a tensor that requires grad,
    one that does not, a tuple (NOTE [a chunk of bare tensors]: a chunk starts compact and turns
    general at the first result of another kind)."""

    def f(x):
        k = int(x.detach()[0].abs() * 10) % 4
        y = (x * w).sum()
        if k == 0 or k == 3:
            return y
        if k == 1:
            return y.detach() + 1
        return (y, x.detach())

    return f


@pytest.mark.parametrize("chunksize", [1, 3, 16])
@pytest.mark.parametrize("executor", ["serial", "threads", "processes"])
@pytest.mark.parametrize("remat", [False, True])
def test_results_of_changing_kinds_within_a_chunk_as_in_the_loop(executor, chunksize, remat):
    torch.manual_seed(5)
    w = torch.randn(3, dtype=F64, requires_grad=True)
    xs = [torch.randn(3, dtype=F64, requires_grad=True) for _ in range(16)]
    f = _kinds(w)
    kinds = {type(y).__name__ + str(getattr(y, "requires_grad", "")) for y in _loop(f, xs)}
    assert len(kinds) == 3  # each kind occurs, so chunks turn general at various places

    def flat(ys):
        return [t for y in ys for t in (y if isinstance(y, tuple) else (y,))]

    def loss(ys):
        return sum((i + 1) * t.sum() for i, t in enumerate(flat(ys)) if t.requires_grad)

    got = gradmap.tmap(f, xs, executor=executor, chunksize=chunksize, remat=remat)
    ref = _loop(f, xs)
    assert [type(y) for y in got] == [type(y) for y in ref]
    for a, b in zip(flat(got), flat(ref)):
        assert a.requires_grad == b.requires_grad
        torch.testing.assert_close(a, b)
    want = torch.autograd.grad(loss(ref), [w, *xs], allow_unused=True)
    have = torch.autograd.grad(loss(got), [w, *xs], allow_unused=True)
    for a, b in zip(have, want):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b)
    with torch.no_grad():
        plain = gradmap.tmap(f, xs, executor=executor, chunksize=chunksize)
    for a, b in zip(flat(plain), flat(ref)):
        torch.testing.assert_close(a, b.detach())


@pytest.mark.parametrize("executor", ["serial", "threads", "processes"])
def test_tsum_of_losses_some_without_grad_and_of_a_structure_that_changes(executor):
    torch.manual_seed(6)
    w = torch.randn(3, dtype=F64, requires_grad=True)
    xs = [torch.randn(3, dtype=F64) for _ in range(12)]

    def f(x):  # every third loss does not require grad: a chunk turns general there
        y = (x * w).sin().sum()
        return y.detach() if int(x[0].abs() * 10) % 3 == 0 else y

    total = gradmap.tsum(f, xs, executor=executor, chunksize=4)
    ref = sum(f(x) for x in xs)
    torch.testing.assert_close(total, ref)
    (g,) = torch.autograd.grad(total, w)
    torch.testing.assert_close(g, torch.autograd.grad(ref, w)[0])

    key = float(xs[6].sum())  # (by value: on processes f sees copies of the items)

    def g_(x):  # bare tensors for the first chunk, then a tuple: the error names the element
        return (x * w).sum() if float(x.sum()) != key else ((x * w).sum(),)

    with pytest.raises(ValueError, match="element 6 returned a result of another structure"):
        gradmap.tsum(g_, xs, executor=executor, chunksize=4)

    def h(x):  # losses in a 1-tuple: summed as tuples (on processes, not as a chunk's losses)
        return ((x * w).sin().sum(),)

    (got,) = gradmap.tsum(h, xs, executor=executor, chunksize=4)
    want = sum(h(x)[0] for x in xs)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, w)[0], torch.autograd.grad(want, w)[0])


def test_modules_of_finds_modules_in_long_lists_and_skips_datasets():
    # ``modules_of`` (whose buffers a recompute keeps, whose .grad a forward may write) looks
    # through f's closure per call; a long list of items is data, not modules, and is not
    # scanned item by item, while a long plain list of modules is.
    from gradmap._torch._graph import modules_of

    nets = [torch.nn.Linear(2, 2) for _ in range(20)]
    data = [(torch.randn(2), 1.0) for _ in range(1000)]

    def f(i: int) -> Tensor:
        x, _ = data[i]
        return nets[i % 20](x).sum()

    assert {id(m) for m in modules_of(f)} == {id(m) for m in nets}
    nets_and_data = [data, nets]
    g = lambda i: nets_and_data[1][0](nets_and_data[0][i][0])  # noqa: E731
    assert {id(m) for m in modules_of(g)} == {id(m) for m in nets}
