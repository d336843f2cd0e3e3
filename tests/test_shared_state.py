"""``f`` that writes state every thread of the process shares (NOTE [process-wide state f
writes]): a map on threads gives the loop's values and gradients on every call, where a plain
thread pool races; libraries that keep such state (pyro, gpytorch, botorch) and a user's own."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gradmap
from gradmap._placement import _history

F64 = torch.float64


class Setting:
    """A setting as gpytorch writes one: a class attribute set on enter, restored on exit."""

    value = 1.0

    def __init__(self, value: float) -> None:
        self.value_in = value

    def __enter__(self) -> None:
        self.before = Setting.value
        Setting.value = self.value_in

    def __exit__(self, *exc: object) -> None:
        Setting.value = self.before


_STACK: list[Any] = []


class Pushed:
    """A handler as pyro's are: pushed on a module-level stack on enter, popped on exit."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __enter__(self) -> Pushed:
        _STACK.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _STACK.pop()


_LEVEL = 0


@contextlib.contextmanager
def level(k: int) -> Iterator[None]:
    """A generator-based context manager that rebinds a module global."""
    global _LEVEL
    before, _LEVEL = _LEVEL, k
    try:
        yield
    finally:
        _LEVEL = before


def _w() -> torch.Tensor:
    return torch.linspace(0.5, 1.5, 4, dtype=F64).requires_grad_()


def _items(n: int = 16) -> list[tuple[torch.Tensor, float]]:
    return [(torch.full((4,), 0.1 * (i + 1), dtype=F64), float(i + 2)) for i in range(n)]


def _setting_f(w: torch.Tensor, pause: float = 0.0005) -> Any:
    def f(x: torch.Tensor, s: float) -> torch.Tensor:
        with Setting(s):
            time.sleep(pause)  # (widens the window a second thread can enter)
            return (w * x).sum() * Setting.value

    return f


def _stack_f(w: torch.Tensor) -> Any:
    def f(x: torch.Tensor, s: float) -> torch.Tensor:
        with Pushed(s):
            time.sleep(0.0005)
            return (w * x).sum() * _STACK[-1].scale

    return f


def _level_f(w: torch.Tensor) -> Any:
    def f(x: torch.Tensor, s: float) -> torch.Tensor:
        with level(int(s)):
            time.sleep(0.0005)
            return (w * x).sum() * _LEVEL

    return f


