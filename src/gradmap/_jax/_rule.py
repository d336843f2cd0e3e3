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

import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .._engine import ChunkRun, run_chunks
from .._errors import add_note, element_note
from .._executors import Executor
from .._join import JoinLayout, sum_in_chunk_order
from .._plan import ChunkPlan
from .._request import MapRequest
from ._chunks import TMAP, Pending, chunk_elements
from ._config import JaxConfig
from ._element import Element, ElementRunner, untraceable
from ._mode import VjpTrace, top_level

__all__ = [
    "Boundary",
    "NeedsLoop",
    "Zeros",
    "backward_chunks",
    "forward_chunks",
    "has_tracers",
    "layout_of",
    "make_join",
    "map_vjp",
    "sum_chunk_grads",
    "warn_loop",
]


class NeedsLoop(Exception):
    """An element could not be traced (a branch on an array's value): run the plain loop."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index)
        self.index = index
        self.error = error


C = TypeVar("C")


def forward_chunks(
    executor: Executor,
    plan: ChunkPlan,
    api: str,
    new_chunk: Callable[[], C],
    step: Callable[[int, C], Any],
    *,
    lag: int | None = None,
    traced: bool = True,
) -> list[C]:
    """Every chunk's forward on ``executor``, under JAX's settings: ``new_chunk()``, then
    ``step(i, chunk)`` for each of its elements in order, the arrays it returns waited for
    (``Pending``, with ``lag``); an element's error gets its note. ``traced`` (the rule): the
    steps run at the top level (the caller's thread too, when it helps), and an element that
    cannot be traced raises ``NeedsLoop``; else (eager) ``f`` runs as it is."""
    n = plan.n

    def forward_chunk(k: int, run: ChunkRun[C]) -> C:
        chunk = new_chunk()
        pending = Pending(n, "forward", api, lag=lag)
        with top_level() if traced else nullcontext():
            for i in chunk_elements(run, k, plan):
                try:
                    made = step(i, chunk)
                except BaseException as exc:
                    if traced and isinstance(exc, Exception) and untraceable(exc):
                        raise NeedsLoop(i, exc) from None
                    add_note(exc, element_note(i, n, "forward", api))
                    raise
                pending.push(i, made)
            pending.wait()
        return chunk

    return run_chunks(executor, plan.count, forward_chunk, context=JaxConfig().enter)


def backward_chunks(
    executor: Executor, chunks: Sequence[C], backward_chunk: Callable[[C], Any], on_workers: bool
) -> list[Any]:
    """``backward_chunk(chunk)`` for every chunk: on ``executor``, at the top level, under the
    backward pass's own settings; or, with ``on_workers`` false (cotangents that are tracers:
    ``vmap`` or ``jit`` of the vjp function), in the caller's thread, under its trace."""
    if not on_workers:
        return [backward_chunk(chunk) for chunk in chunks]

    def run_one(k: int, run: ChunkRun[Any]) -> Any:
        with top_level():
            return backward_chunk(chunks[k])

    return run_chunks(
        executor,
        len(chunks),
        run_one,
        reverse=executor.reverse_backward,
        context=JaxConfig().enter,  # the backward pass's own settings
    )


def warn_loop(need: NeedsLoop, n: int, api: str) -> None:
    warnings.warn(
        f"{api}: element {need.index} of {n} could not be traced "
        f"({type(need.error).__name__}: f branches on an array's value), so the map ran "
        "as the plain loop in the caller's thread. To run it in parallel under "
        "differentiation, make f traceable (jnp.where, lax.cond) or pass such values as "
        "Python scalars.",
        RuntimeWarning,
        stacklevel=5,  # warn_loop, map_vjp or sum_vjp, _map._run, tmap or tsum, the caller
    )


@dataclass(eq=False)
class Boundary:
    """The caller's tracers a chunk's elements are differentiated with respect to, each once
    (by identity), in order of first use: the chunk's part of the join's inputs."""

    tracers: list[Any] = field(default_factory=list)
    _where: dict[int, int] = field(default_factory=dict)

    def place(self, tracers: Sequence[Any]) -> list[int]:
        """The positions of ``tracers`` in the boundary (added where new)."""
        positions = []
        for t in tracers:
            p = self._where.get(id(t))
            if p is None:
                p = self._where[id(t)] = len(self.tracers)
                self.tracers.append(t)
            positions.append(p)
        return positions


