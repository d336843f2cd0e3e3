"""``tsum`` under reverse mode: each element one compiled step, the chunks' gradients summed.

Why this file exists: measured (NOTE [a sum's element is one compiled step]): 0.60x -> 1.05x.

NOTE [the sum's join]:
    ``tsum`` runs as ``tmap`` does (NOTE [the join node] in ``_rule``) with one difference: its
    elements' cotangents are known up to a factor before the backward pass starts (NOTE [a sum's
    element is one compiled step] in ``_compiled``). A chunk keeps, instead of its elements'
    outputs and pullbacks, running totals: of the elements' results, and of the gradients of
    their 0-d results with respect to the chunk's *boundary* (the caller's tracers its elements
    use, each once). The join is a ``custom_vjp`` from every chunk's boundary (``JoinLayout``) to
    the sum's differentiable leaves; its forward hands out the totals, added in chunk order; its
    backward adds each input's gradients in chunk order (``sum_in_chunk_order``, in one compiled
    call) and multiplies them by the cotangent of the sum's leaf -- on the caller's thread, with
    nothing left to run on the pool. Elements whose differentiable result is not one real 0-d
    array keep a pullback, run per chunk on the pool in the backward pass, as ``tmap``'s are.

    ``f``'s results must have one structure; their leaves are added with ``+`` in element order
    within a chunk and in chunk order across chunks, Python values (untraced leaves) apart from
    arrays. The gradient of a shared array is bitwise the same for any number of workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Literal

from .._errors import add_note, element_note
from .._join import sum_in_chunk_order
from .._request import MapRequest
from ._chunks import TSUM, Pending
from ._element import (
    ElementRunner,
    Prepared,
    Steps,
    Traced,
    compiled_pullback,
    steps_of,
    unique_tracers,
)
from ._mode import VjpTrace, top_level
from ._rule import (
    Boundary,
    NeedsLoop,
    Zeros,
    backward_chunks,
    forward_chunks,
    has_tracers,
    layout_of,
    make_join,
    warn_loop,
)

__all__ = ["Totals", "structure_error", "sum_vjp"]


def structure_error(api: str, i: int, tree: Any, first: int, first_tree: Any) -> TypeError:
    return TypeError(
        f"{api}: element {i} returned a result of structure {tree}, element {first} one of "
        f"structure {first_tree}; the elements' results must have one structure to be summed"
    )


def check_structures(chunks: Sequence[Totals], n: int) -> None:
    """Raise for the lowest element whose result's structure differs from the first
    element's, as the loop would, with its note; chunks in order."""
    first: Totals | None = None
    for totals in chunks:
        if totals.tree is None:
            continue
        if first is None:
            first = totals
        bad = (totals.first, totals.tree) if totals.tree != first.tree else totals.mismatch
        if bad is not None:
            exc = structure_error(totals.api, bad[0], bad[1], first.first, first.tree)
            add_note(exc, element_note(bad[0], n, "forward", totals.api))
            raise exc


class Totals:
    """A running sum of results, leaf by leaf: arrays and Python values apart (an untraced
    leaf of one element may be a traced one of another)."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.tree: Any = None
        self.first = -1
        self.arrays: list[Any] = []
        self.python: list[Any] = []
        self.mismatch: tuple[int, Any] | None = None  # the first element of another structure

    def check(self, i: int, tree: Any) -> bool:
        """Start with element ``i``'s structure, or check it against the first element's:
        ``False`` (and the element noted, see ``check_structures``) where it differs."""
        if self.tree is None:
            self.tree, self.first = tree, i
            self.arrays = [None] * tree.num_leaves
            self.python = [None] * tree.num_leaves
        elif tree != self.tree:
            if self.mismatch is None:
                self.mismatch = (i, tree)
            return False
        return True

    def add_python(self, t: int, value: Any) -> None:
        current = self.python[t]
        self.python[t] = value if current is None else current + value

    def add_leaves(self, leaves: Sequence[Any]) -> None:
        """Add a result's leaves (arrays or not, as they come): for the eager map."""
        for t, x in enumerate(leaves):
            if isinstance(x, jax.Array):
                current = self.arrays[t]
                self.arrays[t] = x if current is None else current + x
            else:
                self.add_python(t, x)

    def merge(self, other: Totals, arrays: bool = True) -> None:
        """Add the totals of a later chunk of the same structure (its Python values only, with
        ``arrays=False``)."""
        if other.tree is None:
            return
        self.check(other.first, other.tree)
        for t in range(len(other.arrays)):
            a, p = other.arrays[t], other.python[t]
            if a is not None and arrays:
                current = self.arrays[t]
                self.arrays[t] = a if current is None else current + a
            if p is not None:
                self.add_python(t, p)

    def leaf(self, t: int, array: Any = None) -> Any:
        """Leaf ``t`` of the sum (``array`` in place of its array part, if given)."""
        a = self.arrays[t] if array is None else array
        p = self.python[t]
        if a is None:
            return p
        return a if p is None else a + p


