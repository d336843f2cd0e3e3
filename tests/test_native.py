"""The native boundary walk (``_torch/_native.cpp``) against the loop, on graphs whose shape
once fooled it."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import sysconfig
from typing import Any

import pytest
import torch

import gradmap

import support


@pytest.mark.parametrize("walk", ["native", "python"])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_leaf_returned_by_several_elements_of_a_chunk(walk: str, executor: str) -> None:
    # A leaf holds its gradient accumulator weakly: while no graph holds it, each look makes a
    # new one. A fresh leaf returned as it is by several elements of one chunk once got one
    # boundary entry per element, and its gradient counted that many times, on its first map.
    if walk == "native" and not support.native_walk():
        pytest.skip("no native walk here")
    for _ in range(2):  # the first map of a fresh leaf, then one where the leaf is known
        w = torch.randn(3, requires_grad=True)
        xs = [torch.randn(3, requires_grad=True) for _ in range(4)]

        def f(x: torch.Tensor, w: torch.Tensor = w) -> tuple[torch.Tensor, torch.Tensor]:
            return w, (x * 2.0).sum()  # w itself, used by nothing else in the chunk

        def loss(ys: list[Any]) -> torch.Tensor:
            return torch.stack([(k + 1.0) * a.sum() + b for k, (a, b) in enumerate(ys)]).sum()

        want = torch.autograd.grad(loss([f(x) for x in xs]), [w, *xs])
        with support.python_walk() if walk == "python" else contextlib.nullcontext():
            got = torch.autograd.grad(
                loss(gradmap.tmap(f, xs, executor=executor, chunksize=4)), [w, *xs]
            )
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.skipif(
    not sysconfig.get_config_var("Py_GIL_DISABLED"), reason="needs a free-threaded CPython"
)
def test_maps_leave_the_gil_off_on_free_threaded_python() -> None:
    """Importing gradmap and mapping (which loads the native walk) keep the GIL off in a fresh
    interpreter started without PYTHON_GIL=0: an extension that does not declare it can run
    without the GIL turns it back on for the whole process."""
    if not support.native_walk():
        pytest.skip("no native walk here")
    code = (
        "import sys, torch, gradmap\n"
        "w = torch.ones(3, requires_grad=True)\n"
        "gradmap.tsum(lambda x: (w * x).sum(), [torch.ones(3)] * 8).backward()\n"
        "gradmap.tmap(lambda x: w * x, [torch.ones(3)] * 8, executor='serial')\n"
        "from gradmap._torch import _native\n"
        "assert _native.native() is not None, 'the native walk did not load'\n"
        "print('GIL', sys._is_gil_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "GIL False" in out.stdout, out.stderr


_REACHES_LEAVES = """
import torch
from gradmap._torch._native import native

walker = native()
assert walker is not None
sequence_nr = torch._C._autograd._get_sequence_nr
for _ in range(200):
    x = torch.randn(3, requires_grad=True)  # returned as it is, read by nothing
    w = torch.randn(3, requires_grad=True)
    lo = sequence_nr()
    y = w * 2.0
    _, _, inputs, _, _, _ = walker.walk([x, y, x], lo, sequence_nr())
    assert len(inputs) == 2 and inputs[0] is x and inputs[1] is w, inputs
    assert walker.reaches([x, x], [x]) == [True]
    assert walker.reaches([x], inputs) == [True, False]
    assert walker.reaches([y], inputs) == [False, True]
    assert walker.reaches([x, y, x], [w]) == [True]
print("answers right")
"""


def test_reaches_leaf_outputs_whose_accumulators_nothing_holds() -> None:
    # A leaf holds its gradient accumulator weakly: for a leaf no graph reads (one f returned as
    # it is), each look makes a new one. ``reaches`` (which boundary entries the outputs with
    # zero cotangents reach) let each accumulator it made go at once: the input's was another
    # than the output's (a miss), and a leaf among the outputs twice freed the accumulator of
    # the first while the walk still held its address (a segmentation fault). In a process of
    # its own, so that a crash fails this test alone.
    if not support.native_walk():
        pytest.skip("no native walk here")
    out = subprocess.run(
        [sys.executable, "-c", _REACHES_LEAVES], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-2000:]}"
    assert "answers right" in out.stdout


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("api", ["tsum", "tmap"])
@pytest.mark.parametrize("executor", ["serial", "threads", "processes"])
def test_leaves_returned_as_they_are_with_zero_cotangents(
    executor: str, api: str, remat: bool
) -> None:
    # f returns a leaf as it is, which nothing else in f reads (its item; or a tensor every
    # element returns), and the loss gives it a zero cotangent: the pullback asks ``reaches``
    # which boundary entries such outputs reach, and gives those zeros. It crashed on the
    # shared tensor (a segmentation fault, in a worker or the caller) and missed the item (a
    # gradient None where the loop gives zeros), on processes, where tsum's leaves are outputs.
    # Several maps in one process: what one map freed is taken by the next one's nodes.
    def loss(ys: Any) -> torch.Tensor:
        a, b = ys
        return a.sum() * 0.0 + b

    def own(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (w * w).sum() * (1.0 + x.detach().sum())

    def shared(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w, (x * 2.0).sum()

    for call in range(6):
        torch.manual_seed(call)
        w = torch.randn(3, dtype=torch.float64, requires_grad=True)
        xs = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(5)]
        f = functools.partial(shared if call % 2 == 0 else own, w=w)
        kwargs: dict[str, Any] = {"executor": executor, "remat": remat, "chunksize": 2}
        if api == "tsum":
            ref = [f(x) for x in xs]
            want_root = loss((sum(a for a, _ in ref), sum(b for _, b in ref)))
            got_root = loss(gradmap.tsum(f, xs, **kwargs))
        else:
            want_root = sum(loss(f(x)) for x in xs)
            got_root = sum(loss(y) for y in gradmap.tmap(f, xs, **kwargs))
        want = torch.autograd.grad(want_root, [w, *xs], allow_unused=True)
        got = torch.autograd.grad(got_root, [w, *xs], allow_unused=True)
        for k, (a, b) in enumerate(zip(got, want)):
            assert (a is None) == (b is None), f"map {call}, tensor {k}: {a} against {b}"
            if b is not None:
                torch.testing.assert_close(a, b)
