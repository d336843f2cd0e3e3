"""The rule under reverse mode: forward in chunks, one join node, per-chunk pullbacks, a sum.

NOTE [the join node]:
    As in the torch adapter (``gradmap/_torch/_rule.py``): the chunks run first, on the
    executor, each element traced and run on concrete primals under ``jax.vjp`` (NOTE [hoisting
    the tracers an element uses] in ``_element``). Only then are the join's inputs known: every
    tracer of the caller's trace that any element used, items and closed-over arrays alike, each
    once (by identity). The join is a ``jax.custom_vjp`` function of those tracers whose forward
    hands out the outputs the chunks already computed, so the caller's trace sees the whole map
    as one node, with one residual-free custom rule; a map that used no tracer needs no join.

    The join's backward splits the output cotangents by chunk and runs each chunk's pullback on
    the executor: the element pullbacks of the chunk, in element order, each adding its
    cotangents to the chunk's running totals (inside the element's compiled pullback, where it
    has one: an eager addition costs about as much as the pullback). The caller then adds the
    chunks' totals in chunk order, in one compiled call. Chunks depend on the element count only
    (``_plan``), so the gradient of a shared array is bitwise the same for any number of
    workers. Elements whose output cotangents are all symbolic zeros (outputs the loss does not
    use) do no backward work.

    The pullbacks are kept as long as the join's backward is: a ``vjp`` function may be called
    again, and ``jax.jacrev`` calls it under ``vmap``. Cotangents that are tracers (``vmap``,
    ``jit`` of the ``vjp`` function) cannot go to the workers; the pullbacks then run in the
    caller's thread, in element order, under the caller's trace.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .._engine import ChunkRun, run_chunks
from .._errors import add_note, element_note
from .._executors import Executor
from .._plan import ChunkPlan
from ._chunks import JAX_API, Pending, chunk_elements
from ._config import JaxConfig
from ._element import UNTRACEABLE, Element, ElementRunner
from ._mode import VjpTrace, top_level

__all__ = ["map_vjp"]


class _NeedsLoop(Exception):
    """An element could not be traced (a branch on an array's value): run the plain loop."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index)
        self.index = index
        self.error = error


@dataclass(eq=False)
class _Chunk:
    """What a chunk's forward leaves for its backward."""

    indices: list[int]
    elements: list[Element] = field(default_factory=list)
    outputs: tuple[int, int] = (0, 0)  # its range among the join's outputs
    positions: list[list[int]] = field(default_factory=list)  # per element: join input indices


def map_vjp(
    f: Callable[..., Any],
    elements: list[tuple[Any, ...]],
    executor: Executor,
    plan: ChunkPlan,
    trace: VjpTrace,
    loop: Callable[[], list[Any]],
) -> list[Any]:
    """``[f(*args) for args in elements]`` under the caller's reverse-mode trace, with the forward
    and each chunk's pullback on ``executor``.

    Arguments:
        f: the function.
        elements: the argument tuples, one per element.
        executor: where chunks run.
        plan: the chunk plan for ``len(elements)``.
        trace: the caller's reverse-mode trace.
        loop: the plain loop, run instead when an element cannot be traced.

    Returns:
        The results, in element order.
    """
    n = len(elements)
    config = JaxConfig()
    runner = ElementRunner(f, trace)

    def forward_chunk(k: int, run: ChunkRun[_Chunk]) -> _Chunk:
        chunk = _Chunk([])
        pending = Pending(n, "forward")
        with top_level():  # the caller's thread too, when it helps
            for i in chunk_elements(run, k, plan):
                chunk.indices.append(i)
                try:
                    chunk.elements.append(runner.run(elements[i]))
                except UNTRACEABLE as exc:
                    raise _NeedsLoop(i, exc) from None
                except BaseException as exc:
                    add_note(exc, element_note(i, n, "forward", JAX_API))
                    raise
                pending.push(i, chunk.elements[-1].leaves)
            pending.wait()
        return chunk

    try:
        chunks = run_chunks(executor, plan.count, forward_chunk, context=config.enter)
    except _NeedsLoop as need:
        warnings.warn(
            f"gradmap.jax.tmap: element {need.index} of {n} could not be traced "
            f"({type(need.error).__name__}: f branches on an array's value), so the map ran "
            "as the plain loop in the caller's thread. To run it in parallel under "
            "differentiation, make f traceable (jnp.where, lax.cond) or pass such values as "
            "Python scalars.",
            RuntimeWarning,
            stacklevel=3,
        )
        return loop()

    inputs: list[Any] = []
    index: dict[int, int] = {}
    outputs: list[Any] = []
    for chunk in chunks:
        lo = len(outputs)
        for el in chunk.elements:
            positions = []
            for t in el.tracers:
                p = index.get(id(t))
                if p is None:
                    p = index[id(t)] = len(inputs)
                    inputs.append(t)
                positions.append(p)
            chunk.positions.append(positions)
            outputs.extend(el.leaves[i] for i in el.diff)
        chunk.outputs = (lo, len(outputs))
    if not outputs:
        return [el.result() for chunk in chunks for el in chunk.elements]

    join = _make_join(chunks, inputs, outputs, executor, n)
    joined = iter(join(*inputs))
    results = []
    for chunk in chunks:
        for el in chunk.elements:
            leaves = list(el.leaves)
            for i in el.diff:
                leaves[i] = next(joined)
            results.append(el.result(leaves))
    return results


def _make_join(
    chunks: list[_Chunk],
    inputs: list[Any],
    outputs: list[Any],
    executor: Executor,
    n: int,
) -> Callable[..., tuple[Any, ...]]:
    """The join node: ``inputs`` (the hoisted tracers) to ``outputs`` (computed already)."""
    values = tuple(outputs)
    avals = [(t.shape, t.dtype) for t in inputs]

    @jax.custom_vjp
    def join(*primals: Any) -> tuple[Any, ...]:
        return values

    def join_fwd(*primals: Any) -> tuple[tuple[Any, ...], None]:
        return values, None

    def join_bwd(residuals: None, cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        live = [c for c in cotangents if not isinstance(c, SymbolicZero)]
        on_workers = not any(isinstance(c, jax.core.Tracer) for c in live)
        with top_level() if on_workers else nullcontext():
            # The running totals start from zeros shared by every chunk (arrays are immutable).
            zeros = [jnp.zeros(shape, dtype) for shape, dtype in avals]
        if on_workers:

            def backward_chunk(k: int, run: ChunkRun[Any]) -> Any:
                with top_level():
                    return _backward_chunk(chunks[k], cotangents, zeros, n)

            totals = run_chunks(
                executor,
                len(chunks),
                backward_chunk,
                reverse=executor.reverse_backward,
                context=JaxConfig().enter,  # the backward pass's own settings
            )
            with top_level():
                return _sum_in_chunk_order(totals, len(inputs))
        # Cotangents that are tracers (vmap or jit of the vjp function): the caller's thread.
        totals = [_backward_chunk(chunk, cotangents, zeros, n) for chunk in chunks]
        return _sum_in_chunk_order(totals, len(inputs))

    join.defvjp(join_fwd, join_bwd, symbolic_zeros=True)
    return join


def _sum_in_chunk_order(totals: list[dict[int, Any] | None], count: int) -> tuple[Any, ...]:
    """Each join input's cotangent: its chunk totals added in chunk order (the same sum for any
    number of workers), in one compiled call; ``None`` where no chunk reached it."""
    parts: list[list[Any]] = [[] for _ in range(count)]
    for chunk_total in totals:
        if chunk_total is not None:
            for p, g in chunk_total.items():
                parts[p].append(g)
    several = [p for p in range(count) if len(parts[p]) > 1]
    sums = _add_in_order([parts[p] for p in several]) if several else []
    grads: list[Any] = [ps[0] if len(ps) == 1 else None for ps in parts]
    for p, g in zip(several, sums):
        grads[p] = g
    return tuple(grads)


@jax.jit
def _add_in_order(parts: list[list[Any]]) -> list[Any]:
    out = []
    for terms in parts:
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        out.append(total)
    return out


def _materialize(ct: Any, like: Any) -> Any:
    if isinstance(ct, SymbolicZero):
        return jnp.zeros(jnp.shape(like), jnp.result_type(like))
    return ct


def _backward_chunk(
    chunk: _Chunk, cotangents: tuple[Any, ...], zeros: list[Any], n: int
) -> dict[int, Any] | None:
    """The pullbacks of one chunk's elements, in element order; the totals per join input."""
    lo = chunk.outputs[0]
    total: dict[int, Any] = {}
    pending = Pending(n, "backward")
    for i, el, positions in zip(chunk.indices, chunk.elements, chunk.positions):
        width = len(el.diff)
        cts = cotangents[lo : lo + width]
        lo += width
        if el.pullback is None or all(isinstance(c, SymbolicZero) for c in cts):
            continue
        outs = [el.leaves[j] for j in el.diff]
        running = [total.get(p, zeros[p]) for p in positions]
        try:
            new = el.pullback([_materialize(c, o) for c, o in zip(cts, outs)], running)
        except BaseException as exc:
            add_note(exc, element_note(i, n, "backward", JAX_API))
            raise
        pending.push(i, new)
        for p, g in zip(positions, new):
            total[p] = g
    pending.wait()
    return total or None