def _loop(f: Any, w: torch.Tensor, items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    ys = torch.stack([f(*args) for args in items])
    (g,) = torch.autograd.grad(ys.sum(), w)
    return ys.detach(), g


def _mapped(run: Any, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = run()
    ys = torch.stack(out) if isinstance(out, list) else out
    (g,) = torch.autograd.grad(ys.sum(), w)
    return ys.detach(), g


def _forget(f: Any) -> None:
    """A fresh history for ``f``'s code (what a new process would have)."""
    from gradmap._placement import key_of
    from gradmap._torch import _shared

    for key in [k for k in _history if isinstance(k, tuple) and k[0] is key_of(f)]:
        del _history[key]
    _shared._warned.discard(key_of(f))


@pytest.mark.parametrize("make", [_setting_f, _stack_f, _level_f], ids=["class", "stack", "gen"])
def test_a_plain_pool_races_and_every_map_is_the_loops(make):
    w = _w()
    f = make(w)
    _forget(f)
    items = _items()
    want_y, want_g = _loop(f, w, items)
    xs, ss = zip(*items)

    # The race is real: a plain thread pool over the same f gives other values.
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        raced = False
        for _ in range(20):
            ys = torch.stack(list(pool.map(f, xs, ss))).detach()
            if not torch.equal(ys, want_y):
                raced = True
                break
    finally:
        pool.shutdown()
    assert raced, "the plain pool did not race: this test would not see a missed guard"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for run in [
            lambda: gradmap.tmap(f, xs, ss),
            lambda: gradmap.tmap(f, xs, ss, workers=2, chunksize=1),
            lambda: gradmap.tsum(f, xs, ss, workers=2, chunksize=1),
            lambda: gradmap.tmap(f, xs, ss, workers=2, chunksize=1, remat=True),
        ]:
            for _ in range(6):  # the race shows from the second call on
                y, g = _mapped(run, w)
                want = want_y if y.dim() else want_y.sum()
                torch.testing.assert_close(y, want, rtol=1e-12, atol=0)
                torch.testing.assert_close(g, want_g, rtol=1e-12, atol=0)
    said = [
        str(c.message) for c in caught if "every thread of this process shares" in str(c.message)
    ]
    assert len(said) == 1, said  # once per f
    assert "executor='processes'" in said[0]


def test_the_warning_names_the_state():
    w = _w()
    f = _setting_f(w, pause=0.0)
    _forget(f)
    xs, ss = zip(*_items(8))
    with pytest.warns(
        RuntimeWarning, match=r"'value' of the class .*Setting, changed by __enter__"
    ):
        gradmap.tmap(f, xs, ss)


def test_torch_process_wide_setters_count():
    w = _w()

    def f(x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        try:
            return (w * x).sum()
        finally:
            torch.set_default_dtype(torch.float32)

    _forget(f)
    xs = [torch.ones(4, dtype=F64) * i for i in range(8)]
    with pytest.warns(RuntimeWarning, match="set_default_dtype"):
        gradmap.tmap(f, xs)


def test_what_only_reads_or_keeps_to_its_thread_is_not_counted():
    """Grad mode, autocast, checkpoint, torch.func and a module's own attributes are per
    thread or per object: such an f keeps its forwards on the pool where placement finds it
    faster (no warning, nothing learnt)."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(4, 4).double()
    w = _w()

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = x.abs().max() + 1
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):
            h = checkpoint(lin, x, use_reentrant=False)
        params = dict(lin.named_parameters())
        h = h + torch.func.functional_call(lin, params, (x,))
        return (h * w).sum() / scale

    _forget(f)
    xs = [torch.randn(4, dtype=F64) for _ in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ys = gradmap.tmap(f, xs)
    torch.stack(ys).sum().backward()
    from gradmap._placement import key_of

    assert all(h.shared is None for k, h in _history.items() if k[0] is key_of(f))


def _same_every_call(f: Any, items: list[Any], params: list[torch.Tensor], calls: int = 4) -> None:
    def grads(ys: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
        y = torch.stack(ys).sum() if isinstance(ys, list) else ys
        return y.detach(), torch.autograd.grad(y, params, allow_unused=True)

    want_y, want_g = grads([f(x) for x in items])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in [
            lambda: gradmap.tmap(f, items),
            lambda: gradmap.tmap(f, items, workers=2, chunksize=1),
            lambda: gradmap.tsum(f, items, workers=2, chunksize=1),
        ]:
            for _ in range(calls):
                y, g = grads(run())
                torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-12)
                for a, b in zip(g, want_g):
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_pyro_handlers_on_threads():
    pyro = pytest.importorskip("pyro")
    import pyro.distributions as dist
    from pyro import poutine

    loc = torch.tensor(0.5, dtype=F64, requires_grad=True)

    def model(d: torch.Tensor) -> None:
        m = pyro.sample("m", dist.Normal(loc, 1.0))
        for j in range(3):
            pyro.sample(f"obs{j}", dist.Normal(m, 1.0), obs=d[j])

    def f(d: torch.Tensor) -> torch.Tensor:
        trace = poutine.trace(poutine.condition(model, {"m": d.mean()})).get_trace(d)
        return trace.log_prob_sum()

    torch.manual_seed(0)
    _same_every_call(f, [torch.randn(3, dtype=F64) * (i + 1) for i in range(24)], [loc])


def test_gpytorch_settings_on_threads():
    gpytorch = pytest.importorskip("gpytorch")
    w = _w()

    def f(x: torch.Tensor) -> torch.Tensor:
        with gpytorch.settings.max_cholesky_size(int(x[0].item() * 10)):
            time.sleep(0.0002)
            size = gpytorch.settings.max_cholesky_size.value()
        return (w * x).sum() * size

    _same_every_call(f, [torch.full((4,), 0.1 * i, dtype=F64) for i in range(16)], [w])


def test_botorch_posteriors_on_threads():
    pytest.importorskip("botorch")
    from botorch.acquisition import ExpectedImprovement
    from botorch.models import SingleTaskGP

    torch.manual_seed(0)
    train_x = torch.rand(12, 2, dtype=F64)
    train_y = train_x.sin().sum(-1, keepdim=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SingleTaskGP(train_x, train_y)
    model.eval()
    ei = ExpectedImprovement(model, best_f=train_y.max())

    def f(x: torch.Tensor) -> torch.Tensor:
        post = model.posterior(x.unsqueeze(0))
        return post.mean.sum() + post.variance.sum() + ei(x.unsqueeze(1)).sum()

    items = [torch.rand(3, 2, dtype=F64) for _ in range(16)]
    _same_every_call(f, items, list(model.parameters()), calls=3)
