"""Elements under reverse mode: traced, the tracers they use hoisted, run on their primals.

NOTE [hoisting the tracers an element uses]:
    Under ``jax.grad`` the values being differentiated are tracers of the caller's trace, and a
    worker thread cannot compute with them: its own trace is the top level, where every value
    must be concrete. So a worker first *traces* the element to a jaxpr, with the element's array
    leaves as the jaxpr's inputs, and with the arrays ``f`` closes over as inputs too where it can
    (NOTE [reusing traces across calls] in ``_closure``). Every other value ``f`` reaches becomes a
    constant of the jaxpr: the concrete ones and the caller's tracers alike. Those tracers, the
    closure's tracers and the items that are tracers are the element's *hoisted* inputs: this is
    ``jax.closure_convert`` for arguments and closure at once, with its own cache.

    The worker then evaluates the jaxpr with every hoisted tracer replaced by its concrete primal,
    under ``jax.vjp`` with respect to those primals: the element's outputs, and its pullback
    from output cotangents to cotangents of the hoisted tracers. The pullback stays with the
    element until the join's backward runs it (see ``_rule``; and NOTE [one jitted call, one
    compiled pullback] in ``_compiled`` for the common case of an element that calls one jitted
    function).

    One trace serves every element with the same *signature* -- the structure of its arguments,
    the shape and dtype of their array leaves, and the values of the others (Python scalars,
    strings: constants of the trace, as in the loop) -- within a call, and across calls where
    ``f``'s closure allows (``_closure``). A map over arrays of one shape is traced once; a ragged
    map once per shape. Tracing falls back in steps where ``f`` reads a value it was handed
    abstract (``int(x)``, ``np.asarray(w)``): first ``f`` as it is, its closure concrete (a trace
    for this call only); then the element alone, its items concrete too. Tracing stages every
    operation, even those on concrete values, so ``f`` must be traceable on this path, as under
    ``jax.jit``: a Python branch on a computed array's value raises ``ConcretizationTypeError``,
    and the map then runs as the plain loop instead, where such a branch works as in the loop
    (``_rule`` warns).

    Outputs: a leaf of ``f``'s result that is a traced array of a floating or complex dtype is
    differentiable and becomes an output of the join; integer and boolean arrays are returned as
    concrete values (their tangent is zero in the loop too); leaves that are not traced (Python
    numbers, strings) are returned as ``f`` returned them.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from ._closure import Closure, closure_of, weak_holders
from ._compiled import CompiledCall, Programs, inner_programs, programs, single_call
from ._mode import VjpTrace

__all__ = [
    "UNTRACEABLE",
    "untraceable",
    "Element",
    "ElementRunner",
    "Prepared",
    "Steps",
    "compiled_pullback",
    "steps_of",
]

#: What tracing raises where ``f`` needs a concrete value (a branch, ``int(x)``, ``np.asarray``,
#: a boolean mask); see also [`untraceable`][].
UNTRACEABLE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)

#: Words of JAX's plain ``IndexError`` / ``TypeError`` where a shape or a slice needs a concrete
#: value ("Slice entries must be static integers", "Shapes must be 1D sequences of concrete
#: values of integer type").
_NEEDS_CONCRETE = ("must be static", "concrete value")


def untraceable(exc: BaseException) -> bool:
    """Whether tracing ``f`` raised ``exc`` because ``f`` needs a concrete value (a trip count,
    a shape, a slice, a branch): then the element runs as in the loop. (A real error of ``f``
    that reads so raises again there.)"""
    if isinstance(exc, UNTRACEABLE):
        return True
    return isinstance(exc, (IndexError, TypeError)) and any(w in str(exc) for w in _NEEDS_CONCRETE)


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
            with this element's contribution added; ``None`` when nothing is differentiable or
            the element keeps its gradient instead.
        gradients: for an element that keeps its gradient (NOTE [a loss keeps its gradient]
            in ``_compiled``):
            the gradient of its one differentiable output with respect to each of ``tracers``.
    """

    leaves: list[Any]
    tree: Any
    diff: list[int]
    tracers: list[Any]
    pullback: Callable[[list[Any], list[Any]], list[Any]] | None
    gradients: list[Any] | None = None

    def result(self, leaves: list[Any] | None = None) -> Any:
        """``f``'s result, rebuilt from ``leaves`` (default: the element's own)."""
        return jax.tree_util.tree_unflatten(self.tree, self.leaves if leaves is None else leaves)


