"""``gradmap.tsum`` against the plain loop's sum, over every executor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gradmap

import support
from support import Boom, close, gradmap_notes, native_walk

pytestmark = pytest.mark.usefixtures("both_walks")

F64 = torch.float64


def _model_and_bags(seed: int = 0, n: int = 9) -> tuple[nn.Module, list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)
    sizes = torch.randint(1, 7, (n,), generator=g).tolist()
    bags = [torch.randn(k, 4, dtype=F64, generator=g, requires_grad=True) for k in sizes]
    return model, bags


def _grads(loss: Tensor, wrt: list[Tensor]) -> list[Tensor | None]:
    return list(torch.autograd.grad(loss, wrt, allow_unused=True))


def test_sum_of_losses_matches_loop(tmap_kwargs):
    model, bags = _model_and_bags()
    h = torch.randn(4, dtype=F64, requires_grad=True)
    shift = h * 2  # a tensor made before the call: its graph runs once, with the sum

    def f(bag: Tensor) -> Tensor:
        return model(bag + shift).pow(2).mean()

    wrt = [*model.parameters(), h, *bags]
    ref_loss = sum(f(b) for b in bags)
    ref = _grads(ref_loss, wrt)
    shift = h * 2
    loss = gradmap.tsum(f, bags, **tmap_kwargs)
    torch.testing.assert_close(loss, ref_loss)
    close(_grads(loss, wrt), ref)


def test_backward_accumulates_like_the_loop(tmap_kwargs):
    model, bags = _model_and_bags(1)

    def f(bag: Tensor) -> Tensor:
        return model(bag).sum()

    sum(f(b) for b in bags).backward()
    ref = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    (3.0 * gradmap.tsum(f, bags, **tmap_kwargs)).backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, 3.0 * r)


@pytest.mark.parametrize("chunksize", [1, 100])  # many chunks; one chunk reaching everything
def test_gradients_returned_twice_are_independent(tmap_kwargs, chunksize):
    # With cotangent one, a chunk's early gradients are handed on as they are; a kept graph
    # must not see what a user's in-place change to a returned gradient did to them.
    model, bags = _model_and_bags(2)

    def f(bag: Tensor) -> Tensor:
        return model(bag).sum()

    params = list(model.parameters())
    want = _grads(sum(f(b) for b in bags), params)
    kwargs = {**tmap_kwargs, "chunksize": chunksize}
    loss = gradmap.tsum(f, bags, **kwargs)
    first = torch.autograd.grad(loss, params, retain_graph=True)
    for g in first:
        g.mul_(-7.0)
    close(list(torch.autograd.grad(loss, params)), want)
    # And a plain backward: the gradients it leaves in .grad are the user's to change.
    model.zero_grad()
    gradmap.tsum(f, bags, **kwargs).backward()
    for p in params:
        p.grad.mul_(0.0)  # type: ignore[union-attr]
    model.zero_grad()
    gradmap.tsum(f, bags, **kwargs).backward()
    close([p.grad for p in params], want)


@pytest.mark.parametrize("kind", ["vector", "pytree"])
def test_other_result_shapes_take_the_general_path(tmap_kwargs, kind):
    model, bags = _model_and_bags(2)

    def f(bag: Tensor):
        out = model(bag).mean(0) * bag.sum()  # shape (1,)
        if kind == "pytree":
            return {"a": out, "b": (bag.pow(2).sum(), torch.tensor(1.0))}
        return out.expand(3)

    def weigh(total) -> Tensor:
        if kind == "pytree":
            return (total["a"] * 2).sum() + total["b"][0] * 3 + total["b"][1]
        return (total * torch.tensor([1.0, -2.0, 0.5], dtype=F64)).sum()

    wrt = [*model.parameters(), *bags]
    ref_total = f(bags[0])
    for b in bags[1:]:
        ref_total = (
            {
                "a": ref_total["a"] + f(b)["a"],
                "b": tuple(x + y for x, y in zip(ref_total["b"], f(b)["b"])),
            }
            if kind == "pytree"
            else ref_total + f(b)
        )
    ref = _grads(weigh(ref_total), wrt)
    got_total = gradmap.tsum(f, bags, **tmap_kwargs)
    close(_grads(weigh(got_total), wrt), ref)


def test_a_sum_of_pytrees_backward_leaf_by_leaf_like_loop(tmap_kwargs):
    """The sums of a pytree's leaves have graphs of their own in the loop (when the leaves do),
    so one backward per sum works; a sum gone through twice raises PyTorch's error (NOTE [a
    backward of some results])."""
    w = torch.randn(3, dtype=F64, requires_grad=True)
    v = torch.randn(3, dtype=F64, requires_grad=True)
    xs = [torch.randn(3, dtype=F64) for _ in range(7)]

    def f(x: Tensor) -> dict[str, Tensor]:
        return {"a": (x * w).sin().sum(), "b": (x * v).cos()}

    def run(total: dict[str, Tensor]) -> list[Tensor]:
        w.grad = v.grad = None
        total["b"].sum().backward()
        total["a"].backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            total["b"].sum().backward()
        assert w.grad is not None and v.grad is not None
        return [w.grad, v.grad]

    ref = run({k: sum(f(x)[k] for x in xs) for k in ("a", "b")})  # type: ignore[misc]
    close(run(gradmap.tsum(f, xs, **tmap_kwargs)), ref)


def test_gradcheck_and_gradgradcheck():
    model, bags = _model_and_bags(3, n=4)
    bags = [b.detach()[:2].requires_grad_() for b in bags]

    def total(*bs: Tensor) -> Tensor:
        return gradmap.tsum(lambda b: model(b).tanh().sum(), bs, chunksize=2)

    assert torch.autograd.gradcheck(total, bags)
    assert torch.autograd.gradgradcheck(total, bags)


def test_double_backward_matches_loop():
    model, bags = _model_and_bags(4)
    w = torch.randn(4, dtype=F64, requires_grad=True)

    def f(bag: Tensor) -> Tensor:
        return model(bag * w).pow(2).sum()

    (g_ref,) = torch.autograd.grad(sum(f(b) for b in bags), [w], create_graph=True)
    (gg_ref,) = torch.autograd.grad(g_ref.pow(2).sum(), [w])
    (g,) = torch.autograd.grad(gradmap.tsum(f, bags, chunksize=2), [w], create_graph=True)
    (gg,) = torch.autograd.grad(g.pow(2).sum(), [w])
    torch.testing.assert_close(g, g_ref)
    torch.testing.assert_close(gg, gg_ref)


def test_remat_and_no_grad(tmap_kwargs):
    model, bags = _model_and_bags(5)

    def f(bag: Tensor) -> Tensor:
        return model(bag).exp().mean()

    wrt = list(model.parameters())
    ref_loss = sum(f(b) for b in bags)
    ref = _grads(ref_loss, wrt)
    close(_grads(gradmap.tsum(f, bags, remat=True, **tmap_kwargs), wrt), ref)
    with torch.no_grad():
        total = gradmap.tsum(f, bags, **tmap_kwargs)
    assert not total.requires_grad
    torch.testing.assert_close(total, ref_loss.detach())


def test_bitwise_the_same_for_any_worker_count():
    model, bags = _model_and_bags(6, n=40)
    bags = [b.float() for b in bags]
    model = model.float()

    def grads(**kwargs) -> list[Tensor]:
        loss = gradmap.tsum(lambda b: model(b).mean(), bags, **kwargs)
        return [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]

    ref = grads(executor="serial")
    for workers in (1, 2, 4):
        got = grads(workers=workers)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), workers


def test_error_in_forward_names_the_element(tmap_kwargs):
    model, bags = _model_and_bags(7)

    def f(bag: Tensor) -> Tensor:
        if bag.shape[0] == bags[5].shape[0] and torch.equal(bag, bags[5]):
            raise Boom("bad bag")
        return model(bag).sum()

    with pytest.raises(Boom) as info:
        gradmap.tsum(f, bags, **tmap_kwargs)
    assert any("element 5 " in n and "gradmap.tsum" in n for n in gradmap_notes(info.value))


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        raise Boom("backward of a bad element")


def test_error_in_early_pullback_names_the_element(tmap_kwargs):
    model, bags = _model_and_bags(8)

    def f(bag: Tensor) -> Tensor:
        y = model(bag).sum()
        return _FailingBackward.apply(y) if bag is bags[4] else y

    # The chunk's pullback runs during the forward; its error is raised where the loop raises
    # it, in the backward (the chunk is recomputed there, element by element).
    loss = gradmap.tsum(f, bags, **tmap_kwargs)
    with pytest.raises(Boom) as info:
        loss.backward()
    assert any("element 4 " in n for n in gradmap_notes(info.value))


def test_no_elements_and_mismatched_results():
    with pytest.raises(ValueError, match="no elements"):
        gradmap.tsum(lambda x: x, [])
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="structure"):
        gradmap.tsum(lambda i: (w * i).sum() if i else {"a": w.sum()}, range(3), chunksize=1)


def test_random_losses_reproducible_under_grad_and_no_grad():
    w = torch.randn(3, requires_grad=True)
    drop = nn.Dropout(0.5)

    def f(i: int) -> Tensor:
        return (drop(w * (i + 1)) + torch.rand(3)).sum()

    def total(**kwargs) -> Tensor:
        torch.manual_seed(11)
        return gradmap.tsum(f, range(12), chunksize=3, **kwargs)

    ref = total(executor="serial")
    with torch.no_grad():
        assert torch.equal(total(workers=2), ref.detach())
    assert torch.equal(total(workers=2).detach(), ref.detach())
    assert torch.equal(total(workers=4).detach(), ref.detach())


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_results_that_require_grad_for_some_elements_only(executor):
    """Control flow that skips the parameters for some elements: the loop sums, so does tsum."""

    def run(mapper):
        torch.manual_seed(9)
        p = torch.randn(3, dtype=F64, requires_grad=True)
        xs = [torch.randn(3, dtype=F64) for _ in range(6)]

        def f(x):
            loss = (x * p).pow(2).sum()
            return (loss, x.sum()) if x[0] > 0 else (loss.detach(), x.sum())

        total = mapper(f, xs)
        loss, plain = total if isinstance(total, tuple) else (total, None)
        return [loss.detach(), plain, *torch.autograd.grad(loss, [p])]

    def loop(f, xs):
        each = [f(x) for x in xs]
        return tuple(sum(leaves) for leaves in zip(*each))

    got = run(lambda f, xs: gradmap.tsum(f, xs, executor=executor, chunksize=2))
    for a, b in zip(got, run(loop)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grad", [True, False])
def test_bool_results_are_counted_as_the_loops_sum_counts_them(tmap_kwargs, grad):
    """``sum`` starts from 0, and ``0 + tensor(True)`` is an integer: the loop counts true
    values, where ``True + True`` alone is ``True``."""
    p = torch.randn(3, dtype=F64, requires_grad=True)
    xs = [torch.tensor([float(i % 3 - 1), 1.0, -2.0], dtype=F64) for i in range(7)]

    def f(x):
        return {"hit": x > 0, "any": (x[0] > 0), "loss": (x * p).sum()}

    with torch.set_grad_enabled(grad):
        got = gradmap.tsum(f, xs, **tmap_kwargs)
        each = [f(x) for x in xs]
        want = {key: sum(y[key] for y in each) for key in each[0]}  # leaf by leaf, as tsum
    for key in ("hit", "any", "loss"):
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key])
    if grad:
        close(torch.autograd.grad(got["loss"], p), torch.autograd.grad(want["loss"], p))
    one = gradmap.tsum(lambda x: x[0] > 0, xs[:1], **tmap_kwargs)
    assert one.dtype == torch.int64 and int(one) == 0


def test_results_that_do_not_add_are_a_type_error_naming_the_elements(tmap_kwargs):
    with pytest.raises(TypeError, match=r"gradmap.tsum: the result of element 1, a NoneType"):
        gradmap.tsum(lambda x: None, range(4), **{**tmap_kwargs, "chunksize": 4})
    with pytest.raises(TypeError, match=r"leaf 1 of the result's pytree"):
        gradmap.tsum(lambda x: (torch.tensor(1.0), None), range(4), **tmap_kwargs)


def test_a_leaf_that_requires_grad_in_no_element_is_summed_as_a_constant():
    a, b = torch.randn(3, dtype=F64, requires_grad=True), torch.randn(3, dtype=F64)
    total = gradmap.tsum(lambda x: x.sum(), [a, b, a * 2, b])
    torch.testing.assert_close(total.detach(), (3 * a.sum() + 2 * b.sum()).detach())
    total.backward()
    torch.testing.assert_close(a.grad, torch.full((3,), 3.0, dtype=F64))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("chunksize", [None, 1, 4])
def test_results_of_shapes_that_do_not_broadcast_name_the_elements(tmap_kwargs, chunksize, grad):
    w = torch.randn(3, dtype=F64, requires_grad=True)
    xs = [torch.randn(3, dtype=F64) for _ in range(5)] + [torch.randn(2, dtype=F64)]
    xs += [torch.randn(3, dtype=F64) for _ in range(3)]
    kwargs = {**tmap_kwargs, "chunksize": chunksize}
    with torch.set_grad_enabled(grad), pytest.raises(ValueError) as info:
        gradmap.tsum(lambda x: x * w[: len(x)], xs, **kwargs)
    message = str(info.value)
    assert message.startswith("gradmap.tsum: the result of element")
    assert "(2,)" in message and "(3,)" in message, message
    # element 5 is named, on the side of the sum it is on
    assert (
        ("the result of element 5," in message)
        or ("elements 5.." in message)
        or ("..5," in message and "elements 0.." in message)
    ), message
    # the loop adds shapes that broadcast; so does tsum
    ys = [torch.randn(3, dtype=F64), torch.randn(1, dtype=F64), torch.randn(3, dtype=F64)]
    got = gradmap.tsum(lambda y: y * w, ys, **kwargs)
    torch.testing.assert_close(got, sum(y * w for y in ys))


def test_losses_broadcast_by_larger_results_get_the_loops_gradient(tmap_kwargs):
    # Some elements return a 0-d loss, others a vector the loop's sum broadcasts it against: each
    # loss's gradient is taken with the sum of the vector's cotangent, as the loop's add gives it.
    w = torch.tensor([1.0, 2.0, 3.0], dtype=F64, requires_grad=True)

    def f(i: int) -> Tensor:
        return w * i if i == 3 else (w * i).pow(2).sum()

    v = torch.tensor([1.0, -2.0, 5.0], dtype=F64)
    ref = sum(f(i) for i in range(8))
    (ref_grad,) = torch.autograd.grad((ref * v).sum(), w)
    got = gradmap.tsum(f, range(8), **tmap_kwargs)
    torch.testing.assert_close(got, ref)
    close(torch.autograd.grad((got * v).sum(), w), [ref_grad])
    # a vector that requires no grad, of another shape than the parameter's
    u = torch.tensor([1.0, 5.0], dtype=F64)

    def f2(i: int) -> Tensor:
        return torch.zeros(2, dtype=F64) if i == 0 else (w * i).sum()

    ref = sum(f2(i) for i in range(8))
    (ref_grad,) = torch.autograd.grad((ref * u).sum(), w)
    got = gradmap.tsum(f2, range(8), **tmap_kwargs)
    close(torch.autograd.grad((got * u).sum(), w), [ref_grad])


def _half_precision_losses() -> tuple[Tensor, list[Tensor], Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, generator=g, requires_grad=True)  # a float32 parameter
    xs = [torch.randn(4, generator=g) for _ in range(6)]

    def f(x: Tensor) -> Tensor:  # computed in float16, as under autocast; a float32 loss
        h = w.half() * 1e-4
        return (h * x.half() * 1e-4).sum().float()

    return w, xs, f


@pytest.mark.parametrize("scale", [1024.0, 65536.0, 1.0])
def test_a_loss_scale_reaches_a_half_precision_graph_as_in_the_loop(tmap_kwargs, scale):
    # NOTE [gradients of reduced precision]: a loss scale (GradScaler's) moves float16 gradients
    # out of underflow (1024: the loop's are about 2.7e-5, pulled back with one and scaled after
    # they were zeros) or into the overflow a scaler watches for (65536: inf and nan).
    w, xs, f = _half_precision_losses()
    (ref,) = torch.autograd.grad(sum(f(x) for x in xs) * scale, w)
    if scale == 1024:
        assert bool(ref.ne(0).all())  # (with one: zeros)
    if scale == 65536:
        assert not bool(ref.isfinite().all())
    (got,) = torch.autograd.grad(gradmap.tsum(f, xs, **tmap_kwargs) * scale, w)
    torch.testing.assert_close(got, ref, equal_nan=True)
    # tmap, once it learnt that its results get one cotangent (it then pulls back early)
    for _ in range(3):
        ys = gradmap.tmap(f, xs, **tmap_kwargs)
        (got,) = torch.autograd.grad(sum(ys) * scale, w)
        torch.testing.assert_close(got, ref, equal_nan=True)


def test_every_error_of_tsum_names_tsum():
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"^gradmap.tsum\(strict=True\)"):
        gradmap.tsum(lambda a, b: (w * a * b).sum(), [1, 2], [1], strict=True)
    with pytest.raises(TypeError, match=r"^gradmap.tsum: chunksize"):
        gradmap.tsum(lambda a: (w * a).sum(), [1, 2], chunksize=1.5)
    with pytest.raises(ValueError, match=r"^gradmap.tsum: workers"):
        gradmap.tsum(lambda a: (w * a).sum(), [1, 2], workers=0)
    with pytest.raises(ValueError, match=r"^gradmap.tsum: unknown executor"):
        gradmap.tsum(lambda a: (w * a).sum(), [1, 2], executor="nope")
    with pytest.raises(TypeError, match=r"^gradmap.tsum: progress"):
        gradmap.tsum(lambda a: (w * a).sum(), [1, 2], progress=3)
    with pytest.raises(TypeError, match=r"^gradmap.tsum: f must be callable"):
        gradmap.tsum(3, [1, 2])


# -- backwards that run user code (NOTE [chunks whose backward is user code]) -------------------


class _Clip(torch.autograd.Function):
    """The identity, whose backward clips the gradient: not linear in it."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return g.clamp(-0.5, 0.5)


