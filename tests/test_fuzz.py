"""A differential test: random programs from a seed, run by the plain loop and by gradmap.

Each case draws a program -- parameters, tensors made before the call (read through closures,
globals, module attributes and methods), items (leaves, rows cut from a tensor, constants), an
``f`` (a closure, an ``nn.Module``, a callable object, a ``functools.partial``) whose body mixes
ordinary ops, a custom ``autograd.Function``, in-place writes into a buffer ``f`` made, a leaf
``f`` makes for itself and differentiates inside (forces), control flow per element and
zero-weighted results -- and a way to use the map (``tmap`` or ``tsum``,
executor, chunks, ``remat``, ``.backward()`` or ``autograd.grad`` on a subset, a double backward).
The loop and gradmap run the same program on fresh copies of the same values; values, gradients
and which gradients are ``None`` must agree (float64, up to summation order).

Some programs raise, in the forward or in the backward of the elements whose item sums past a
drawn threshold (each with a type of its own): gradmap must raise the loop's error, the same
type and message, or none where the loop raises none (a backward that needs no such element).

A few seconds in CI; ``GRADMAP_FUZZ=N`` runs N cases per executor (a quarter of that on
processes, or the share ``GRADMAP_FUZZ_PROCESSES``): ``GRADMAP_FUZZ=2000 pytest -m fuzz``.
``GRADMAP_FUZZ_CASE=K`` runs only case K of each executor's sequence (to replay one),
``GRADMAP_FUZZ_ERRORS=P`` draws raising programs with probability P (0.3), and
``GRADMAP_FUZZ_REMAT`` sets the share of cases with ``remat`` (0.3).
"""

from __future__ import annotations

import functools
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle
import pytest
import torch
from torch import nn

import gradmap

from support import native_walk

pytestmark = pytest.mark.usefixtures("both_walks")

F64 = torch.float64
CASES = int(os.environ.get("GRADMAP_FUZZ", "40"))
PROCESSES_SHARE = float(os.environ.get("GRADMAP_FUZZ_PROCESSES", "0.25"))
ONLY_CASE = os.environ.get("GRADMAP_FUZZ_CASE")
ERRORS = float(os.environ.get("GRADMAP_FUZZ_ERRORS", "0.3"))
REMAT = float(os.environ.get("GRADMAP_FUZZ_REMAT", "0.3"))
EXECUTORS = ["serial", "threads", "processes"]

#: Globals the drawn programs read (a method reading a global is a case of its own).
GLOBALS: dict[str, Any] = {}


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g * 2 * x * w, (g * x * x).sum_to_size(w.shape)


class Clip(torch.autograd.Function):
    """The identity, whose backward clips the gradient: user code in the backward that is not
    linear in its cotangent (NOTE [chunks whose backward is user code])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.clamp(-0.05, 0.05) + 0.01


#: The exceptions the raising programs raise, by the element's draw.
DRAWN_ERRORS = (IndexError, ValueError, KeyError)


def _drawn_error(total: float, where: str) -> Exception:
    """The error of the element whose item sums to ``total``: its type and message from the sum
    (the same bits in the loop and in gradmap)."""
    kind = DRAWN_ERRORS[int(abs(total) * 1000) % len(DRAWN_ERRORS)]
    return kind(f"drawn failure in the {where} of the element of sum {total:.12f}")


class RaiseInBackward(torch.autograd.Function):
    """The identity, whose backward raises the element's drawn error (made there: an exception
    kept on ``ctx`` would hold its traceback's frames, and they the graph, in a cycle through the
    graph's nodes that no collection breaks)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.total = float(x.detach().sum())
        return h.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        raise _drawn_error(ctx.total, "backward")


def _clip_hook(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.05, 0.05) - 0.01