def differentiable(aval: Any) -> bool:
    """Whether values of type ``aval`` have tangents (floating or complex)."""
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


# --------------------------------------------------------------------------------------------
# Tracing


def _trace_private(
    fun: Callable[..., list[Any]], avals: list[Any], api: str
) -> tuple[Any, list[Any], list[Any]]:
    from jax._src import api_util
    from jax._src import linear_util as lu
    from jax._src.interpreters import partial_eval as pe

    debug = api_util.debug_info(api, fun, tuple(avals), {})
    jaxpr, out_avals, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fun, debug_info=debug), avals)
    return jaxpr, list(consts), list(out_avals)


def _trace_public(
    fun: Callable[..., list[Any]], avals: list[Any], api: str
) -> tuple[Any, list[Any], list[Any]]:
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    closed = jax.make_jaxpr(fun)(*shapes)
    return closed.jaxpr, list(closed.consts), list(closed.out_avals)


def _choose_trace() -> Callable[
    [Callable[..., list[Any]], list[Any], str], tuple[Any, list[Any], list[Any]]
]:
    """``trace_to_jaxpr_dynamic`` costs about 40% less per trace than ``jax.make_jaxpr``, which
    wraps it; the public one is the fallback for a JAX where the private one moved."""
    try:
        _trace_private(lambda x: [x], [jax.core.ShapedArray((), jnp.float32)], "gradmap")
    except Exception:  # pragma: no cover - a JAX whose internals moved
        return _trace_public
    return _trace_private


_trace = _choose_trace()


def _trace_context() -> Hashable:
    """JAX's settings that a trace depends on (``jax.jit`` keys its caches on them too)."""
    try:
        from jax._src import config

        return config.trace_context()  # type: ignore[no-any-return]
    except (ImportError, AttributeError):  # pragma: no cover - a JAX whose internals moved
        return None


@dataclass(eq=False)  # weakly referenced: the key of its compiled programs
class Traced:
    """``f`` traced for one signature.

    The element's *arguments* are the jaxpr's constants, then its inputs: the closure's arrays
    (``channels``), then the element's array leaves.

    Attributes:
        jaxpr: the jaxpr.
        consts: its constants: concrete, or (in a trace for one call) the caller's tracers.
        channels: for each leading input of the jaxpr, the closure array it is.
        tree: the result's structure.
        leaves: the result's leaves; traced ones are placeholders.
        traced: positions in ``leaves`` of the jaxpr's outputs, in order.
        is_diff: per jaxpr output: of a floating dtype.
        deps: per jaxpr output: bit ``k`` set where it depends on argument ``k``.
        call: the element as one jitted call, or ``None``.
        reusable: holds nothing of this call (may be cached across calls).
    """

    jaxpr: Any
    consts: list[Any]
    channels: list[int]
    tree: Any
    leaves: list[Any]
    traced: list[int]
    is_diff: list[bool]
    deps: list[int]
    call: CompiledCall | None
    reusable: bool
    templates: dict[Any, Any] = field(default_factory=dict)  # kept by ``_sum``: per tracers

    def evaluate(self, *args: Any) -> list[Any]:
        """The jaxpr's outputs for ``args`` (constants, then inputs), op by op."""
        closed = ClosedJaxpr(self.jaxpr, list(args[: len(self.consts)]))
        return jaxpr_as_fun(closed)(*args[len(self.consts) :])  # type: ignore[no-any-return]

    def programs(self) -> Programs:
        """The element's programs: the jitted function's where the element is one call of it;
        else the whole trace's, compiled where the trace is reused across calls, op by op
        where it serves one call."""
        if self.call is not None:
            return inner_programs(self.call.inner)
        jaxpr, n = self.jaxpr, len(self.consts)
        out_avals = [v.aval for v in jaxpr.outvars]

        def body(*args: Any) -> list[Any]:
            closed = ClosedJaxpr(jaxpr, list(args[:n]))
            return jaxpr_as_fun(closed)(*args[n:])  # type: ignore[no-any-return]

        return programs(self, lambda: Programs(body, out_avals, compile=self.reusable))


