"""remat=True: no graph in the forward, a recompute in the backward, the same gradients."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch
from torch import nn

import gradmap

from support import native_walk, settle_before_threads_exit

pytestmark = pytest.mark.usefixtures("both_walks")


def _ragged(n=9, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(int(k), d, generator=g, requires_grad=True)
        for k in torch.randint(1, 6, (n,), generator=g)
    ]


def _grads(f, xs, params, **kwargs):
    ys = gradmap.tmap(f, xs, **kwargs)
    loss = sum((i + 1) * y for i, y in enumerate(ys))
    return torch.autograd.grad(loss, params + xs)


def test_remat_equals_store_bitwise(tmap_kwargs):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xs = _ragged()
    f = lambda x: model(x).mean()  # noqa: E731
    params = list(model.parameters())
    store = _grads(f, xs, params, **tmap_kwargs)
    remat = _grads(f, xs, params, remat=True, **tmap_kwargs)
    loop = torch.autograd.grad(sum((i + 1) * f(x) for i, x in enumerate(xs)), params + xs)
    for s, r, ref in zip(store, remat, loop):
        assert torch.equal(s, r)
        torch.testing.assert_close(r, ref)


def test_remat_closure_and_nonleaf_tensors(tmap_kwargs):
    a = torch.randn(4, requires_grad=True)
    xs = _ragged()

    def run(mapper):
        b = a * 2  # non-leaf, computed before the call
        ys = mapper(lambda x: torch.sin(x @ a + x @ b).sum())
        return torch.autograd.grad(torch.stack(ys).sum(), [a, *xs])

    ref = run(lambda f: [f(x) for x in xs])
    got = run(lambda f: gradmap.tmap(f, xs, remat=True, **tmap_kwargs))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)


def test_remat_runs_f_again_in_the_backward_only(tmap_kwargs):
    calls = {"grad": 0, "nograd": 0}
    w = torch.randn(3, requires_grad=True)
    counting = threading.Lock()  # (``+=`` on a dict entry is no atomic step without the GIL)

    def f(x):
        with counting:
            calls["grad" if torch.is_grad_enabled() else "nograd"] += 1
        return (x * w).sum()

    xs = torch.randn(6, 3)
    ys = gradmap.tmap(f, xs, remat=True, **tmap_kwargs)
    # The forward records each chunk's graph (its boundary is read off it) and frees it at once.
    assert calls == {"grad": 6, "nograd": 0}
    assert all(y.requires_grad for y in ys)
    assert all(y.grad_fn.name() == "_JoinBackward" for y in ys)
    torch.stack(ys).sum().backward()
    assert calls == {"grad": 12, "nograd": 0}
    torch.testing.assert_close(w.grad, xs.sum(0))


def test_remat_skips_elements_without_gradient():
    calls: list[int] = []
    w = torch.randn(3, requires_grad=True)

    def f(i):
        if torch.is_grad_enabled():
            calls.append(i)
        return (w * i).sum()

    ys = gradmap.tmap(f, range(8), remat=True, chunksize=1)
    calls.clear()  # the forward's
    (ys[2] + ys[5]).backward()
    assert sorted(calls) == [2, 5]


@pytest.mark.parametrize("remat", [False, True])
def test_random_f_same_for_every_executor_and_remat(remat):
    w = torch.randn(4, 3, requires_grad=True)
    xs = _ragged(n=7)
    drop = nn.Dropout(0.4)

    def f(x):
        return (drop(torch.tanh(x @ w)) ** 2).mean() + torch.rand(()) * x.sum()

    def run(**kwargs):
        torch.manual_seed(123)
        ys = gradmap.tmap(f, xs, chunksize=2, **kwargs)
        return (torch.stack(ys).detach(), *torch.autograd.grad(torch.stack(ys).sum(), [w, *xs]))

    ref = run(executor="serial")
    for kwargs in (
        {"executor": "serial", "remat": remat},
        {"workers": 2, "remat": remat},
        {"workers": 4, "remat": remat},
    ):
        got = run(**kwargs)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), kwargs


def test_random_draws_differ_between_elements_and_calls():
    torch.manual_seed(0)
    a = gradmap.tmap(lambda i: torch.rand(()), range(4))
    b = gradmap.tmap(lambda i: torch.rand(()), range(4))
    assert len({float(t) for t in a}) == 4
    assert not torch.equal(torch.stack(a), torch.stack(b))


def test_remat_double_backward():
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def g(xs, w):
        f = lambda x: torch.sin(x @ w).sum() * x.sum()  # noqa: E731
        return torch.stack(gradmap.tmap(f, xs, remat=True, chunksize=2))

    assert torch.autograd.gradcheck(g, (xs, w))
    assert torch.autograd.gradgradcheck(g, (xs, w))


def test_remat_under_no_grad_records_nothing():
    w = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        ys = gradmap.tmap(lambda x: (x * w).sum(), torch.randn(4, 3), remat=True)
    assert not any(y.requires_grad for y in ys)


@pytest.mark.parametrize("remat", [False, True])
def test_eval_batchnorm_under_a_double_backward_as_in_the_loop(remat):
    """The recompute of a create_graph backward wrote every buffer back in place, and the eval
    BatchNorm's saved running statistics then refused the second backward."""

    def run(mapper):
        torch.manual_seed(10)
        bn = torch.nn.BatchNorm1d(3).double().eval()
        bn.running_mean.uniform_(-1, 1)
        xs = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        total = sum(mapper(lambda x: (bn(x) ** 2).sum(), xs))
        (g,) = torch.autograd.grad(total, xs[0], create_graph=True)
        (g * g).sum().backward()
        return [g.detach(), bn.weight.grad, bn.running_mean.clone()]

    got = run(lambda f, xs: gradmap.tmap(f, xs, chunksize=2, remat=remat))
    for a, b in zip(got, run(lambda f, xs: [f(x) for x in xs])):
        torch.testing.assert_close(a, b)