@dataclass(eq=False)
class _Deferred:
    """An element whose differentiable result is not one real 0-d array: its pullback runs in
    the backward pass."""

    index: int
    leaves: list[int]  # the result leaves it differentiates
    avals: list[Any]  # their types in this element
    positions: list[int]  # its tracers in the chunk's boundary
    pullback: Callable[[list[Any], list[Any]], list[Any]]


@dataclass(eq=False)
class _SumChunk:
    """What a chunk's forward leaves for its backward."""

    totals: Totals
    boundary: Boundary = field(default_factory=Boundary)
    grads: dict[int, list[Any]] = field(default_factory=dict)  # leaf -> per boundary tracer
    deferred: list[_Deferred] = field(default_factory=list)
    diff: set[int] = field(default_factory=set)  # the result leaves it differentiates
    wheres: dict[Any, list[int]] = field(default_factory=dict)  # plan -> its tracers' positions

    def gradients(self, t: int) -> list[Any]:
        """The running gradients of result leaf ``t``'s losses, one per boundary tracer."""
        grads = self.grads.get(t)
        if grads is None:
            grads = self.grads[t] = []
        grads.extend([None] * (len(self.boundary.tracers) - len(grads)))
        return grads


def sum_vjp(request: MapRequest, trace: VjpTrace, loop: Callable[[], Any]) -> Any:
    """The sum of ``f`` over the elements under the caller's reverse-mode trace (``trace``):
    each element one compiled step on the request's executor, one join node (NOTE [the sum's
    join]); ``loop()``, the plain loop's sum, instead when an element cannot be traced."""
    f, elements, executor, plan = request.f, request.elements, request.executor, request.plan
    n = len(elements)
    stepper = _Stepper(ElementRunner(f, trace, TSUM))

    # The steps of a chunk depend on each other (its running totals): XLA runs them in order
    # whatever the worker does, so it waits at the chunk's end only.
    try:
        chunks = forward_chunks(
            executor,
            plan,
            TSUM,
            lambda: _SumChunk(Totals(TSUM)),
            lambda i, chunk: stepper.run(i, elements[i], chunk),
            lag=plan.size,
        )
    except NeedsLoop as need:
        warn_loop(need, n, TSUM)
        return loop()

    check_structures([chunk.totals for chunk in chunks], n)
    totals = Totals(TSUM)
    for chunk in chunks:
        totals.merge(chunk.totals, arrays=False)  # the arrays: below, in one compiled call
    count = len(totals.arrays)
    with top_level():  # concrete values: not part of the caller's differentiation
        arrays = _add_in_chunk_order(
            [
                [c.totals.arrays[t] for c in chunks if c.totals.arrays[t] is not None]
                for t in range(count)
            ]
        )
    diff = sorted(set().union(*(c.diff for c in chunks)))
    leaves = [totals.leaf(t, arrays[t]) for t in range(count)]
    if not diff:
        return jax.tree_util.tree_unflatten(totals.tree, leaves)
    layout = layout_of([c.boundary for c in chunks], [0] * len(chunks))

    def backward(cotangents: tuple[Any, ...]) -> list[Any]:
        live = {t: c for t, c in zip(diff, cotangents) if not isinstance(c, SymbolicZero)}
        if not live:
            return [None] * len(layout.inputs)
        on_workers = not has_tracers(list(live.values()))
        pullbacks: list[list[Any] | None] = [None] * len(chunks)
        if any(chunk.deferred for chunk in chunks):
            zeros = Zeros()
            pullbacks = backward_chunks(
                executor, chunks, lambda c: _backward_chunk(c, live, zeros, n), on_workers
            )
        per_chunk = []
        for chunk, pulled in zip(chunks, pullbacks):
            terms: list[dict[int, list[Any]] | None] = [None] * len(chunk.boundary.tracers)
            for t, grads in chunk.grads.items():
                if t in live:
                    for p, g in enumerate(grads):
                        if g is not None:
                            terms[p] = _merge(terms[p], {t: [g]})
            for p, g in enumerate(pulled or ()):
                if g is not None:
                    terms[p] = _merge(terms[p], {-1: [g]})
            per_chunk.append(terms)
        summed = sum_in_chunk_order(layout, per_chunk, _merge)
        with top_level() if on_workers else nullcontext():
            return _finish(summed, live)  # type: ignore[no-any-return]

    join = make_join(layout.inputs, [arrays[t] for t in diff], backward)
    for t, out in zip(diff, join(*layout.inputs)):
        leaves[t] = totals.leaf(t, out)
    return jax.tree_util.tree_unflatten(totals.tree, leaves)