def _dependencies(jaxpr: Any) -> list[int]:
    """Which arguments (constants, then inputs) each output of ``jaxpr`` depends on, as bit
    masks: an output that depends on no differentiated value is returned concrete, as the loop
    would return it."""
    bits: dict[Any, int] = {v: 1 << k for k, v in enumerate([*jaxpr.constvars, *jaxpr.invars])}
    for eqn in jaxpr.eqns:
        mask = 0
        for v in eqn.invars:
            if not isinstance(v, Literal):
                mask |= bits.get(v, 0)
        for v in eqn.outvars:
            bits[v] = mask
    return [0 if isinstance(v, Literal) else bits.get(v, 0) for v in jaxpr.outvars]


def _keep_args(jaxpr: Any, keep: list[int]) -> Any:
    """``jaxpr``'s debug information for the inputs ``keep`` only."""
    debug = jaxpr.debug_info
    names = getattr(debug, "arg_names", None)
    if names is None or len(names) != len(jaxpr.invars):
        return debug
    return debug._replace(arg_names=tuple(names[k] for k in keep))


def _used(jaxpr: Any) -> set[Any]:
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, Literal)}
    used.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    return used


#: Leaves that are inputs of the trace (abstract); numpy arrays too, so that data loaded as numpy
#: shares traces, while ``f`` may still apply numpy to them (the element is then traced alone).
_VALUES = (int, float, complex, str, bytes, bool, type(None), np.generic)


def _type_key(x: Any) -> Hashable:
    """The type of an array leaf, in a signature (``jax.typeof``, faster)."""
    if isinstance(x, jax.Array):
        return x.aval
    return ("np", x.shape, x.dtype)


def _static_key(x: Any) -> tuple[Hashable, bool]:
    """The key of a non-array item, and whether it is a value (the same in any call)."""
    if isinstance(x, (float, np.floating, complex, np.complexfloating)):
        # 0.0 and -0.0 are equal, but not the same constant; a Python float is weakly typed, an
        # ``np.float64`` (a float too) is not: other result dtypes, other traces
        return ("float", type(x), *_float_bits(x)), True
    if isinstance(x, np.ndarray):  # of strings or objects: no JAX type (``traceable``)
        if x.dtype.kind in "SU":
            return ("np", x.dtype.str, x.shape, x.tobytes()), True
        return ("id", id(x)), False
    if isinstance(x, _VALUES):
        return (type(x), x), True
    try:
        hash(x)
    except TypeError:
        return ("id", id(x)), False
    return (type(x), x), False


