"""On a machine with many cores, a default (threads) map whose forward placement keeps in one
thread, because the GIL holds it, says once per ``f`` that processes would use the other cores
(NOTE [telling of processes] in ``_placement``). Nothing is timed: the cores and the measured
placement are set by the test."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import gradmap
from gradmap import _executors, _placement
from gradmap._placement import EXPLORE

GIL_ONLY = pytest.mark.skipif(
    not getattr(sys, "_is_gil_enabled", lambda: True)(),
    reason="placement measures only with the GIL",
)
pytestmark = GIL_ONLY

CALLS = 2 + EXPLORE + 3  # the first call, the measuring turns, then chosen calls


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Placement measured the pool no faster than one thread, on a 16-core process."""
    monkeypatch.setattr(_placement._History, "parallel", property(lambda self: False))
    monkeypatch.setattr(_executors, "available_cores", lambda: 16)
    monkeypatch.setattr(_placement, "_told", set())
    monkeypatch.setattr(_placement, "_history", {})


def _maps(f, xs, calls=CALLS, **kwargs):
    """``calls`` maps of ``f``; the warnings they gave, and the last map's gradient."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            x = xs.detach().requires_grad_()
            torch.stack(gradmap.tmap(f, x, **kwargs)).sum().backward()
    told = [w for w in caught if "held by the GIL" in str(w.message)]
    return told, x.grad


def _double(x):
    return (x * 2).sin()


def test_a_forward_held_by_the_gil_on_many_cores_is_told_of_processes_once(held):
    xs = torch.randn(8, dtype=torch.float64)
    told, grad = _maps(_double, xs)
    assert len(told) == 1
    (w,) = told
    assert w.category is RuntimeWarning
    assert w.filename == __file__  # the user's line, not gradmap's
    message = str(w.message)
    assert message.startswith("gradmap.tmap: f's forward is held by the GIL")
    assert "16 cores" in message and "executor='processes'" in message
    assert "gradmap.compare(f, items)" in message and "\n" not in message
    # the map itself is unchanged: still the loop's gradient, on threads
    x = xs.detach().requires_grad_()
    torch.stack([_double(e) for e in x]).sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)

    # another f is told too, once; tsum names itself
    def other(x):
        return x**3

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(CALLS):
            gradmap.tsum(other, xs.detach().requires_grad_()).backward()
    told = [w for w in caught if "held by the GIL" in str(w.message)]
    assert len(told) == 1 and str(told[0].message).startswith("gradmap.tsum:")


def test_four_cores_or_a_parallel_forward_or_a_chosen_executor_are_not_told(held, monkeypatch):
    xs = torch.randn(8, dtype=torch.float64)

    def f(x):
        return x * 3

    # a chosen executor or worker count: the user chose already
    assert not _maps(f, xs, executor="threads", workers=2)[0]
    assert not _maps(f, xs, executor="serial")[0]
    # four cores: processes would add little
    monkeypatch.setattr(_executors, "available_cores", lambda: 4)
    assert not _maps(f, xs)[0]
    # a forward faster on the pool runs there
    monkeypatch.setattr(_executors, "available_cores", lambda: 16)
    monkeypatch.setattr(_placement._History, "parallel", property(lambda self: True))
    assert not _maps(f, xs)[0]
    # nothing is told before placement has chosen: a new f's first call and measuring turns
    monkeypatch.setattr(_placement._History, "parallel", property(lambda self: False))

    def g(x):
        return x * 4

    def sums(calls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(calls):
                gradmap.tsum(g, xs.detach().requires_grad_()).backward()
        return [w for w in caught if "held by the GIL" in str(w.message)]

    assert not sums(1 + EXPLORE)
    assert len(sums(1)) == 1
