"""The native boundary walk (``_torch/_native.cpp``) against the loop, on graphs whose shape
once fooled it."""

from __future__ import annotations

import contextlib
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