#: ``_low_precision``'s answers, by jaxpr (weakly: an entry lives as long as its trace).
_LOW_PRECISION: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _low_precision(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a program inside it) computes a float of fewer than 32 bits."""
    known = _LOW_PRECISION.get(jaxpr)
    if known is None:
        known = _LOW_PRECISION[jaxpr] = _computes_low_precision(jaxpr)
    return known


def _computes_low_precision(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            dtype = getattr(v.aval, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
                return True
        for param in eqn.params.values():
            for inner in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a closed jaxpr's
                if hasattr(inner, "eqns") and _computes_low_precision(inner):
                    return True
    return False


def _float_bits(x: Any) -> tuple[str, ...]:
    """A float's or a complex number's exact value, as hex (-0.0 apart from 0.0, which ``==``
    does not tell)."""
    if isinstance(x, (complex, np.complexfloating)):
        return float(x.real).hex(), float(x.imag).hex()
    return (float(x).hex(),)


def traceable(x: Any) -> bool:
    """Whether ``x`` is an array JAX traces: a JAX array, or a numpy array of numbers or bools
    (not of strings or objects, which ``f`` gets as they are)."""
    if isinstance(x, jax.Array):
        return True
    return isinstance(x, np.ndarray) and x.dtype.kind in "biufc"


# Markers in the caches of traces.
_PER_CALL = object()  # tracing with the closure abstract failed: trace per call
_ALONE = object()  # tracing with the items abstract failed: trace each element alone
_MISSING = object()


class _SharedTraces:
    """The traces of one ``f`` (one closure key) that hold nothing of a call: by signature."""

    MAX_SIGNATURES = 4096  # beyond, new signatures are traced per call

    def __init__(self) -> None:
        self.traces: dict[Hashable, Any] = {}
        self.refs: list[Any] = []  # weak references that drop the entry

    def put(self, key: Hashable, value: Any) -> None:
        if len(self.traces) < self.MAX_SIGNATURES:
            self.traces.setdefault(key, value)


class _TraceCache:
    """Traces reused across calls, by closure key (NOTE [reusing traces across calls])."""

    MAX_FUNCTIONS = 256

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, _SharedTraces] = OrderedDict()
        # Reentrant: a holder may die (and its weak reference call ``_drop``) while ``entry``
        # holds the lock, when a garbage collection runs inside it; a plain lock deadlocked.
        self._lock = threading.RLock()

    def entry(self, closure: Closure) -> _SharedTraces:
        key = closure.key
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
            entry = self._entries[key] = _SharedTraces()
            entry.refs = weak_holders(closure.holders, lambda: self._drop(key))
            while len(self._entries) > self.MAX_FUNCTIONS:
                self._entries.popitem(last=False)
            return entry

    def _drop(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


TRACES = _TraceCache()


@dataclass(slots=True, eq=False)
class _Bound:
    """A trace's constants and closure arrays in this call: concrete values, and the caller's
    tracers among them (by argument position)."""

    fixed: list[Any]
    tracers: dict[int, Any]


@dataclass(slots=True, eq=False)
class Prepared:
    """One element ready to run: its trace, its arguments, what is differentiated.

    Attributes:
        traced: the trace.
        args: the element's arguments (constants, closure arrays, items' arrays), concrete.
        tracers: argument position -> the caller's tracer it stands for (differentiated).
        is_diff: per output of the trace: differentiable and depending on a differentiated
            argument.
    """

    traced: Traced
    args: list[Any]
    tracers: dict[int, Any]
    is_diff: list[bool]


class ElementRunner:
    """Prepares and runs the elements of one map under reverse mode; shared by the threads of
    the forward.

    Traces are cached by signature, within the call and, where ``f``'s closure allows, across
    calls (see NOTE [hoisting the tracers an element uses]).
    """

    def __init__(self, f: Callable[..., Any], trace: VjpTrace, api: str) -> None:
        self._f = f
        self._trace = trace
        self._api = api
        self._closure = closure_of(f, _trace_context())
        self._shared = TRACES.entry(self._closure) if self._closure.key is not None else None
        self._local: dict[Hashable, Any] = {}
        self._bound: dict[Any, _Bound] = {}  # by closure arrays, or by trace
        self._channels: dict[int, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    # -- preparing an element

    def prepare(self, args: tuple[Any, ...]) -> Prepared:
        """Trace (or reuse a trace), hoist the caller's tracers. Call at the top level.

        Raises:
            Whatever ``f`` raises while traced (one of ``UNTRACEABLE`` for a branch on a
            traced value).
        """
        return self.bind(*self.lookup(args))

    def lookup(self, args: tuple[Any, ...]) -> tuple[Traced, list[Any]]:
        """The element's trace (traced now if new), and the element's array leaves."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        if all(isinstance(leaf, jax.Array) for leaf in leaves):  # the common case, quickly
            dynamic = list(range(len(leaves)))
            key: Hashable = (tree, tuple(leaf.aval for leaf in leaves), ())
            stable = True
        else:
            dynamic = [i for i, leaf in enumerate(leaves) if traceable(leaf)]
            statics = [_static_key(leaf) for leaf in leaves if not traceable(leaf)]
            key = (
                tree,
                tuple(_type_key(leaves[i]) for i in dynamic),
                tuple(k for k, _ in statics),
            )
            stable = all(s for _, s in statics)
        traced = _MISSING
        if stable and self._shared is not None:
            traced = self._shared.traces.get(key, _MISSING)
        if traced is _MISSING or traced is _PER_CALL:
            traced = self._local.get(key, _MISSING)
        if traced is _MISSING:
            traced = self._trace_signature(leaves, tree, dynamic, key, stable)
        if traced is _ALONE:  # trace this element alone, its items constants
            return self._trace_with(leaves, tree, [], abstract_closure=False), []
        assert isinstance(traced, Traced)
        return traced, leaves if len(dynamic) == len(leaves) else [leaves[i] for i in dynamic]

    def owns_any(self, inputs: list[Any]) -> bool:
        """Whether any of an element's arrays is a tracer of the caller's trace."""
        owns = self._trace.owns
        return any(owns(x) for x in inputs)

    def bind(self, traced: Traced, inputs: list[Any]) -> Prepared:
        """The element's arguments on ``traced``, and what is differentiated."""
        bound = self._bind(traced)
        values = bound.fixed + inputs
        tracers = bound.tracers
        offset = len(bound.fixed)
        for k, x in enumerate(inputs):
            if self._trace.owns(x):
                values[offset + k] = self._trace.primal(x)
                if differentiable(x.aval):
                    if tracers is bound.tracers:
                        tracers = dict(tracers)
                    tracers[offset + k] = x
        mask = 0
        for p in tracers:
            mask |= 1 << p
        is_diff = [d and bool(deps & mask) for d, deps in zip(traced.is_diff, traced.deps)]
        return Prepared(traced, values, tracers, is_diff)

    def _trace_signature(
        self, leaves: list[Any], tree: Any, dynamic: list[int], key: Hashable, stable: bool
    ) -> Any:
        shared = self._shared if stable else None
        if shared is not None and shared.traces.get(key) is not _PER_CALL:
            try:
                traced = self._trace_with(leaves, tree, dynamic, abstract_closure=True)
            except Exception as exc:
                if not untraceable(exc):
                    raise
                shared.put(key, _PER_CALL)  # ``f`` reads a closure array's value
            else:
                if traced.reusable:
                    shared.put(key, traced)
                else:
                    with self._lock:
                        self._local.setdefault(key, traced)
                return traced
        try:
            result: Any = self._trace_with(leaves, tree, dynamic, abstract_closure=False)
        except Exception as exc:
            if not untraceable(exc):
                raise
            result = _ALONE  # ``f`` reads an item's value
        with self._lock:
            return self._local.setdefault(key, result)

    def _trace_with(
        self, leaves: list[Any], tree: Any, dynamic: list[int], abstract_closure: bool
    ) -> Traced:
        f = self._f
        closure = self._closure
        channels = closure.channels if abstract_closure else []
        count = len(channels)
        found: dict[str, Any] = {}

        def element(*inputs: Any) -> list[Any]:
            fn = closure.rebuild(list(inputs[:count])) if abstract_closure else f
            full = list(leaves)
            for i, x in zip(dynamic, inputs[count:]):
                full[i] = x
            out_leaves, out_tree = jax.tree_util.tree_flatten(
                fn(*jax.tree_util.tree_unflatten(tree, full))
            )
            traced = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, jax.core.Tracer)]
            found["leaves"], found["tree"], found["traced"] = out_leaves, out_tree, traced
            return [out_leaves[i] for i in traced]

        owns, primal = self._trace.owns, self._trace.primal
        avals = [
            jax.typeof(primal(x) if owns(x) else x)
            for x in [*channels, *(leaves[i] for i in dynamic)]
        ]
        jaxpr, consts, out_avals = _trace(element, avals, self._api)
        kept = list(range(count))
        if count:  # drop the closure arrays this signature does not use
            used = _used(jaxpr)
            kept = [k for k in range(count) if jaxpr.invars[k] in used]
            if len(kept) < count:
                keep = kept + list(range(count, len(jaxpr.invars)))
                jaxpr = jaxpr.replace(
                    invars=[jaxpr.invars[k] for k in keep], debug_info=_keep_args(jaxpr, keep)
                )
        out_leaves = list(found["leaves"])
        for i in found["traced"]:
            out_leaves[i] = None  # placeholders: the worker's tracers must not outlive the trace
        reusable = abstract_closure and not any(
            isinstance(x, jax.Array) for x in [*consts, *out_leaves]
        )
        return Traced(
            jaxpr,
            consts,
            kept,
            found["tree"],
            out_leaves,
            found["traced"],
            [differentiable(aval) for aval in out_avals],
            _dependencies(jaxpr),
            single_call(jaxpr),
            reusable,
        )

    def fixed(self, traced: Traced) -> tuple[list[Any], dict[int, Any]]:
        """The trace's fixed arguments (constants, closure arrays) in this call, concrete, and
        the caller's tracers among them (by position)."""
        bound = self._bind(traced)
        return bound.fixed, bound.tracers

    def _bind(self, traced: Traced) -> _Bound:
        # Traces whose fixed arguments are the same closure arrays share them.
        key: Any = tuple(traced.channels) if not traced.consts else traced
        bound = self._bound.get(key)
        if bound is not None:
            return bound
        owns, primal = self._trace.owns, self._trace.primal
        fixed: list[Any] = []
        tracers: dict[int, Any] = {}
        for x in traced.consts:
            if owns(x):
                if differentiable(x.aval):
                    tracers[len(fixed)] = x
                x = primal(x)
            fixed.append(x)
        for k in traced.channels:
            value, tracer = self._channel(k)
            if tracer is not None:
                tracers[len(fixed)] = tracer
            fixed.append(value)
        bound = _Bound(fixed, tracers)
        with self._lock:
            return self._bound.setdefault(key, bound)

    def _channel(self, k: int) -> tuple[Any, Any]:
        """Closure array ``k`` in this call: its concrete value (numpy arrays moved to the
        device once), and the caller's tracer if it is one being differentiated."""
        entry = self._channels.get(k)
        if entry is None:
            x = self._closure.channels[k]
            if self._trace.owns(x):
                entry = (self._trace.primal(x), x if differentiable(x.aval) else None)
            elif isinstance(x, np.ndarray):
                entry = (jnp.asarray(x), None)
            else:
                entry = (x, None)
            self._channels[k] = entry
        return entry

    # -- running an element (``tmap``)

    def run(self, args: tuple[Any, ...], n: int) -> Element:
        """Prepare the element (one of ``n``) and run it on its primals under ``jax.vjp``. Call
        at the top level.

        Raises:
            Whatever ``f`` raises while traced (one of ``UNTRACEABLE`` for a branch on a
            traced value), or while the traced element runs.
        """
        element = self.prepare(args)
        traced = element.traced
        leaves = list(traced.leaves)
        diff = [i for i, d in zip(traced.traced, element.is_diff) if d]
        if traced.call is not None:
            if len(diff) == 1:
                steps = steps_of(element)
                if steps.loss is not None:
                    tracers, slots = unique_tracers(element.tracers, steps.sources)
                    if n * sum(math.prod(t.shape) for t in tracers) <= STORED_GRADIENTS:
                        try:
                            return _run_stored(element, steps, tracers, slots, leaves, diff)
                        except Exception:
                            pass  # perhaps the backward: raise it in the backward pass (below)
            return _run_call(element, leaves, diff)
        if not diff:
            for i, out in zip(traced.traced, traced.evaluate(*element.args)):
                leaves[i] = out
            return Element(leaves, traced.tree, [], [], None)

        # Differentiate with respect to the arguments that stand for tracers.
        positions = list(element.tracers)
        values = element.args
        is_diff = element.is_diff

        def run(*primals: Any) -> tuple[list[Any], list[Any]]:
            full = list(values)
            for k, p in zip(positions, primals):
                full[k] = p
            outs = traced.evaluate(*full)
            return [o for o, d in zip(outs, is_diff) if d], [
                o for o, d in zip(outs, is_diff) if not d
            ]

        diff_outs, vjp, other_outs = jax.vjp(run, *(values[k] for k in positions), has_aux=True)
        for i, out in zip(diff, diff_outs):
            leaves[i] = out
        for i, out in zip((i for i, d in zip(traced.traced, is_diff) if not d), other_outs):
            leaves[i] = out
        tracers, slots = unique_tracers(element.tracers, positions)

        def pullback(cotangents: list[Any], totals: list[Any]) -> list[Any]:
            new = list(totals)
            for s, g in zip(slots, vjp(cotangents)):
                new[s] = new[s] + g
            return new

        return Element(leaves, traced.tree, diff, tracers, pullback)


