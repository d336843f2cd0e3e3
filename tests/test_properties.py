"""Property tests: random lengths, item and result pytrees, losses, executors and chunk sizes.

For every draw, ``gradmap.tmap`` must give the plain loop's results (same structure, same
non-tensor objects, equal values) and the loop's gradients to items and captured tensors.
"""

from __future__ import annotations

import concurrent.futures
import math
import random
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradmap

Tensor = torch.Tensor
Pair = namedtuple("Pair", ["first", "second"])

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)
_STRING = "label"  # a non-tensor leaf: must come back as this very object

# -- pytree shapes: a spec is a leaf kind or (container, children) ---------------------------------


def _trees(leaves: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, min_size=1, max_size=3).map(lambda c: ("tuple", c)),
            st.lists(children, min_size=0, max_size=3).map(lambda c: ("list", c)),
            st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3).map(
                lambda d: ("dict", d)
            ),
            st.tuples(children, children).map(lambda c: ("pair", list(c))),
        ),
        max_leaves=4,
    )


ITEM_LEAVES = st.sampled_from(["grad", "grad", "nograd", "int", "str", "none"])
RESULT_LEAVES = st.sampled_from(
    ["fn", "fn", "fn", "captured", "item", "int_tensor", "const", "int", "str", "none"]
)


def _build(spec: Any, leaf: Callable[[str, int], Any], counter: list[int]) -> Any:
    if isinstance(spec, str):
        counter[0] += 1
        return leaf(spec, counter[0])
    kind, children = spec
    if kind == "dict":
        return {k: _build(v, leaf, counter) for k, v in children.items()}
    built = [_build(c, leaf, counter) for c in children]
    return {"tuple": tuple, "list": list, "pair": lambda b: Pair(*b)}[kind](built)


def _make_item(kind: str, j: int) -> Any:
    if kind in ("grad", "nograd"):
        return torch.randn(3, requires_grad=kind == "grad")
    return {"int": j, "str": _STRING, "none": None}[kind]


def _make_f(result_spec: Any, w: Tensor, lin: torch.nn.Linear, const: Tensor):
    def f(*items: Any) -> Any:
        tensors = [t for t in pytree.tree_leaves(items) if isinstance(t, Tensor)]
        base = torch.zeros(3)
        for t in tensors:
            base = base + t.sin()

        def leaf(kind: str, j: int) -> Any:
            if kind == "fn":
                return (lin(base * w + j) * (j + 1)).tanh().sum(0, keepdim=True) + base.sum()
            if kind == "captured":
                return w
            if kind == "item":
                return tensors[0] if tensors else base * w
            if kind == "int_tensor":
                return torch.tensor([j, 2 * j])
            if kind == "const":
                return const
            return {"int": j, "str": _STRING, "none": None}[kind]

        return _build(result_spec, leaf, [0])

    return f


def _executor_kwargs(name: str, chunksize: int | None) -> dict[str, Any]:
    if name == "serial":
        return {"executor": "serial", "chunksize": chunksize}
    if name == "user-pool":
        return {"executor": _POOL, "chunksize": chunksize}
    if name == "threads":
        return {"executor": "threads", "chunksize": chunksize}
    return {"workers": int(name.split("-")[1]), "chunksize": chunksize}


def _float_leaves(results: list[Any]) -> list[Tensor]:
    return [
        leaf
        for r in results
        for leaf in pytree.tree_leaves(r)
        if isinstance(leaf, Tensor) and leaf.is_floating_point()
    ]


def _run(
    seed: int,
    n: int,
    arity: int,
    item_spec: Any,
    result_spec: Any,
    as_tensor: bool,
    mapper: Callable[..., list[Any]],
    loss_seed: int,
    p_use: float,
    mode: str,
) -> tuple[list[Any], list[Tensor | None]]:
    torch.manual_seed(seed)
    w = torch.randn(3, requires_grad=True)
    lin = torch.nn.Linear(3, 2)
    const = torch.ones(2)
    iterables: list[Any] = [
        [_build(item_spec, _make_item, [0]) for _ in range(n + k)] for k in range(arity)
    ]
    if as_tensor:  # the first iterable is one tensor, mapped over its rows
        iterables[0] = torch.randn(n, 3, requires_grad=True)
    wrt = [w, *lin.parameters()]
    for it in iterables:
        leaves = pytree.tree_leaves(it) if isinstance(it, list) else [it]
        wrt += [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]
    results = mapper(_make_f(result_spec, w, lin, const), *iterables)
    floats = _float_leaves(results)
    rng = random.Random(loss_seed)  # the same subset and weights for the loop and tmap
    terms = [(w * 0.5).sum()]  # never an empty loss
    for t in floats:
        keep, weight = rng.random() < p_use, rng.choice([1.0, -2.0, 0.5, 3.0])
        if keep and t.requires_grad:
            terms.append(weight * t.sum())
    loss = torch.stack(terms).sum()
    if mode == "grad":
        grads = list(torch.autograd.grad(loss, wrt, allow_unused=True))
    else:
        for t in wrt:
            t.grad = None
        loss.backward()
        grads = [t.grad for t in wrt]
    return results, grads


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(0, 30),
    arity=st.integers(1, 2),
    item_spec=_trees(ITEM_LEAVES),
    result_spec=_trees(RESULT_LEAVES),
    as_tensor=st.booleans(),
    executor=st.sampled_from(["serial", "threads", "workers-1", "workers-3", "user-pool"]),
    chunksize=st.one_of(st.none(), st.integers(1, 8)),
    mode=st.sampled_from(["backward", "grad"]),
    loss_seed=st.integers(0, 2**16),
    p_use=st.sampled_from([1.0, 0.6, 0.2, 0.0]),
)
def test_results_and_gradients_equal_loop(
    seed, n, arity, item_spec, result_spec, as_tensor, executor, chunksize, mode, loss_seed, p_use
):
    """Random pytrees, lengths 0-30, losses over random subsets of the results, any executor."""
    kwargs = _executor_kwargs(executor, chunksize)
    args = (seed, n, arity, item_spec, result_spec, as_tensor)
    ref_results, ref_grads = _run(
        *args, lambda f, *its: [f(*a) for a in zip(*its, strict=False)], loss_seed, p_use, mode
    )
    results, grads = _run(
        *args, lambda f, *its: gradmap.tmap(f, *its, **kwargs), loss_seed, p_use, mode
    )

    assert isinstance(results, list) and len(results) == len(ref_results)
    for r, e in zip(results, ref_results, strict=True):
        leaves_r, spec_r = pytree.tree_flatten(r)
        leaves_e, spec_e = pytree.tree_flatten(e)
        assert spec_r == spec_e
        for a, b in zip(leaves_r, leaves_e, strict=True):
            if isinstance(b, Tensor):
                assert isinstance(a, Tensor) and a.dtype == b.dtype
                assert a.requires_grad == b.requires_grad
                torch.testing.assert_close(a.detach(), b.detach())
            else:
                assert a is b or (isinstance(b, int) and a == b)
    assert len(grads) == len(ref_grads)
    for i, (g, e) in enumerate(zip(grads, ref_grads, strict=True)):
        if e is None:
            assert g is None, f"gradient {i}: the loop has None"
        else:
            assert g is not None, f"gradient {i}: tmap has None"
            torch.testing.assert_close(g, e, atol=1e-5 * max(1.0, math.sqrt(n)), rtol=1e-5)
