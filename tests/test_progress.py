"""Progress bars: one for the forward and one for the backward, counting elements."""

from __future__ import annotations

import contextlib
import functools
import io
import sys

import pytest
import torch

import gradmap


def _map_and_backward(**kwargs):
    w = torch.randn(3, requires_grad=True)
    ys = gradmap.tmap(lambda x: (x * w).sum(), torch.randn(40, 3), chunksize=4, **kwargs)
    torch.stack(ys).sum().backward()
    return w


def test_progress_true_draws_forward_and_backward_bars(capsys):
    _map_and_backward(progress=True)
    err = capsys.readouterr().err
    assert "gradmap forward" in err and "gradmap backward" in err
    assert "40/40" in err


def test_progress_callable_makes_one_bar_per_pass():
    buf = io.StringIO()
    import tqdm

    _map_and_backward(progress=functools.partial(tqdm.tqdm, file=buf, mininterval=0))
    out = buf.getvalue()
    assert "gradmap forward: 100%" in out and "gradmap backward: 100%" in out


class Counter:
    def __init__(self):
        self.calls: list[int] = []

    def update(self, n):
        self.calls.append(n)

    def close(self):
        pass


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_progress_instance_counts_every_element_once_per_pass(executor):
    bar = Counter()
    _map_and_backward(progress=bar, executor=executor)
    assert sum(bar.calls) == 80  # 40 forward + 40 backward
    assert len(bar.calls) == 20  # once per chunk: 10 chunks per pass


@pytest.mark.parametrize("api", ["tmap", "tsum", "tmap, one result"])
@pytest.mark.parametrize("executor", ["serial", "threads", "processes"])
def test_every_backward_bar_ends_full(executor, api):
    """A tsum's chunks pulled back in its forward, and elements a backward has nothing to pull
    back for, count as done: the bar ends at every element (on processes it stayed at 0 for a
    tsum, and at one element for the backward of one result)."""
    forward, backward = Counter(), Counter()
    bars = iter([forward, backward])
    w = torch.randn(3, requires_grad=True)
    xs = torch.randn(12, 3)
    # (Processes: workers of their own, stopped after: no worker outlives the test.)
    own = gradmap.ProcessExecutor(workers=2) if executor == "processes" else None
    with own or contextlib.nullcontext():
        kwargs = {"chunksize": 4, "executor": own or executor, "progress": lambda **_: next(bars)}
        if api == "tsum":
            gradmap.tsum(lambda x: (x * w).sum(), xs, **kwargs).backward()
        else:
            ys = gradmap.tmap(lambda x: (x * w).sum(), xs, **kwargs)
            (ys[5] if api == "tmap, one result" else torch.stack(ys).sum()).backward()
    assert sum(forward.calls) == 12 and sum(backward.calls) == 12


def test_no_output_without_progress(capsys):
    _map_and_backward()
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_missing_tqdm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r"pip install 'gradmap\[progress\]'"):
        _map_and_backward(progress=True)


def test_bad_progress_type():
    with pytest.raises(TypeError, match="progress must be"):
        _map_and_backward(progress=3)