@dataclass(eq=False)
class Steps:
    """How an element runs as compiled programs (``Programs``): their arguments, the
    differentiated ones, which outputs are the element's and which are differentiated.

    Attributes:
        programs: the programs.
        args: their arguments.
        positions: among ``args``, those that stand for the caller's tracers.
        sources: the same, as positions among the element's arguments.
        out_index: per traced result leaf (the trace's outputs), the programs' output.
        p_avals: the programs' outputs' types.
        diff: the traced result leaves (by number) that are differentiated.
        loss: the one, if it is the only one and a real 0-d array.
    """

    programs: Programs
    args: list[Any]
    positions: list[int]
    sources: list[int]
    out_index: tuple[int, ...]
    p_avals: list[Any]
    diff: list[int]
    loss: int | None


def steps_of(element: Prepared) -> Steps:
    """How ``element`` runs as compiled programs (op by op for a trace of one call)."""
    traced = element.traced
    call = traced.call
    if call is not None:
        args, positions = call_arguments(element)
        sources: list[int] = [call.sources[k] for k in positions]  # type: ignore[misc]
        out_index = tuple(call.out_index)
        p_avals = list(call.inner.out_avals)
    else:
        args = element.args
        positions = list(element.tracers)
        sources = positions
        out_index = tuple(range(len(traced.traced)))
        p_avals = [v.aval for v in traced.jaxpr.outvars]
    diff = [u for u, d in enumerate(element.is_diff) if d] if positions else []
    loss = None
    if len(diff) == 1:
        aval = p_avals[out_index[diff[0]]]
        # A real 0-d loss computed in 32 bits or more: its gradient taken with cotangent one and
        # scaled later is the loop's. Computed in float16 or bfloat16 anywhere, it underflows or
        # overflows before the scale (loss scaling: ``tsum(...) * 4096``), where the loop's
        # backward carries the scaled cotangent: such an element keeps its pullback.
        if (
            aval.shape == ()
            and not jnp.issubdtype(aval.dtype, jnp.complexfloating)
            and not _low_precision(traced.jaxpr)
        ):
            loss = diff[0]
    return Steps(traced.programs(), args, positions, sources, out_index, p_avals, diff, loss)