# -- what a recompute reads -----------------------------------------------------------------


@pytest.mark.parametrize("how", ["remat", "create_graph"])
def test_a_leaf_f_makes_itself_is_made_anew_by_the_recompute(tmap_kwargs, how):
    """Forces inside f (``p = x.clone().requires_grad_()``, a gradient taken with respect to
    it): the recompute makes its own ``p``, a leaf no one else holds; the loop's gradients,
    not an error calling f nondeterministic."""

    def f(x: torch.Tensor) -> torch.Tensor:
        p = x.clone().requires_grad_()
        energy = (w * p.sin()).sum()
        (force,) = torch.autograd.grad(energy, p, create_graph=True)
        return force.pow(2).sum()

    w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    xs = [torch.tensor([0.5 * i, 1.0 - i], dtype=torch.float64) for i in range(4)]
    want = torch.autograd.grad(sum(f(x) for x in xs), w, create_graph=True)[0]
    ys = gradmap.tmap(f, xs, remat=how == "remat", **tmap_kwargs)
    got = torch.autograd.grad(sum(ys), w, create_graph=how == "create_graph")[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("how", ["remat", "create_graph"])
def test_a_result_changed_in_place_before_a_recompute(tmap_kwargs, how):
    """The user scales a result in place before the backward (fine in the loop): the recompute
    cannot compare that result with the forward's, and must not call f nondeterministic."""

    def run(mapper):  # type: ignore[no-untyped-def]
        w = torch.ones(2, dtype=torch.float64, requires_grad=True)
        ys = mapper(lambda i: (w * (i + 1)) ** 2, range(3))
        ys[0].mul_(3)
        (g,) = torch.autograd.grad(sum(y.sum() for y in ys), w, create_graph=how == "create_graph")
        return g

    want = run(lambda f, xs: [f(i) for i in xs])
    got = run(lambda f, xs: gradmap.tmap(f, xs, remat=how == "remat", **tmap_kwargs))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("api", ["tmap", "tsum"])
@pytest.mark.parametrize("what", ["item", "closure"])
def test_remat_refuses_what_changed_in_place_since_the_forward(tmap_kwargs, api, what):
    """An item or a closure tensor changed in place between the forward and the backward: the
    loop's backward raises PyTorch's error for the tensor it saved; a remat recompute would
    read the new values and give another gradient (NOTE [a recompute reads what the forward
    read]). The same error, naming remat."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    xs = [torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0])]
    c = torch.tensor([2.0, 1.0])
    f = (lambda x: (w * x).sum()) if what == "item" else (lambda x: (w * c * x).sum())
    in_loop = sum(f(x) for x in xs)
    mapped = getattr(gradmap, api)(f, xs, remat=True, **tmap_kwargs)
    loss = sum(mapped) if api == "tmap" else mapped
    with torch.no_grad():
        (xs[0] if what == "item" else c).add_(1.0)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*remat=True"):
        loss.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        in_loop.backward()


@pytest.mark.parametrize("how", ["remat", "create_graph"])
def test_a_leaf_f_makes_and_returns_gets_the_loops_gradient_through_a_recompute(tmap_kwargs, how):
    """Forces, returned with the leaf they were taken at (``return F, p``): the user holds ``p``,
    and the recompute's own ``p`` stands for it (the stored one, at the same place among the
    results), so ``p`` gets the loop's gradient -- first order, and second through W."""

    def run(mapper):  # type: ignore[no-untyped-def]
        w = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)

        def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            p = x.detach().clone().requires_grad_()
            (force,) = torch.autograd.grad((p * w).pow(3).sum(), p, create_graph=True)
            return force, p

        xs = [torch.ones(1, dtype=torch.float64) * (i + 1) for i in range(3)]
        ys = mapper(f, xs)
        loss = sum((force * (k + 1)).sum() for k, (force, _) in enumerate(ys))
        if how == "remat":
            loss.backward()
            return [w.grad, *(p.grad for _, p in ys)]
        first = torch.autograd.grad(loss, [w, *(p for _, p in ys)], create_graph=True)
        (second,) = torch.autograd.grad(sum(g.sum() for g in first), w)
        return [*first, second]

    want = run(lambda f, xs: [f(x) for x in xs])
    got = run(lambda f, xs: gradmap.tmap(f, xs, remat=how == "remat", **tmap_kwargs))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_remat_refuses_an_f_that_changes_its_items_in_place(tmap_kwargs, api):
    """The recompute would change the items a second time (the loop changes them once): an
    error naming it, raised before any recompute runs, the items left as the forward left
    them."""
    c = torch.ones(3, requires_grad=True)
    xs = [torch.ones(3) * (i + 1) for i in range(2)]

    def f(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return (x * c).sum()

    mapped = getattr(gradmap, api)(f, xs, remat=True, **tmap_kwargs)
    loss = sum(mapped) if api == "tmap" else mapped
    after = [x.clone() for x in xs]
    with pytest.raises(RuntimeError, match="changed in place a tensor it was given"):
        loss.backward()
    torch.testing.assert_close(xs, after)


@pytest.mark.parametrize("how", ["remat", "create_graph"])
def test_sparse_results_through_a_recompute(tmap_kwargs, how):
    """The recompute compares its results with the forward's: sparse ones too (``torch.equal``
    takes strided tensors only: the backward raised)."""
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (w @ x).to_sparse()

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]
    want = torch.autograd.grad(sum(torch.sparse.sum(f(x)) for x in xs), w)[0]
    ys = gradmap.tmap(f, xs, remat=how == "remat", **tmap_kwargs)
    loss = sum(torch.sparse.sum(y) for y in ys)
    got = torch.autograd.grad(loss, w, create_graph=how == "create_graph")[0]
    torch.testing.assert_close(got, want)


