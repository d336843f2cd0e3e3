"""Chunks of losses pulled back during the forward (``_torch/_early.py``), for ``tmap`` on
threads: NOTE [tmap's losses pulled back early]. ``tsum``'s own are tested in
``test_tsum.py``; the other processes' in ``test_remote.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gradmap
from gradmap._placement import key_of, learn_uniform_cotangents
from gradmap._torch import _map

from support import close, loop, native_walk, python_walk, ragged


@pytest.fixture
def early(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each backward through a map on threads found chunks pulled back early."""
    seen: list[bool] = []
    join_backward = _map.MapGraph.join_backward

    def spy(self: Any, ctx: Any, cotangents: Any) -> Any:
        seen.append(self.ones is not None and any(self.ones.pulled))
        return join_backward(self, ctx, cotangents)

    monkeypatch.setattr(_map.MapGraph, "join_backward", spy)
    return seen


def _model() -> tuple[nn.Module, Tensor, list[Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(4), ragged(24)


def _fresh(f: Callable[..., Any]) -> Callable[..., Any]:
    learn_uniform_cotangents(key_of(f), False)  # (learnt per code: another test's maps of it)
    return f


_LOSSES: dict[str, Callable[[list[Tensor]], Tensor]] = {
    "sum": lambda ys: sum(ys),  # type: ignore[dict-item]
    "mean": lambda ys: torch.stack(ys).mean(),
    "weighted": lambda ys: (torch.stack(ys) * torch.arange(1.0, len(ys) + 1)).sum(),
}


def test_learnt_then_pulled_back_early_with_the_backwards_bits(tmap_kwargs, early):
    """After a backward that gave every result one cotangent, the next map of ``f`` pulls its
    chunks back in the forward; a backward with one cotangent takes those gradients (with
    cotangent one, the bits of the pullback it replaces), one with other cotangents pulls the
    kept graphs back, and the next map learns that."""
    if not native_walk():
        pytest.skip("the native walk cannot be built here")
    model, w, xs = _model()
    wrt = [*model.parameters(), *xs]
    f = _fresh(lambda x: torch.sin(model(x * w)).mean() ** 2)

    def grads(name: str, run: Callable[..., list[Any]]) -> list[Tensor]:
        return list(torch.autograd.grad(_LOSSES[name](run(f, xs)), wrt))

    def on(f: Any, xs: Any) -> list[Any]:
        return gradmap.tmap(f, xs, **tmap_kwargs)

    first = grads("sum", on)
    for name in ["sum", "mean", "weighted", "sum", "sum"]:
        got = grads(name, on)
        close(got, grads(name, loop))
        if name == "sum":
            assert all(torch.equal(a, b) for a, b in zip(got, first))
    if tmap_kwargs["executor"] == "serial":  # one thread: nothing to overlap, not done
        assert not any(early), early
    else:
        assert early == [False, True, True, True, False, True], early


@pytest.mark.parametrize("user", ["hook", "function"])
def test_user_code_in_the_backward_sees_the_cotangent_the_loss_brings(tmap_kwargs, early, user):
    """A hook on a tensor ``f`` makes, a custom ``autograd.Function`` that clips: not pulled
    back early (they would see cotangent one, in the forward), as in the loop."""
    model, w, xs = _model()
    seen: list[float] = []

    class Clip(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            return g.clamp(-0.01, 0.01)

    def f(x: Tensor) -> Tensor:
        h = torch.sin(model(x * w)).mean()
        if user == "hook":
            h.register_hook(lambda g: seen.append(float(g)))
        else:
            h = Clip.apply(h)
        return h**2

    f = _fresh(f)
    wrt = list(model.parameters())
    for _ in range(3):
        got = torch.autograd.grad(torch.stack(gradmap.tmap(f, xs, **tmap_kwargs)).mean() * 50, wrt)
        ref = torch.autograd.grad(torch.stack(loop(f, xs)).mean() * 50, wrt)
        close(got, ref)
    if user == "hook":  # the first map's backward, then the first loop's: the same cotangents
        n = len(xs)
        torch.testing.assert_close(
            torch.tensor(sorted(seen[:n])), torch.tensor(sorted(seen[n : 2 * n]))
        )
    if native_walk():
        assert early == [False, False, False], early


def test_a_backward_error_is_raised_by_the_backward_naming_the_element(tmap_kwargs, early):
    """An element whose backward fails (a saved tensor ``f`` changed in place after using it):
    the early pullback leaves it to the backward, which raises the loop's error with a note
    naming the element; the map itself does not raise."""
    _, w, xs = _model()
    w.requires_grad_()

    def f(i: int, x: Tensor) -> Tensor:
        y = (x * w).exp()
        if i == 5:
            y.add_(1.0)  # exp saved its result
        return y.sum()

    f = _fresh(f)
    good = list(range(len(xs)))
    good.remove(5)
    for _ in range(2):  # learn on elements that all pull back, then map them all
        torch.autograd.grad(sum(gradmap.tmap(f, good, [xs[i] for i in good], **tmap_kwargs)), w)
    ys = gradmap.tmap(f, range(len(xs)), xs, **tmap_kwargs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        torch.autograd.grad(sum(ys), w)
    assert any(f"element 5 (of {len(xs)})" in n for n in info.value.__notes__)
    if native_walk():
        assert early[-1] is (tmap_kwargs["executor"] != "serial"), early


def test_retained_results_and_the_python_walk_take_the_backward(tmap_kwargs, early):
    """A result ``f`` called ``retain_grad()`` on gets its gradient from the backward's
    pullback; the Python walk, which does not see hooks on tensors ``f`` makes, pulls nothing
    back early."""
    model, w, xs = _model()

    def f(x: Tensor) -> Tensor:
        y = torch.sin(model(x * w)).mean()
        y.retain_grad()
        return y

    f = _fresh(f)
    for _ in range(3):
        ys = gradmap.tmap(f, xs, **tmap_kwargs)
        (torch.stack(ys).mean() * 3).backward()
        for y in ys:
            torch.testing.assert_close(y.grad, torch.tensor(3.0 / len(xs)))
    g = _fresh(lambda x: torch.sin(model(x * w)).mean())
    with python_walk():
        for _ in range(3):
            torch.autograd.grad(sum(gradmap.tmap(g, xs, **tmap_kwargs)), list(model.parameters()))
    assert early[-3:] == [False, False, False], early


def test_maps_never_pulled_back_leave_the_next_without(tmap_kwargs, early):
    """An evaluation with grad mode on (results never pulled back) between training steps: the
    map after it pulls back nothing early (nothing would use it), and learns again."""
    if not native_walk() or tmap_kwargs["executor"] == "serial":
        pytest.skip("no early pullback here")
    model, w, xs = _model()
    f = _fresh(lambda x: torch.sin(model(x * w)).mean())
    wrt = list(model.parameters())
    for evaluate in [False, False, True, False, False]:
        ys = gradmap.tmap(f, xs, **tmap_kwargs)
        if not evaluate:
            torch.autograd.grad(sum(ys), wrt)
        del ys
    assert early == [False, True, False, True], early


def test_a_model_whose_early_gradients_would_pass_the_budget_learns_nothing(
    tmap_kwargs, early, monkeypatch
):
    """A gradient per chunk of every tensor the map reaches, kept to the backward: past
    ``EARLY_BYTES`` (here made 1 KB) nothing is pulled back early."""
    monkeypatch.setattr(_map, "EARLY_BYTES", 1024)
    model, w, xs = _model()  # 49 parameters and 24 small items: over 1 KB a chunk
    f = _fresh(lambda x: torch.sin(model(x * w)).mean())
    for _ in range(3):
        got = torch.autograd.grad(sum(gradmap.tmap(f, xs, **tmap_kwargs)), list(model.parameters()))
    close(got, torch.autograd.grad(sum(loop(f, xs)), list(model.parameters())))
    assert early == [False, False, False], early