def unique_tracers(tracers: dict[int, Any], positions: list[int]) -> tuple[list[Any], list[int]]:
    """The distinct tracers at ``positions`` (a tracer may stand at several), and for each
    position the index of its tracer among them."""
    unique: list[Any] = []
    slot_of: dict[int, int] = {}
    slots = []
    for p in positions:
        t = tracers[p]
        s = slot_of.get(id(t))
        if s is None:
            s = slot_of[id(t)] = len(unique)
            unique.append(t)
        slots.append(s)
    return unique, slots


def call_arguments(element: Prepared) -> tuple[list[Any], list[int]]:
    """For an element that is one jitted call: the call's arguments, and the positions among
    them of those that stand for the caller's tracers."""
    call = element.traced.call
    assert call is not None
    args: list[Any] = []
    positions: list[int] = []
    for k, source in enumerate(call.sources):
        if isinstance(source, Literal):
            args.append(source.val)
            continue
        args.append(element.args[source])
        if source in element.tracers:
            positions.append(k)
    return args, positions


#: The most gradient values a map keeps (NOTE [a loss keeps its gradient] in ``_compiled``):
#: 256 MB of float32.
STORED_GRADIENTS = 1 << 26


def _run_stored(
    element: Prepared,
    steps: Steps,
    tracers: list[Any],
    slots: list[int],
    leaves: list[Any],
    diff: list[int],
) -> Element:
    """An element that is one jitted call with a loss: its outputs and its gradient, in one
    compiled call. See NOTE [a loss keeps its gradient] in ``_compiled``."""
    assert steps.loss is not None
    traced = element.traced
    program = steps.programs.value_and_grad(
        tuple(steps.positions), tuple(slots), steps.out_index[steps.loss]
    )
    outs, gradients = program(steps.args)
    for i, k in zip(traced.traced, steps.out_index):
        leaves[i] = outs[k]
    return Element(leaves, traced.tree, diff, tracers, None, gradients)


