"""Elements under reverse mode: traced, the tracers they use hoisted, run on their primals.

NOTE [hoisting the tracers an element uses]:
    Under ``jax.grad`` the values being differentiated are tracers of the caller's trace, and a
    worker thread cannot compute with them: its own trace is the top level, where every value
    must be concrete. So a worker first *traces* the element to a jaxpr, with the element's array
    leaves as the jaxpr's inputs. Every other value ``f`` reaches -- through its closure, a
    module's attributes, a global -- becomes a constant of the jaxpr: the concrete ones (data,
    parameters not being differentiated) and the caller's tracers alike. Those tracers, and the
    items that are tracers, are the element's *hoisted* inputs: this is ``jax.closure_convert``
    for arguments and closure at once, without its cache (keyed on the function, it holds on to
    old traces' tracers).

    The worker then evaluates the jaxpr with every hoisted tracer replaced by its concrete primal,
    under ``jax.vjp`` with respect to those primals: the element's outputs, and its pullback
    from output cotangents to cotangents of the hoisted tracers. The pullback stays with the
    element until the join's backward runs it (see ``_rule``; and NOTE [one jitted call, one
    compiled pullback] in ``_compiled`` for the common case of an element that calls one jitted
    function).

    One trace serves every element of the map with the same *signature* -- the structure of its
    arguments, the shape and dtype of their array leaves, and the values of the others (Python
    scalars, strings: constants of the trace, as in the loop). A map over arrays of one shape is
    traced once; a ragged map once per shape. Where tracing with the arrays abstract fails
    (``f`` reads an item's value, ``int(x)``), the element is traced alone with its items
    concrete, as constants. Tracing stages every operation, even those on concrete values, so
    ``f`` must be traceable on this path, as under ``jax.jit``: a Python branch on a computed
    array's value raises ``ConcretizationTypeError``, and the map then runs as the plain loop
    instead, where such a branch works as in the loop (``_rule`` warns).

    Outputs: a leaf of ``f``'s result that is a traced array of a floating or complex dtype is
    differentiable and becomes an output of the join; integer and boolean arrays are returned as
    concrete values (their tangent is zero in the loop too); leaves that are not traced (Python
    numbers, strings) are returned as ``f`` returned them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from ._compiled import CompiledCall, compiled_forward, compiled_pullback, single_call
from ._mode import VjpTrace

__all__ = ["UNTRACEABLE", "Element", "ElementRunner"]

#: What tracing raises where ``f`` needs a concrete value (a branch, ``int(x)``, ``np.asarray``).
UNTRACEABLE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


@dataclass(slots=True, eq=False)
class Element:
    """One element's forward under reverse mode.

    Attributes:
        leaves: the leaves of ``f``'s result, concrete.
        tree: the result's structure.
        diff: positions in ``leaves`` of the differentiable outputs (the join's outputs).
        tracers: the caller's tracers the element is differentiated with respect to, each once.
        pullback: ``pullback(cotangents, totals)``: given cotangents of the ``diff`` outputs and
            running totals of the cotangents of ``tracers`` (arrays, zeros at first), the totals
            with this element's contribution added; ``None`` when nothing is differentiable.
    """

    leaves: list[Any]
    tree: Any
    diff: list[int]
    tracers: list[Any]
    pullback: Callable[[list[Any], list[Any]], list[Any]] | None

    def result(self, leaves: list[Any] | None = None) -> Any:
        """``f``'s result, rebuilt from ``leaves`` (default: the element's own)."""
        return jax.tree_util.tree_unflatten(self.tree, self.leaves if leaves is None else leaves)


def _differentiable(aval: Any) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


# --------------------------------------------------------------------------------------------
# Tracing


def _trace_private(
    fun: Callable[..., list[Any]], avals: list[Any]
) -> tuple[Any, list[Any], list[Any]]:
    from jax._src import api_util
    from jax._src import linear_util as lu
    from jax._src.interpreters import partial_eval as pe

    debug = api_util.debug_info("gradmap.jax.tmap", fun, tuple(avals), {})
    jaxpr, out_avals, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fun, debug_info=debug), avals)
    return jaxpr, list(consts), list(out_avals)


def _trace_public(
    fun: Callable[..., list[Any]], avals: list[Any]
) -> tuple[Any, list[Any], list[Any]]:
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    closed = jax.make_jaxpr(fun)(*shapes)
    return closed.jaxpr, list(closed.consts), list(closed.out_avals)


def _choose_trace() -> Callable[
    [Callable[..., list[Any]], list[Any]], tuple[Any, list[Any], list[Any]]
]:
    """``trace_to_jaxpr_dynamic`` costs about 40% less per trace than ``jax.make_jaxpr``, which
    wraps it; the public one is the fallback for a JAX where the private one moved."""
    try:
        _trace_private(lambda x: [x], [jax.core.ShapedArray((), jnp.float32)])
    except Exception:  # pragma: no cover - a JAX whose internals moved
        return _trace_public
    return _trace_private


_trace = _choose_trace()


@dataclass(slots=True, eq=False)
class _Traced:
    """``f`` traced for one signature: a jaxpr from the element's array leaves to the traced
    leaves of its result."""

    jaxpr: Any
    consts: list[Any]  # concrete, the caller's tracers replaced by their primals
    hoisted: dict[int, Any]  # const position -> the caller's tracer (differentiated)
    tree: Any  # the result's structure
    leaves: list[Any]  # the result's leaves; traced ones are placeholders
    traced: list[int]  # positions in ``leaves`` of the jaxpr's outputs, in order
    is_diff: list[bool]  # per jaxpr output: of a floating dtype
    deps: list[int]  # per jaxpr output: bit k for input k, bit len(inputs) + j for constant j
    call: CompiledCall | None


def _dependencies(jaxpr: Any) -> list[int]:
    """Which inputs and constants each output of ``jaxpr`` depends on, as bit masks: an output
    that depends on no differentiated value is returned concrete, as the loop would return it."""
    bits: dict[Any, int] = {v: 1 << k for k, v in enumerate(jaxpr.invars)}
    offset = len(jaxpr.invars)
    bits.update((v, 1 << (offset + j)) for j, v in enumerate(jaxpr.constvars))
    for eqn in jaxpr.eqns:
        mask = 0
        for v in eqn.invars:
            if not isinstance(v, Literal):
                mask |= bits.get(v, 0)
        for v in eqn.outvars:
            bits[v] = mask
    return [0 if isinstance(v, Literal) else bits.get(v, 0) for v in jaxpr.outvars]


#: Leaves that are inputs of the trace (abstract); numpy arrays too, so that data loaded as numpy
#: shares traces, while ``f`` may still apply numpy to them (the element is then traced alone).
_ARRAYS = (jax.Array, np.ndarray)
_MISSING = object()


def _static_key(x: Any) -> Hashable:
    if isinstance(x, float):
        return ("float", x.hex())  # 0.0 and -0.0 are equal, but not the same constant
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return (type(x), x)


class ElementRunner:
    """Runs the elements of one map under reverse mode; shared by the threads of the forward.

    Traces are cached by signature for the duration of the map (see NOTE [hoisting the tracers
    an element uses]).
    """

    def __init__(self, f: Callable[..., Any], trace: VjpTrace) -> None:
        self._f = f
        self._trace = trace
        self._traces: dict[Hashable, _Traced | None] = {}  # None: trace each element alone
        self._lock = threading.Lock()

    def run(self, args: tuple[Any, ...]) -> Element:
        """Trace (or reuse a trace), hoist the caller's tracers, run on their primals under
        ``jax.vjp``. Call at the top level.

        Raises:
            Whatever ``f`` raises while traced (one of ``UNTRACEABLE`` for a branch on a
            traced value), or while the traced element runs.
        """
        leaves, tree = jax.tree_util.tree_flatten(args)
        dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, _ARRAYS)]
        key = (
            tree,
            tuple(jax.typeof(leaves[i]) for i in dynamic),
            tuple(_static_key(leaf) for leaf in leaves if not isinstance(leaf, _ARRAYS)),
        )
        traced = self._traces.get(key, _MISSING)
        if traced is _MISSING:
            try:
                traced = self._trace_element(leaves, tree, dynamic)
            except UNTRACEABLE:
                traced = None  # ``f`` reads an item's value
            with self._lock:
                traced = self._traces.setdefault(key, traced)
        if traced is None:  # trace this element alone, its items constants
            return self._run(self._trace_element(leaves, tree, []), [])
        assert isinstance(traced, _Traced)
        return self._run(traced, [leaves[i] for i in dynamic])

    def _trace_element(self, leaves: list[Any], tree: Any, dynamic: list[int]) -> _Traced:
        f = self._f
        found: dict[str, Any] = {}

        def element(*inputs: Any) -> list[Any]:
            full = list(leaves)
            for i, x in zip(dynamic, inputs):
                full[i] = x
            out_leaves, out_tree = jax.tree_util.tree_flatten(
                f(*jax.tree_util.tree_unflatten(tree, full))
            )
            traced = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, jax.core.Tracer)]
            found["leaves"], found["tree"], found["traced"] = out_leaves, out_tree, traced
            return [out_leaves[i] for i in traced]

        avals = [
            jax.typeof(self._trace.primal(leaves[i]) if self._trace.owns(leaves[i]) else leaves[i])
            for i in dynamic
        ]
        jaxpr, consts, out_avals = _trace(element, avals)
        hoisted = {}
        for j, c in enumerate(consts):
            if self._trace.owns(c):
                consts[j] = self._trace.primal(c)
                if _differentiable(c.aval):
                    hoisted[j] = c
        out_leaves = list(found["leaves"])
        for i in found["traced"]:
            out_leaves[i] = None  # placeholders: the worker's tracers must not outlive the trace
        return _Traced(
            jaxpr,
            consts,
            hoisted,
            found["tree"],
            out_leaves,
            found["traced"],
            [_differentiable(aval) for aval in out_avals],
            _dependencies(jaxpr),
            single_call(jaxpr),
        )

    def _run(self, traced: _Traced, inputs: list[Any]) -> Element:
        """One element on a trace: ``inputs`` are its array leaves (tracers or concrete)."""
        trace = self._trace
        # The element's differentiated inputs: hoisted constants, and items that are tracers.
        values = list(inputs)
        item_tracers: dict[int, Any] = {}
        for k, x in enumerate(inputs):
            if trace.owns(x):
                values[k] = trace.primal(x)
                if _differentiable(x.aval):
                    item_tracers[k] = x
        leaves = list(traced.leaves)
        offset = len(inputs)
        mask = sum(1 << (offset + j) for j in traced.hoisted) | sum(1 << k for k in item_tracers)
        is_diff = [d and bool(deps & mask) for d, deps in zip(traced.is_diff, traced.deps)]
        diff = [i for i, d in zip(traced.traced, is_diff) if d]
        if traced.call is not None:
            return _run_call(traced, values, item_tracers, leaves, diff)
        closed = ClosedJaxpr(traced.jaxpr, traced.consts)
        if not diff:
            for i, out in zip(traced.traced, jaxpr_as_fun(closed)(*values)):
                leaves[i] = out
            return Element(leaves, traced.tree, [], [], None)

        # Differentiate with respect to the hoisted constants, then the items that are tracers.
        const_pos = list(traced.hoisted)
        item_pos = list(item_tracers)

        def element(*primals: Any) -> tuple[list[Any], list[Any]]:
            consts = list(traced.consts)
            for j, p in zip(const_pos, primals):
                consts[j] = p
            args = list(values)
            for k, p in zip(item_pos, primals[len(const_pos) :]):
                args[k] = p
            outs = jaxpr_as_fun(ClosedJaxpr(traced.jaxpr, consts))(*args)
            return [o for o, d in zip(outs, is_diff) if d], [
                o for o, d in zip(outs, is_diff) if not d
            ]

        primals = [traced.consts[j] for j in const_pos] + [values[k] for k in item_pos]
        diff_outs, vjp, other_outs = jax.vjp(element, *primals, has_aux=True)
        for i, out in zip(diff, diff_outs):
            leaves[i] = out
        for i, out in zip((i for i, d in zip(traced.traced, is_diff) if not d), other_outs):
            leaves[i] = out

        def pullback(cotangents: list[Any], totals: list[Any]) -> list[Any]:
            return [t + g for t, g in zip(totals, vjp(cotangents))]

        tracers = [traced.hoisted[j] for j in const_pos] + [item_tracers[k] for k in item_pos]
        return Element(leaves, traced.tree, diff, tracers, pullback)


def _run_call(
    traced: _Traced,
    values: list[Any],
    item_tracers: dict[int, Any],
    leaves: list[Any],
    diff: list[int],
) -> Element:
    """An element that is one plain ``jit`` call: a compiled forward, and a compiled, cached
    pullback. See NOTE [one jitted call, one compiled pullback]."""
    call = traced.call
    assert call is not None
    args: list[Any] = []
    positions: list[int] = []  # arguments of the call that are differentiated
    slots: list[int] = []  # for each, its tracer among the element's tracers
    tracers: list[Any] = []
    slot_of: dict[tuple[str, int], int] = {}
    for k, (kind, index) in enumerate(call.sources):
        if kind == "literal":
            args.append(call.eqn.invars[k].val)
            continue
        if kind == "const":
            args.append(traced.consts[index])
            tracer = traced.hoisted.get(index)
        else:
            args.append(values[index])
            tracer = item_tracers.get(index)
        if tracer is not None:
            if (kind, index) not in slot_of:
                slot_of[kind, index] = len(tracers)
                tracers.append(tracer)
            positions.append(k)
            slots.append(slot_of[kind, index])
    outs = compiled_forward(call.jaxpr)(*args)
    for i, k in zip(traced.traced, call.out_index):
        leaves[i] = outs[k]
    if not diff or not positions:
        return Element(leaves, traced.tree, [], [], None)
    # The element's differentiable outputs are outputs of the call: cotangents go to those.
    out_avals = call.jaxpr.out_avals
    call_diff = [k for k, aval in enumerate(out_avals) if _differentiable(aval)]
    slot = {k: s for s, k in enumerate(call_diff)}
    number = {i: t for t, i in enumerate(traced.traced)}  # leaf position -> jaxpr output
    targets = [slot[call.out_index[number[i]]] for i in diff]
    compiled = compiled_pullback(call.jaxpr, tuple(positions), tuple(slots))

    def pullback(cotangents: list[Any], totals: list[Any]) -> list[Any]:
        cts: list[Any] = [None] * len(call_diff)
        for s, ct in zip(targets, cotangents):
            cts[s] = ct if cts[s] is None else cts[s] + ct
        for s, k in enumerate(call_diff):
            if cts[s] is None:
                cts[s] = jnp.zeros(out_avals[k].shape, out_avals[k].dtype)
        return compiled(args, cts, totals)  # type: ignore[no-any-return]

    return Element(leaves, traced.tree, diff, tracers, pullback)