class _SparseBuffer(nn.Module):
    """A layer holding a sparse matrix as a buffer, as cvxpylayers' ``CvxpyLayer`` does."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        a = torch.randn(4, 4, dtype=torch.float64).relu()
        sparse = a.to_sparse_csr() if layout == torch.sparse_csr else a.to_sparse()
        self.register_buffer("a", sparse)
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a @ self.lin(x)).tanh().sum()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_a_module_with_a_sparse_buffer_through_a_recompute(tmap_kwargs, layout):
    """A recompute checks the buffers of f's modules it may have updated: a sparse one is
    compared by its parts (``torch.equal`` has no sparse kernel: the backward raised), and the
    gradients are the loop's."""
    model = _SparseBuffer(layout)
    xs = [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(5)]
    params = list(model.parameters())
    want = torch.autograd.grad(sum((i + 1) * model(x) for i, x in enumerate(xs)), params + xs)
    got = _grads(model, xs, params, remat=True, **tmap_kwargs)
    torch.testing.assert_close(got, want)
    assert model.a.layout == layout and model.a._version == 0


@pytest.mark.parametrize("remat", [False, True])
def test_jagged_nested_results_get_the_loops_gradients(tmap_kwargs, remat):
    """f returns a jagged nested tensor: a recompute makes new offsets, whose ragged size is
    another nested int, and both the recompute's check and the engine (given the cotangent of
    the result the user holds) refused it (NOTE [jagged results' nested ints])."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor([x[:2] * w[:2], (x * w).sin()], layout=torch.jagged)

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]

    def loss(ys: list[torch.Tensor]) -> torch.Tensor:
        return sum((i + 1) * (y.values() ** 2).sum() for i, y in enumerate(ys))

    want = torch.autograd.grad(loss([f(x) for x in xs]), w)
    ys = gradmap.tmap(f, xs, remat=remat, **tmap_kwargs)
    torch.testing.assert_close(torch.autograd.grad(loss(ys), w), want)


@pytest.mark.parametrize("how", ["remat", "create_graph"])
def test_a_recompute_that_gives_other_values_names_the_element_and_the_difference(tmap_kwargs, how):
    """f gives other values when run again (here: a count of its calls; a library call that is
    not bitwise deterministic, such as lstsq's default driver): the error names the element,
    the result's leaf, the largest difference and where, the likely causes and the fixes."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    calls = dict.fromkeys(range(4), 0)

    def f(i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls[i] += 1
        bump = torch.tensor([0.0, 1e-3, 0.0], dtype=torch.float64) * (i == 2 and calls[i] > 1)
        return (x * w).sum(), (x * w).tanh() + bump

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    ys = gradmap.tmap(f, range(4), xs, remat=how == "remat", **tmap_kwargs)
    loss = sum(a + b.sum() for a, b in ys)
    with pytest.raises(RuntimeError) as caught:
        torch.autograd.grad(loss, w, create_graph=how == "create_graph")
    text = str(caught.value)
    assert "element 2 (of 4), its result's leaf 1" in text, text
    assert "largest absolute difference is 0.001, at index [1]" in text, text
    for told in ("not bitwise deterministic", "not safe on threads", "remat=False"):
        assert told in text, text
    assert "executor='serial' or executor='processes'" in text, text


@pytest.mark.parametrize("uses", ["module", "global"])
@pytest.mark.parametrize("how", ["remat", "create_graph"])
def test_an_f_that_writes_grad_itself_is_not_run_again(tmap_kwargs, how, uses):
    """f takes a step's backward itself (``loss.backward(retain_graph=True)``): running it
    again in a recompute would add to ``.grad`` twice. A recompute refuses it, naming the fix,
    before anything is added; a tsum whose chunks were pulled back in its forward recomputes
    nothing and gets the loop's gradient."""
    model = nn.Linear(3, 1).double()
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum() if uses == "module" else (w * x).sin().sum()
        loss.backward(retain_graph=True)
        return loss

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    leaves = list(model.parameters()) if uses == "module" else [w]
    if how == "remat" or uses == "module":
        ys = gradmap.tmap(f, xs, remat=how == "remat", **tmap_kwargs)
        written = [p.grad.clone() for p in leaves]
        with pytest.raises(RuntimeError, match=r"writes no \.grad"):
            torch.stack(ys).sum().backward(create_graph=how == "create_graph")
        for p, g in zip(leaves, written):
            torch.testing.assert_close(p.grad, g)  # nothing added
    if how == "remat":
        for p in leaves:
            p.grad = None
        gradmap.tsum(f, xs, remat=True, **tmap_kwargs).backward()
        got = [p.grad for p in leaves]
        for p in leaves:
            p.grad = None
        sum(f(x) for x in xs).backward()
        for a, b in zip(got, [p.grad for p in leaves]):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("how", ["remat", "create_graph"])
@pytest.mark.parametrize("cache", ["dict", "parametrize"])
def test_a_cache_emptied_before_a_recompute_is_refused(tmap_kwargs, how, cache):
    """The forward reads ``W`` computed from ``w`` before the map (a dict the user fills, or
    ``parametrize.cached()``), and the cache is emptied before the backward: the recompute
    computes ``W`` from ``w`` itself, a leaf the forward never reached directly. It must not
    pass for a leaf ``f`` made for itself (whose gradient reaches no one): ``w``'s gradient
    was lost so. An error, naming the cache."""
    torch.manual_seed(0)
    if cache == "dict":
        w = torch.randn(3, dtype=torch.float64, requires_grad=True)
        store: dict[str, torch.Tensor] = {}

        def f(x: torch.Tensor) -> torch.Tensor:
            W = store["W"] if "W" in store else w * 2
            return (W * x).sin().sum()

        def cached():  # type: ignore[no-untyped-def]
            store["W"] = w * 2
            return store.clear

    else:
        from torch.nn.utils import parametrize
        from torch.nn.utils.parametrizations import weight_norm

        lin = weight_norm(nn.Linear(3, 3).double())

        def f(x: torch.Tensor) -> torch.Tensor:
            return lin(x).sin().sum()

        def cached():  # type: ignore[no-untyped-def]
            block = parametrize.cached()
            block.__enter__()
            lin.weight  # noqa: B018  (computed and cached now, before the map)
            return lambda: block.__exit__(None, None, None)

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    empty = cached()
    if cache == "parametrize" and not native_walk():  # (the cache is parametrize's own)
        with pytest.raises(RuntimeError, match="Python walk cannot find it"):
            gradmap.tmap(f, xs, remat=how == "remat", **tmap_kwargs)
        empty()
        return
    ys = gradmap.tmap(f, xs, remat=how == "remat", **tmap_kwargs)
    empty()
    params = [w] if cache == "dict" else list(lin.parameters())
    with pytest.raises(RuntimeError, match="reached a tensor made before the call"):
        torch.autograd.grad(sum(ys), params, create_graph=how == "create_graph")


def test_an_f_that_runs_ops_on_threads_of_its_own_is_told_so(tmap_kwargs):
    """Ops ``f`` hands to a pool of its own make nodes that are not the element's (another
    thread made them), and a recompute makes new ones: the error says so, not only that ``f``
    must be deterministic."""
    helper = concurrent.futures.ThreadPoolExecutor(1)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return helper.submit(lambda: (w * x).exp()).result().sum()

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    # (The Python walk stops in the forward: it cannot find such a tensor anywhere.)
    told = "ops f runs on threads of its own" if native_walk() else "Python walk cannot find it"
    try:
        with pytest.raises(RuntimeError, match=told):
            sum(gradmap.tmap(f, xs, remat=True, **tmap_kwargs)).backward()
    finally:
        helper.shutdown()
        settle_before_threads_exit()


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("how", ["remat", "create_graph"])
def test_an_f_that_starts_drawing_tells_why_its_recompute_cannot_replay(executor, how):
    # NOTE [draws a recompute cannot replay]: dropout in eval() mode in f's first map, in train()
    # mode in its second; its third map seeds every element.
    torch.manual_seed(0)
    w = torch.randn(50, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(50, dtype=torch.float64) for _ in range(8)]
    drop = nn.Dropout(0.5)
    scope: dict[str, object] = {"drop": drop, "w": w}
    exec("def f(x):\n    return drop(x * w)\n", scope)  # a code object of its own: no history
    f = scope["f"]
    kwargs = {"executor": executor, "remat": how == "remat"}

    def gradient() -> torch.Tensor:
        ys = gradmap.tmap(f, xs, **kwargs)
        (g,) = torch.autograd.grad(sum(y.pow(2).sum() for y in ys), w, create_graph=how != "remat")
        factor = 4 if drop.training else 2  # (the masks read off the values, scaled by 2)
        expected = sum(factor * y.detach() * (y.detach() != 0) * x for y, x in zip(ys, xs))
        torch.testing.assert_close(g, expected)
        return g

    drop.eval()
    gradient()
    drop.train()
    try:  # the loop's gradient where the forward seeded every element (serial under remat)
        gradient()
    except RuntimeError as e:  # else the error says why (it said f was not deterministic)
        assert "f drew random numbers in this map" in str(e), e
    gradient()


def test_remat_under_autocast_casts_per_chunk_as_the_loop_would(tmap_kwargs):
    # NOTE [autocast's weight cache]: the recompute reaches the casts its forward made.
    torch.manual_seed(0)
    lin = nn.Linear(8, 1)
    xs = [torch.randn(n, 8) for n in (3, 5, 2, 7, 4, 1)]

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin(x).float().square().mean()

    def grads(ys_of: object) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total = sum(ys_of())  # type: ignore[operator]
        return list(torch.autograd.grad(total, list(lin.parameters())))

    ref = grads(lambda: [f(x) for x in xs])
    got = grads(lambda: gradmap.tmap(f, xs, **tmap_kwargs, remat=True))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-3)
    # (the Python walk cannot find a cast another chunk made: it stops the forward, saying so)
    if native_walk():
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the cache as the caller had it after
            assert torch.is_autocast_cache_enabled()
            ys = gradmap.tmap(f, xs, **tmap_kwargs)  # a create_graph backward recomputes
            with pytest.raises(RuntimeError) as info:
                torch.autograd.grad(sum(ys), lin.weight, create_graph=True)
        assert "cache_enabled=False" in " ".join(getattr(info.value, "__notes__", [])), info.value
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        (g,) = torch.autograd.grad(sum(f(x) for x in xs), lin.weight, create_graph=True)
        (expected,) = torch.autograd.grad(g.square().sum(), lin.bias)
        ys = gradmap.tmap(f, xs, **tmap_kwargs)
        (g,) = torch.autograd.grad(sum(ys), lin.weight, create_graph=True)
        (got2,) = torch.autograd.grad(g.square().sum(), lin.bias)
    torch.testing.assert_close(got2, expected, rtol=2e-2, atol=1e-3)