@pytest.mark.parametrize("executor", ["threads", "serial"])
@pytest.mark.parametrize("kind", ["hook", "function", "retain_grad"])
def test_backward_user_code_sees_the_sums_cotangent_when_the_backward_runs(executor, kind):
    """A hook on a tensor f made, a custom Function's backward, a retained gradient: in the
    loop they run in the backward, with the cotangent the loss brings (here 3, then 0.25). A
    chunk of losses must not be pulled back early with cotangent one and scaled: the clipping
    gave 4.5 for 1.5, hooks ran in the forward, retained gradients read 1 for 0.25. (Tensor
    hooks are seen by the native walk only.)"""
    if kind != "function" and not support.native_walk():
        pytest.skip("the Python walk does not see hooks on tensors f made")

    def run(total: Any) -> tuple[list[Tensor], list[Any], list[Any]]:
        w = torch.ones(2, dtype=torch.float64, requires_grad=True)
        seen: list[Any] = []
        kept: list[Tensor] = []

        def f(i: int) -> Tensor:
            h = w * (i + 1)
            if kind == "hook":
                h.register_hook(lambda g: (seen.append(g.tolist()), g.clamp(-0.5, 0.5))[1])
            elif kind == "function":
                h = _Clip.apply(h)
            else:
                h.retain_grad()
                kept.append(h)
            return h.sum()

        s = total(f)
        before = list(seen)  # nothing may run before a backward
        (3 * s).backward(retain_graph=True)
        g1 = w.grad.clone()
        (s / 4).backward()
        return (
            [g1, w.grad, *(h.grad for h in sorted(kept, key=lambda h: float(h[0])))],
            before,
            seen,
        )

    got = run(lambda f: gradmap.tsum(f, range(4), executor=executor, chunksize=2))
    ref = run(lambda f: sum(f(i) for i in range(4)))
    for a, b in zip(got[0], ref[0]):
        torch.testing.assert_close(a, b)
    assert got[1] == ref[1] == []
    assert sorted(got[2]) == sorted(ref[2])