def layout_of(boundaries: list[Boundary], output_counts: list[int]) -> JoinLayout[Any]:
    """The join's layout: every chunk's tracers, each once (by identity)."""
    return JoinLayout(
        [b.tracers for b in boundaries],
        [[id(t) for t in b.tracers] for b in boundaries],
        output_counts,
    )


class Zeros:
    """Zeros of each type, made once per pass and shared (arrays are immutable): the starting
    running totals of a chunk's gradients."""

    def __init__(self) -> None:
        self._made: dict[tuple[Any, Any], Any] = {}
        self._lock = threading.Lock()

    def like(self, x: Any) -> Any:
        """Zeros of ``x``'s shape and dtype (``x`` an array, a tracer or a type)."""
        key = (tuple(x.shape), x.dtype)
        z = self._made.get(key)
        if z is None:
            z = jnp.zeros(*key)
            with self._lock:
                z = self._made.setdefault(key, z)
        return z


def has_tracers(cotangents: Sequence[Any]) -> bool:
    """Whether any cotangent is a tracer (``vmap`` or ``jit`` of the ``vjp`` function): then
    the backward runs in the caller's thread, under the caller's trace."""
    return any(isinstance(c, jax.core.Tracer) for c in cotangents)


def make_join(
    inputs: list[Any],
    outputs: Sequence[Any],
    backward: Callable[[tuple[Any, ...]], Sequence[Any]],
) -> Callable[..., tuple[Any, ...]]:
    """The join node: ``inputs`` (the caller's tracers) to ``outputs`` (computed already);
    ``backward(cotangents)`` (symbolic zeros among them) gives each input's cotangent or
    ``None``."""
    values = tuple(outputs)

    @jax.custom_vjp
    def join(*primals: Any) -> tuple[Any, ...]:
        return values

    def join_fwd(*primals: Any) -> tuple[tuple[Any, ...], None]:
        return values, None

    def join_bwd(residuals: None, cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(backward(cotangents))

    join.defvjp(join_fwd, join_bwd, symbolic_zeros=True)
    return join


def _concat(a: list[Any], b: list[Any]) -> list[Any]:
    a.extend(b)  # ``a`` is a list made for this sum (below)
    return a


def sum_chunk_grads(
    layout: JoinLayout[Any], per_chunk: Sequence[Sequence[Any] | None]
) -> list[Any]:
    """Each join input's cotangent: its chunks' gradients (aligned with each chunk's boundary,
    ``None`` where a chunk did not reach it) added in chunk order (NOTE [chunk-order sum] in
    ``gradmap._join``), the additions in one compiled call; ``None`` where no chunk reached it.
    """
    lists = [
        None if grads is None else [None if g is None else [g] for g in grads]
        for grads in per_chunk
    ]
    terms = sum_in_chunk_order(layout, lists, _concat)
    several = [p for p, ts in enumerate(terms) if ts is not None and len(ts) > 1]
    grads = [ts[0] if ts is not None and len(ts) == 1 else None for ts in terms]
    if several:
        for p, g in zip(several, _add_in_order([terms[p] for p in several])):
            grads[p] = g
    return grads


@jax.jit
def _add_in_order(parts: list[list[Any]]) -> list[Any]:
    out = []
    for terms in parts:
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        out.append(total)
    return out


# --------------------------------------------------------------------------------------------
# tmap


@dataclass(eq=False)
class _Chunk:
    """What a chunk's forward leaves for its backward."""

    indices: list[int] = field(default_factory=list)
    elements: list[Element] = field(default_factory=list)
    boundary: Boundary = field(default_factory=Boundary)
    positions: list[list[int]] = field(default_factory=list)  # per element: in the boundary
    outputs: tuple[int, int] = (0, 0)  # its range among the join's outputs


def map_vjp(request: MapRequest, trace: VjpTrace, loop: Callable[[], list[Any]]) -> list[Any]:
    """``[f(*args) for args in elements]`` under the caller's reverse-mode trace (``trace``),
    with the forward and each chunk's pullback on the request's executor; ``loop()``, the plain
    loop, instead when an element cannot be traced. Returns the results, in element order."""
    f, elements, executor, plan = request.f, request.elements, request.executor, request.plan
    n = len(elements)
    runner = ElementRunner(f, trace, TMAP)

    def step(i: int, chunk: _Chunk) -> Any:
        el = runner.run(elements[i], n)
        chunk.indices.append(i)
        chunk.elements.append(el)
        chunk.positions.append(chunk.boundary.place(el.tracers))
        return el.leaves

    try:
        chunks = forward_chunks(executor, plan, TMAP, _Chunk, step)
    except NeedsLoop as need:
        warn_loop(need, n, TMAP)
        return loop()

    outputs: list[Any] = []
    for chunk in chunks:
        lo = len(outputs)
        for el in chunk.elements:
            outputs.extend(el.leaves[i] for i in el.diff)
        chunk.outputs = (lo, len(outputs))
    if not outputs:
        return [el.result() for chunk in chunks for el in chunk.elements]
    layout = layout_of(
        [c.boundary for c in chunks], [hi - lo for lo, hi in (c.outputs for c in chunks)]
    )

    def backward(cotangents: tuple[Any, ...]) -> list[Any]:
        live = [c for c in cotangents if not isinstance(c, SymbolicZero)]
        on_workers = not has_tracers(live)
        zeros = Zeros()
        per_chunk = backward_chunks(
            executor, chunks, lambda c: _backward_chunk(c, cotangents, zeros, n), on_workers
        )
        with top_level() if on_workers else nullcontext():
            return sum_chunk_grads(layout, per_chunk)

    join = make_join(layout.inputs, outputs, backward)
    joined = iter(join(*layout.inputs))
    results = []
    for chunk in chunks:
        for el in chunk.elements:
            leaves = list(el.leaves)
            for i in el.diff:
                leaves[i] = next(joined)
            results.append(el.result(leaves))
    return results


def materialize(ct: Any, like: Any) -> Any:
    """A cotangent as an array (a symbolic zero as zeros of ``like``'s type)."""
    if isinstance(ct, SymbolicZero):
        return jnp.zeros(jnp.shape(like), jnp.result_type(like))
    return ct


def _backward_chunk(
    chunk: _Chunk, cotangents: tuple[Any, ...], zeros: Zeros, n: int
) -> list[Any] | None:
    """The pullbacks of one chunk's elements, in element order; the totals per boundary tracer
    (``None`` where none reached it), or ``None`` for a chunk that did no backward work."""
    lo = chunk.outputs[0]
    total: list[Any] = [None] * len(chunk.boundary.tracers)
    pending = Pending(n, "backward", TMAP)
    worked = False
    kept: list[list[tuple[Any, Any]]] = [[] for _ in total]  # kept gradients, by tracer
    for i, el, positions in zip(chunk.indices, chunk.elements, chunk.positions):
        width = len(el.diff)
        cts = cotangents[lo : lo + width]
        lo += width
        if all(isinstance(c, SymbolicZero) for c in cts):
            continue
        if el.gradients is not None:  # NOTE [a loss keeps its gradient] in ``_compiled``
            for p, g in zip(positions, el.gradients):
                kept[p].append((cts[0], g))
            continue
        if el.pullback is None:
            continue
        outs = [el.leaves[j] for j in el.diff]
        running = [
            zeros.like(chunk.boundary.tracers[p]) if total[p] is None else total[p]
            for p in positions
        ]
        try:
            new = el.pullback([materialize(c, o) for c, o in zip(cts, outs)], running)
        except BaseException as exc:
            add_note(exc, element_note(i, n, "backward", TMAP))
            raise
        pending.push(i, new)
        for p, g in zip(positions, new):
            total[p] = g
        worked = True
    pending.wait()
    if any(kept):
        total = _add_kept(total, kept)
        worked = True
    return total if worked else None


@jax.jit
def _add_kept(total: list[Any], kept: list[list[tuple[Any, Any]]]) -> list[Any]:
    """Each tracer's total plus its kept gradients times their cotangents, in element order."""
    out = []
    for t, terms in zip(total, kept):
        for ct, g in terms:
            term = g * ct.astype(g.dtype)
            t = term if t is None else t + term
        out.append(t)
    return out