class World:
    """The tensors one run of a program sees, made afresh from a seed (so the loop and gradmap
    get equal values in separate tensors)."""

    def __init__(self, seed: int, program: dict[str, Any]) -> None:
        g = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=F64)

        self.params = [randn(3).requires_grad_() for _ in range(program["n_params"])]
        self.unused = randn(3).requires_grad_()  # never used by f: None in both
        p0 = self.params[0]
        pre = program["pre"]
        self.pre = None
        if pre == "affine":
            self.pre = p0 * 2 + 1
        elif pre == "tanh":
            self.pre = torch.tanh(p0 * 1.5)
        elif pre == "chain":
            self.pre = (p0 * self.params[-1]).exp() * 0.5
        if self.pre is not None and program["use"] == "backward":
            self.pre.retain_grad()  # its .grad: once, the summed gradient, as in the loop
        n, rows = program["n"], program["rows"]
        kinds = program["items"]
        self.source = randn(n, 3).requires_grad_() if kinds == "rows" else None
        self.items: list[Any] = []
        for i in range(n):
            if kinds == "rows":
                assert self.source is not None
                self.items.append(self.source[i].unsqueeze(0) * 1.0)
            else:
                x = randn(rows[i], 3)
                if kinds == "leaves" or (kinds == "mixed" and i % 2 == 0):
                    x.requires_grad_()
                self.items.append(x)

    def wrt(self) -> list[torch.Tensor]:
        leaves = [*self.params, self.unused]
        if self.source is not None:
            leaves.append(self.source)
        leaves += [
            x for x in self.items if isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad
        ]
        if self.pre is not None:
            leaves.append(self.pre)
        return leaves