def test_a_complex_loss_gets_the_loops_gradient():
    """A complex loss's pullback is not complex-linear in its cotangent (``conj``): tsum must
    not pull such chunks back early and scale them (the gradient came out conjugated)."""

    def run(total: Any) -> Tensor:
        x = torch.tensor([3.0 + 4.0j, 1.0 - 2.0j], dtype=torch.complex128, requires_grad=True)
        total(lambda i: (x[i].conj() * (i + 2)).sum() + x[1 - i] * 1j).abs().backward()
        return x.grad

    torch.testing.assert_close(
        run(lambda f: gradmap.tsum(f, range(2), chunksize=1)),
        run(lambda f: sum(f(i) for i in range(2))),
    )


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_a_tensor_f_caches_for_the_elements_after_it(tmap_kwargs, api):
    """``f`` fills a cache as it runs (the first element to need ``W = w @ w`` computes it, the
    others read it): ``W``'s node runs once per chunk that reached it, each with its share, and
    stays whole until the last share is through (NOTE [a tensor one chunk made and another
    read]); a ``tsum`` whose pullbacks freed their graphs failed on threads ("Trying to backward
    through the graph a second time")."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 6, dtype=F64, generator=g, requires_grad=True)
    xs = [torch.randn(6, dtype=F64, generator=g) for _ in range(24)]
    cache: dict[str, Tensor] = {}

    def f(x: Tensor) -> Tensor:
        if "W" not in cache:
            cache["W"] = w @ w
        return (cache["W"] @ x).tanh().sum()

    want = torch.autograd.grad(sum(f(x) for x in xs), w)[0]
    for _ in range(3):  # (the pool from the second call on)
        cache.clear()
        if not native_walk():  # it cannot tell W from a tensor made before the call: it stops
            with pytest.raises(RuntimeError, match="or by f for another element"):
                out = getattr(gradmap, api)(f, xs, **tmap_kwargs)
                torch.autograd.grad(out if api == "tsum" else sum(out), w)
            continue
        out = getattr(gradmap, api)(f, xs, **tmap_kwargs)
        got = torch.autograd.grad(out if api == "tsum" else sum(out), w)[0]
        close(got, want)
