"""Forward-mode AD and torch.func through tmap: the plain loop's tangents and gradients.

Under a torch.func transform or a forward-AD dual level, tmap runs as the plain loop in the
caller's thread (NOTE [torch.func and forward AD] in the rule), so these compare exactly.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD

import gradmap

W = torch.randn(3, 3)


def f(x):
    return torch.sin(x @ W).sum() * x.sum()


def mapped(xs):
    return torch.stack(gradmap.tmap(f, xs))


def looped(xs):
    return torch.stack([f(x) for x in xs])


def test_func_jvp_matches_loop():
    xs, v = torch.randn(5, 3), torch.randn(5, 3)
    y1, t1 = torch.func.jvp(mapped, (xs,), (v,))
    y2, t2 = torch.func.jvp(looped, (xs,), (v,))
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(t1, t2)


def test_dual_tensors_match_loop():
    xs, v = torch.randn(5, 3), torch.randn(5, 3)
    with fwAD.dual_level():
        t1 = fwAD.unpack_dual(mapped(fwAD.make_dual(xs, v))).tangent
        t2 = fwAD.unpack_dual(looped(fwAD.make_dual(xs, v))).tangent
    torch.testing.assert_close(t1, t2)


def test_func_grad_and_vjp_match_loop():
    xs = torch.randn(5, 3)
    torch.testing.assert_close(
        torch.func.grad(lambda a: mapped(a).sum())(xs),
        torch.func.grad(lambda a: looped(a).sum())(xs),
    )
    _, pull1 = torch.func.vjp(mapped, xs)
    _, pull2 = torch.func.vjp(looped, xs)
    u = torch.randn(5)
    torch.testing.assert_close(pull1(u)[0], pull2(u)[0])


def test_hessian_vector_product_via_double_backward():
    xs = torch.randn(4, 3, requires_grad=True)
    v = torch.randn(4, 3)

    def hvp(fn):
        (g,) = torch.autograd.grad(fn(xs).sum(), xs, create_graph=True)
        return torch.autograd.grad((g * v).sum(), xs)[0]

    torch.testing.assert_close(hvp(mapped), hvp(looped))