def _run_call(element: Prepared, leaves: list[Any], diff: list[int]) -> Element:
    """An element that is one plain ``jit`` call: a compiled forward, and a compiled, cached
    pullback. See NOTE [one jitted call, one compiled pullback]."""
    traced = element.traced
    call = traced.call
    assert call is not None
    args, positions = call_arguments(element)
    programs = inner_programs(call.inner)
    outs = programs.forward(*args)
    for i, k in zip(traced.traced, call.out_index):
        leaves[i] = outs[k]
    if not diff or not positions:
        return Element(leaves, traced.tree, [], [], None)
    sources = [call.sources[k] for k in positions]
    tracers, slots = unique_tracers(element.tracers, sources)  # type: ignore[arg-type]
    # The element's differentiable outputs are outputs of the call: cotangents go to those.
    out_avals = call.inner.out_avals
    call_diff = [k for k, aval in enumerate(out_avals) if differentiable(aval)]
    slot = {k: s for s, k in enumerate(call_diff)}
    number = {i: t for t, i in enumerate(traced.traced)}  # leaf position -> jaxpr output
    targets = [slot[call.out_index[number[i]]] for i in diff]
    compiled = programs.pullback(tuple(positions), tuple(slots))
    pullback = compiled_pullback(compiled, args, targets, [out_avals[k] for k in call_diff])
    return Element(leaves, traced.tree, diff, tracers, pullback)


def compiled_pullback(
    compiled: Callable[..., Any], args: list[Any], targets: list[int], avals: list[Any]
) -> Callable[[list[Any], list[Any]], list[Any]]:
    """``pullback(cotangents, totals)`` of an element whose differentiable outputs are outputs
    of a compiled program: the element's cotangents added per program output (``targets[i]``
    for its i-th), zeros of that output's type (``avals``) where none came, then
    ``compiled(args, cotangents, totals)`` (``Programs.pullback``)."""

    def pullback(cotangents: list[Any], totals: list[Any]) -> list[Any]:
        cts: list[Any] = [None] * len(avals)
        for s, ct in zip(targets, cotangents):
            cts[s] = ct if cts[s] is None else cts[s] + ct
        for s, aval in enumerate(avals):
            if cts[s] is None:
                cts[s] = jnp.zeros(aval.shape, aval.dtype)
        return compiled(args, cts, totals)  # type: ignore[no-any-return]

    return pullback