class _Stepper:
    """Runs the elements of one sum. An element whose differentiated arguments are all the
    closure's (its items are not differentiated: the common case) follows a *plan*: its trace's
    template (kept across calls) with this call's closure values; the others are prepared one
    by one."""

    def __init__(self, runner: ElementRunner) -> None:
        self.runner = runner
        self.zeros = Zeros()
        self._plans: dict[Traced, _Plan | None] = {}
        self._lock = threading.Lock()

    def run(self, i: int, args: tuple[Any, ...], chunk: _SumChunk) -> Any:
        """Add element ``i`` to ``chunk``. Returns an array its step made, to wait for (the
        outputs of one compiled call are ready together), or ``None``."""
        runner = self.runner
        traced, inputs = runner.lookup(args)
        plan: Any = None
        if not runner.owns_any(inputs):
            plan = self._plans.get(traced, _MISSING)
            if plan is _MISSING:
                new = self._plan(traced, inputs)
                with self._lock:
                    plan = self._plans.setdefault(traced, new)
        made: list[Any]
        try:
            if plan is None:
                made = _step(i, runner.bind(traced, inputs), chunk, self.zeros)
            else:
                assert isinstance(plan, _Plan)
                made = plan.run(i, inputs, chunk)
        except Exception:
            # A failure in a step, which runs the element's backward pass with its forward:
            # run the forward alone and keep the pullback, so that a failure of the backward
            # is raised in the backward pass, as in the loop.
            made = _step(i, runner.bind(traced, inputs), chunk, self.zeros, defer=True)
        return made[0] if made else None

    def _plan(self, traced: Traced, inputs: list[Any]) -> _Plan | None:
        fixed, tracers = self.runner.fixed(traced)
        positions = list(tracers)
        unique, slots = unique_tracers(tracers, positions)
        key = (tuple(positions), tuple(slots))
        template = traced.templates.get(key, _MISSING)
        if template is _MISSING:
            element = self.runner.bind(traced, inputs)
            template = traced.templates.setdefault(
                key, _Template.make(element, len(inputs), self.zeros)
            )
        if template is None:
            return None
        assert isinstance(template, _Template)
        base = [
            None if s is None else s.val if isinstance(s, Literal) else fixed[s]
            for s in template.sources
        ]
        return _Plan(template, base, [unique[slots[positions.index(s)]] for s in template.diff])


_MISSING = object()


@dataclass(eq=False)
class _Template:
    """How the elements of one trace run as steps, their items not differentiated, whatever
    the call: everything but the arrays (NOTE [a sum's element is one compiled step])."""

    tree: Any
    python: list[tuple[int, Any]]  # untraced result leaves
    leaves: list[int]  # traced result leaves
    sources: list[int | Literal | None]  # per step argument: fixed argument, literal, or item
    fill: list[tuple[int, int]]  # (step argument, item array)
    step: Callable[..., Any] | None
    zero_totals: list[Any]
    loss: int | None  # the result leaf whose gradient the step adds
    diff: list[int]  # the fixed arguments (one per distinct tracer) it differentiates
    zero_grads: list[Any]

    @staticmethod
    def make(element: Prepared, count: int, zeros: Zeros) -> _Template | None:
        """The template of ``element``'s trace (``count`` item arrays), or ``None`` where its
        elements keep a pullback (``_step`` does that)."""
        traced = element.traced
        leaves = traced.traced
        is_traced = set(leaves)
        python = [(t, x) for t, x in enumerate(traced.leaves) if t not in is_traced]
        if not leaves:
            return _Template(traced.tree, python, [], [], [], None, [], None, [], [])
        fixed = len(element.args) - count
        how = steps_of(element)
        if how.diff and how.loss is None:
            return None
        call = traced.call
        if call is not None:
            sources: list[int | Literal | None] = list(call.sources)
        else:
            sources = list(range(len(element.args)))
        fill = [
            (k, s - fixed)
            for k, s in enumerate(sources)
            if not isinstance(s, Literal) and s is not None and s >= fixed
        ]
        for k, _ in fill:
            sources[k] = None
        zero_totals = [zeros.like(how.p_avals[k]) for k in how.out_index]
        if how.loss is None:
            step = how.programs.step((), (), how.out_index, None)
            return _Template(
                traced.tree, python, leaves, sources, fill, step, zero_totals, None, [], []
            )
        tracers, slots = unique_tracers(element.tracers, how.sources)
        first: dict[int, int] = {}
        for s, source in zip(slots, how.sources):
            first.setdefault(s, source)
        step = how.programs.step(
            tuple(how.positions), tuple(slots), how.out_index, how.out_index[how.loss]
        )
        return _Template(
            traced.tree,
            python,
            leaves,
            sources,
            fill,
            step,
            zero_totals,
            leaves[how.loss],
            [first[s] for s in range(len(tracers))],
            [zeros.like(t) for t in tracers],
        )


