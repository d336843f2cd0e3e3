"""The native boundary walk (``_torch/_native.cpp``) against the loop, on graphs whose shape
once fooled it."""

from __future__ import annotations

import contextlib
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