def _row_loss(p: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return (row * p).sum()


def body(
    program: dict[str, Any], params: list[torch.Tensor], pre: torch.Tensor | None, x: torch.Tensor
) -> Any:
    """The drawn element function, given what it reads."""
    p0 = params[0]
    fail = program.get("fail")
    failing = fail is not None and float(x.detach().sum()) > fail["above"]
    if failing and fail["where"] == "forward":
        raise _drawn_error(float(x.detach().sum()), "forward")
    h = torch.tanh(x * p0)  # (rows, 3)
    for op in program["ops"]:
        if op == "pre" and pre is not None:
            h = h * pre
        elif op == "param":
            h = h + params[-1] * h.sin()
        elif op == "custom":
            h = Square.apply(h, params[len(params) // 2])
        elif op == "buffer":
            buf = torch.zeros(h.shape[0] + 1, 3, dtype=F64)
            buf[1:] = h * 0.5
            buf[0] = p0
            h = buf[1:] + buf[0]
        elif op == "branch":
            h = h * 2 if float(x.detach().sum()) > 0 else h.cos() * p0
        elif op == "nested":  # a map inside f, over the rows of a tensor the element made
            row_loss = functools.partial(_row_loss, params[-1])
            if program["mapped"]:
                rows = gradmap.tmap(row_loss, h, executor="threads", chunksize=1)
            else:
                rows = [row_loss(r) for r in h]
            h = h + torch.stack(rows).unsqueeze(1)
        elif op == "matmul":
            h = h @ torch.outer(params[-1], p0) * 0.1
        elif op == "own-leaf":  # forces: a leaf f makes from a copy, differentiated inside
            pos = x.detach().clone().requires_grad_()
            energy = (torch.sin(pos) * p0).sum()
            h = h + 0.5 * torch.autograd.grad(energy, pos, create_graph=True)[0]
        elif op == "clip":
            h = Clip.apply(h)
        elif op == "hook" and h.requires_grad:
            h = h * 1.0
            h.register_hook(_clip_hook)
    if failing and fail["where"] == "backward" and h.requires_grad:
        h = RaiseInBackward.apply(h, x)
    loss = (h * h).mean()
    out = program["out"]
    if out == "scalar":
        return loss
    if out == "pair":
        return loss, (h * p0).sum()
    if out == "vector":
        return h.sum(0)
    if out == "maybe":  # requires grad for some elements only
        return loss if float(x.detach().sum()) > -0.5 else loss.detach()
    raise AssertionError(out)


class Net(nn.Module):
    def __init__(self, program: dict[str, Any], params: list[torch.Tensor], pre: Any) -> None:
        super().__init__()
        self.program = program
        self.ps = nn.ParameterList()
        self._params = params
        self.pre = pre

    def forward(self, x: torch.Tensor) -> Any:
        return body(self.program, self._params, self.pre, x)


class ReadsGlobal(nn.Module):
    """Reads what it needs from a module global, inside its method."""

    def __init__(self, program: dict[str, Any]) -> None:
        super().__init__()
        self.program = program

    def forward(self, x: torch.Tensor) -> Any:
        return body(self.program, GLOBALS["params"], GLOBALS["pre"], x)


class Callable_:
    def __init__(self, program: dict[str, Any], params: list[torch.Tensor], pre: Any) -> None:
        self.program, self.params, self.pre = program, params, pre

    def __call__(self, x: torch.Tensor) -> Any:
        return body(self.program, self.params, self.pre, x)


def make_f(program: dict[str, Any], world: World) -> Callable[..., Any]:
    kind = program["f"]
    params, pre = world.params, world.pre
    if kind == "closure":
        return lambda x: body(program, params, pre, x)
    if kind == "module":
        return Net(program, params, pre)
    if kind == "global-method":
        GLOBALS["params"], GLOBALS["pre"] = params, pre
        return ReadsGlobal(program)
    if kind == "callable":
        return Callable_(program, params, pre)
    if kind == "partial":
        return functools.partial(body, program, params, pre)
    raise AssertionError(kind)


def draw(rng: random.Random, executor: str) -> dict[str, Any]:
    n = rng.randint(1, 7)
    program: dict[str, Any] = {
        "n": n,
        "rows": [rng.randint(1, 3) for _ in range(n)],
        "n_params": rng.randint(1, 3),
        "pre": rng.choice([None, "affine", "tanh", "chain"]),
        "items": rng.choice(["leaves", "constants", "mixed", "rows"]),
        # (The Python walk sees no tensor hooks, and runs a custom Function past a chunk's
        # non-leaf boundary -- a nested map over rows f made -- with zeros: NOTE [chunks whose
        # backward is user code])
        "ops": rng.sample(
            ["pre", "param", "custom", "buffer", "branch", "matmul", "nested", "own-leaf"]
            + (["hook", "clip"] if native_walk() else []),
            rng.randint(1, 5),
        ),
        "out": rng.choice(["scalar", "scalar", "pair", "vector", "maybe"]),
        "f": rng.choice(["closure", "module", "global-method", "callable", "partial"]),
        "api": rng.choice(["tmap", "tsum"]),
        "remat": rng.random() < REMAT,
        "chunksize": rng.choice([None, 1, 2, 3]),
        "use": rng.choice(["backward", "grad", "grad-subset", "zero-weights"]),
        "double": executor != "processes" and rng.random() < 0.2,
        "executor": executor,
    }
    if program["f"] == "global-method" and executor == "processes":
        program["f"] = "module"  # a worker's globals are its own (docs/executors.md: what f sees)
    return program


def reduce(program: dict[str, Any], results: Any, n: int) -> torch.Tensor:
    """The scalar the backward starts from: the map's results weighted per element (zero weights
    for some elements when ``use == 'zero-weights'``)."""
    weights = [
        0.0 if program["use"] == "zero-weights" and i % 2 == 0 else 1.0 + 0.1 * i for i in range(n)
    ]
    if program["api"] == "tsum":
        leaves = results if isinstance(results, tuple) else (results,)
        return sum((leaf * (1.0 + k)).sum() for k, leaf in enumerate(leaves))  # type: ignore[return-value]
    total = torch.zeros((), dtype=F64)
    for w, y in zip(weights, results):
        leaves = y if isinstance(y, tuple) else (y,)
        for k, leaf in enumerate(leaves):
            total = total + w * (1.0 + k) * leaf.sum()
    return total


def run(program: dict[str, Any], seed: int, mapped: bool) -> tuple[list[Any], list[Any]]:
    """The program's values and gradients, by the loop (``mapped=False``) or by gradmap."""
    program["mapped"] = mapped
    world = World(seed, program)
    f = make_f(program, world)
    n = program["n"]
    items = world.items
    if mapped:
        kwargs = {
            "executor": program["executor"],
            "chunksize": program["chunksize"],
            "remat": program["remat"],
        }
        if program["api"] == "tsum":
            results = gradmap.tsum(f, items, **kwargs)
        else:
            results = gradmap.tmap(f, items, **kwargs)
    else:
        each = [f(x) for x in items]
        if program["api"] == "tsum":
            results = each[0]
            for y in each[1:]:
                results = (
                    tuple(a + b for a, b in zip(results, y))
                    if isinstance(y, tuple)
                    else results + y
                )
        else:
            results = each
    root = reduce(program, results, n)
    wrt = world.wrt()
    use = program["use"]
    values = [root.detach()]
    if program["double"]:
        firsts = torch.autograd.grad(root, wrt, create_graph=True, allow_unused=True)
        second = sum((g * g).sum() for g in firsts if g is not None and g.requires_grad)
        grads: list[Any] = [None if g is None else g.detach() for g in firsts]
        if isinstance(second, torch.Tensor):
            grads += list(torch.autograd.grad(second, world.params, allow_unused=True))
        return values, grads
    if use == "grad-subset":
        subset = wrt[::2]
        return values, list(torch.autograd.grad(root, subset, allow_unused=True))
    if use == "grad":
        return values, list(torch.autograd.grad(root, wrt, allow_unused=True))
    root.backward()
    return values, [t.grad for t in wrt]


def _compare(a: list[Any], b: list[Any], what: str) -> None:
    assert len(a) == len(b), what
    for k, (x, y) in enumerate(zip(a, b)):
        name = f"{what} {k}"
        assert (x is None) == (y is None), (
            f"{name}: None in {'gradmap' if x is None else 'the loop'}"
        )
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12, msg=f"{name} differs")


@pytest.mark.fuzz
@pytest.mark.parametrize("executor", EXECUTORS)
def test_random_programs_give_the_loops_values_and_gradients(executor: str) -> None:
    if executor == "processes":  # the workers cannot import this test module
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rng = random.Random(f"gradmap-fuzz-{executor}")
    cases = max(1, int(CASES * PROCESSES_SHARE)) if executor == "processes" else CASES
    for case in range(cases):
        program = draw(rng, executor)
        seed = rng.randrange(1 << 30)
        # (drawn apart, so that the other programs are drawn as ever)
        errors = random.Random(f"{seed}-errors")
        if errors.random() < ERRORS:
            where = errors.choice(["forward", "backward"])
            program["fail"] = {"where": where, "above": errors.uniform(0.0, 3.0)}
        if ONLY_CASE is not None and case != int(ONLY_CASE):
            continue
        want_error: Exception | None = None
        try:
            want_values, want_grads = run(program, seed, mapped=False)
        except DRAWN_ERRORS as exc:
            want_error = exc
        except RuntimeError:
            continue  # the loop itself refuses the program (as gradmap then may too)
        try:
            try:
                got_values, got_grads = run(program, seed, mapped=True)
            except RuntimeError as exc:
                if not native_walk() and "Python walk cannot find it" in str(exc):
                    continue  # the fallback walk says it cannot, and stops: never a guess
                raise
            except DRAWN_ERRORS as exc:
                if want_error is None and not native_walk() and "backward" in str(exc):
                    # The Python walk cannot tell which inputs a backward needs, and pulls
                    # back every element (``_graph.needed``).
                    continue
                if want_error is None:
                    raise
                assert (type(exc), str(exc)) == (type(want_error), str(want_error)), (
                    f"gradmap raised {exc!r}, the loop {want_error!r}"
                )
                continue
            assert want_error is None, f"gradmap raised nothing, the loop {want_error!r}"
            _compare(got_values, want_values, "value")
            _compare(got_grads, want_grads, "gradient")
        except BaseException as exc:
            raise AssertionError(
                f"case {case} differs from the loop: {program} (seed {seed})"
            ) from exc