@dataclass(eq=False)
class _Plan:
    """A template with this call's values: the fixed arguments, the tracers they stand for."""

    template: _Template
    base: list[Any]  # the step's arguments; the items' arrays go in at ``template.fill``
    tracers: list[Any]  # the caller's tracers the step differentiates with respect to

    def run(self, i: int, inputs: list[Any], chunk: _SumChunk) -> list[Any]:
        template = self.template
        totals = chunk.totals
        if not totals.check(i, template.tree):
            return []
        if template.step is None:
            made: list[Any] = []
        else:
            args = list(self.base)
            for k, j in template.fill:
                args[k] = inputs[j]
            arrays = totals.arrays
            running = [
                z if arrays[t] is None else arrays[t]
                for t, z in zip(template.leaves, template.zero_totals)
            ]
            if template.loss is None:
                new_totals, _ = template.step(args, running, [])
                made = list(new_totals)
            else:
                where = chunk.wheres.get(self)
                if where is None:
                    where = chunk.wheres[self] = chunk.boundary.place(self.tracers)
                grads = chunk.gradients(template.loss)
                gradients = [
                    z if grads[p] is None else grads[p] for z, p in zip(template.zero_grads, where)
                ]
                new_totals, new_grads = template.step(args, running, gradients)
                for p, g in zip(where, new_grads):
                    grads[p] = g
                chunk.diff.add(template.loss)
                made = [*new_totals, *new_grads]
            for t, total in zip(template.leaves, new_totals):
                arrays[t] = total
        for t, x in template.python:
            totals.add_python(t, x)
        return made


def _step(
    i: int, element: Prepared, chunk: _SumChunk, zeros: Zeros, defer: bool = False
) -> list[Any]:
    """Add element ``i`` to its chunk's totals, prepared on its own (its items differentiated,
    or its differentiable result not one real 0-d array, or ``defer``: its pullback is kept).
    Returns the arrays it made."""
    traced = element.traced
    totals = chunk.totals
    if not totals.check(i, traced.tree):
        return []
    traced_leaves = traced.traced
    made: list[Any] = []
    if traced_leaves:
        how = steps_of(element)
        running = [
            zeros.like(how.p_avals[k]) if totals.arrays[t] is None else totals.arrays[t]
            for t, k in zip(traced_leaves, how.out_index)
        ]
        if how.loss is None or defer:
            step = how.programs.step((), (), how.out_index, None)
            new_totals, _ = step(how.args, running, [])
            made = list(new_totals)
            if how.diff:
                _defer(i, element, chunk, how)
        else:
            tracers, slots = unique_tracers(element.tracers, how.sources)
            where = chunk.boundary.place(tracers)
            t_loss = traced_leaves[how.loss]
            grads = chunk.gradients(t_loss)
            gradients = [
                zeros.like(t) if grads[p] is None else grads[p] for p, t in zip(where, tracers)
            ]
            step = how.programs.step(
                tuple(how.positions), tuple(slots), how.out_index, how.out_index[how.loss]
            )
            new_totals, new_grads = step(how.args, running, gradients)
            for p, g in zip(where, new_grads):
                grads[p] = g
            chunk.diff.add(t_loss)
            made = [*new_totals, *new_grads]
        for t, total in zip(traced_leaves, new_totals):
            totals.arrays[t] = total
    if len(traced_leaves) < len(traced.leaves):
        is_traced = set(traced_leaves)
        for t, x in enumerate(traced.leaves):
            if t not in is_traced:
                totals.add_python(t, x)
    return made


def _defer(i: int, element: Prepared, chunk: _SumChunk, how: Steps) -> None:
    """Keep the pullback of an element whose differentiable result is not one real 0-d array
    (NOTE [one jitted call, one compiled pullback]: it recomputes the forward)."""
    traced = element.traced
    tracers, slots = unique_tracers(element.tracers, how.sources)
    compiled = how.programs.pullback(tuple(how.positions), tuple(slots))
    p_avals, args = how.p_avals, how.args
    floats = [k for k, aval in enumerate(p_avals) if jnp.issubdtype(aval.dtype, jnp.inexact)]
    slot = {k: s for s, k in enumerate(floats)}
    targets = [slot[how.out_index[u]] for u in how.diff]
    pullback = compiled_pullback(compiled, args, targets, [p_avals[k] for k in floats])
    leaves = [traced.traced[u] for u in how.diff]
    chunk.diff.update(leaves)
    chunk.deferred.append(
        _Deferred(
            i,
            leaves,
            [p_avals[how.out_index[u]] for u in how.diff],
            chunk.boundary.place(tracers),
            pullback,
        )
    )


def _backward_chunk(
    chunk: _SumChunk, live: dict[int, Any], zeros: Zeros, n: int
) -> list[Any] | None:
    """The pullbacks of one chunk's deferred elements, in element order: the totals per
    boundary tracer (``None`` where none reached it), or ``None`` if none ran."""
    total: list[Any] = [None] * len(chunk.boundary.tracers)
    pending = Pending(n, "backward", TSUM)
    worked = False
    for d in chunk.deferred:
        if not any(t in live for t in d.leaves):
            continue
        cts = [
            _unbroadcast(live[t], aval) if t in live else jnp.zeros(aval.shape, aval.dtype)
            for t, aval in zip(d.leaves, d.avals)
        ]
        running = [
            zeros.like(chunk.boundary.tracers[p]) if total[p] is None else total[p]
            for p in d.positions
        ]
        try:
            new = d.pullback(cts, running)
        except BaseException as exc:
            add_note(exc, element_note(d.index, n, "backward", TSUM))
            raise
        pending.push(d.index, new)
        for p, g in zip(d.positions, new):
            total[p] = g
        worked = True
    pending.wait()
    return total if worked else None


def _unbroadcast(ct: Any, aval: Any) -> Any:
    """The cotangent of an element's leaf of type ``aval`` that was added (broadcast) into a sum
    leaf whose cotangent is ``ct``."""
    shape = tuple(aval.shape)
    if tuple(ct.shape) != shape:
        extra = ct.ndim - len(shape)
        if extra:
            ct = ct.sum(axis=tuple(range(extra)))
        ones = tuple(d for d, (a, c) in enumerate(zip(shape, ct.shape)) if a == 1 and c != 1)
        if ones:
            ct = ct.sum(axis=ones, keepdims=True)
    return ct if ct.dtype == aval.dtype else ct.astype(aval.dtype)


def _merge(a: dict[int, list[Any]] | None, b: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """Two inputs' terms, by leaf (``-1``: pullbacks), in chunk order (``a``'s first)."""
    if a is None:
        return b
    for key, terms in b.items():
        a.setdefault(key, []).extend(terms)  # ``a`` holds lists made for this sum
    return a


@jax.jit
def _finish(summed: list[dict[int, list[Any]] | None], cts: dict[int, Any]) -> list[Any]:
    """Each join input's cotangent: per sum leaf, its gradients added in chunk order times the
    leaf's cotangent (summed over the leaf's axes: an element's 0-d result broadcasts over
    them); plus the pullbacks' totals."""
    out: list[Any] = []
    for terms in summed:
        if terms is None:
            out.append(None)
            continue
        total = None
        for key in sorted(terms):
            gs = terms[key]
            s = gs[0]
            for g in gs[1:]:
                s = s + g
            if key >= 0:
                ct = cts[key]
                factor = ct.sum() if ct.ndim else ct
                s = s * factor.astype(s.dtype)
            total = s if total is None else total + s
        out.append(total)
    return out


@jax.jit
def _add_in_chunk_order(parts: list[list[Any]]) -> list[Any]:
    out: list[Any] = []
    for terms in parts:
        total = None
        for term in terms:
            total = term if total is None else total + term
        out.append(total)
    return out
