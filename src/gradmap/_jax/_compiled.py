"""Compiled pullbacks for an element that is one call of a jitted function.

NOTE [one jitted call, one compiled pullback]:
    Evaluating an element's jaxpr under ``jax.vjp`` in a worker costs Python per operation --
    about 2 ms per element for a call of a jitted MLP on a bag (jax 0.10.2, 2 cores), most of it
    holding the GIL, against 0.13 ms for ``jax.jit(jax.value_and_grad(loss))``. When the traced
    element is a single ``jit`` equation (``f`` calls one jitted function, the common and the
    recommended case), its inner jaxpr is the jitted function's own, the same object every time
    the function is traced with the same shapes. So the element runs as two compiled calls:

    - the forward is a ``jax.jit`` of the inner jaxpr (evaluating the equation as it stands
      costs 0.1 ms more per element in Python; the extra ``jit`` compiles what the equation
      would have compiled, once per shape);
    - the pullback is a ``jax.jit`` of ``jax.vjp`` of the inner jaxpr, with respect to the
      arguments that are hoisted tracers, cached per inner jaxpr (weakly) and argument positions.
      It *recomputes* the forward inside the compiled program rather than keeping residuals: a
      compiled program's residuals come back as a pytree whose structure is only known inside
      the trace, and passing that structure back in falls off jit's fast path (measured 0.36 ms
      per call against 0.27 ms recomputing). Recomputation also keeps no activations between the
      passes: a map holds its items and outputs only, less than the loop holds.

    The compiled pullback is XLA's, so it releases the GIL and the pullbacks of several elements
    run at once. Equations with shardings, layouts, donation, compiler options or effects take
    the general path (``jax.vjp`` of the jaxpr).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, jaxpr_as_fun

__all__ = ["CompiledCall", "compiled_forward", "compiled_pullback", "single_call"]

from jax.extend.core import primitives as _primitives

_jit_p = getattr(_primitives, "jit_p", None) or getattr(_primitives, "pjit_p", None)


class CompiledCall:
    """An element that is one call ``outs = jit_p[jaxpr](*args)``.

    Attributes:
        eqn: the equation.
        jaxpr: the called (closed) jaxpr.
        sources: for each argument of the call, where it comes from: ``("input", k)`` the
            element's k-th input, ``("const", j)`` its j-th constant, ``("literal", -1)``.
        out_index: for each output of the element, the equation output it is.
    """

    def __init__(self, eqn: Any, sources: list[tuple[str, int]], out_index: list[int]) -> None:
        self.eqn = eqn
        self.jaxpr = eqn.params["jaxpr"]
        self.sources = sources
        self.out_index = out_index


def _plain(eqn: Any) -> bool:
    params = eqn.params
    unspecified = all(
        type(s).__name__ == "UnspecifiedValue"
        for s in (*params.get("in_shardings", ()), *params.get("out_shardings", ()))
    )
    return (
        unspecified
        and all(layout is None for layout in params.get("in_layouts", ()))
        and all(layout is None for layout in params.get("out_layouts", ()))
        and not any(params.get("donated_invars", ()))
        and not params.get("compiler_options_kvs", ())
        and not params["jaxpr"].effects
    )


def single_call(jaxpr: Any) -> CompiledCall | None:
    """The element as one plain ``jit`` call, if its jaxpr is just that; else ``None``."""
    if len(jaxpr.eqns) != 1:
        return None
    eqn = jaxpr.eqns[0]
    if eqn.primitive is not _jit_p or not _plain(eqn):
        return None
    inputs = {id(v): k for k, v in enumerate(jaxpr.invars)}
    consts = {id(v): j for j, v in enumerate(jaxpr.constvars)}
    sources: list[tuple[str, int]] = []
    for v in eqn.invars:
        if isinstance(v, Literal):
            sources.append(("literal", -1))
        elif id(v) in inputs:
            sources.append(("input", inputs[id(v)]))
        elif id(v) in consts:
            sources.append(("const", consts[id(v)]))
        else:  # pragma: no cover - a jaxpr of one equation has no other variables
            return None
    position = {id(v): k for k, v in enumerate(eqn.outvars)}
    out_index = []
    for v in jaxpr.outvars:
        k = position.get(id(v))
        if k is None:  # an output that is an input or a literal
            return None
        out_index.append(k)
    return CompiledCall(eqn, sources, out_index)


class _Programs:
    """The compiled forward of one jaxpr and its pullbacks, by differentiated positions.

    The programs refer to the jaxpr weakly: the cache is keyed weakly on it, and a strong
    reference from a value would keep every entry alive."""

    def __init__(self, closed: Any) -> None:
        ref = weakref.ref(closed)

        def forward(*args: Any) -> list[Any]:
            return jaxpr_as_fun(_alive(ref))(*args)  # type: ignore[no-any-return]

        self.forward: Callable[..., list[Any]] = jax.jit(forward)
        self.pullbacks: dict[tuple[tuple[int, ...], tuple[int, ...]], Callable[..., Any]] = {}


_cache: weakref.WeakKeyDictionary[Any, _Programs] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _programs(closed: Any) -> _Programs:
    entry = _cache.get(closed)
    if entry is None:
        with _cache_lock:
            entry = _cache.get(closed)
            if entry is None:
                entry = _cache[closed] = _Programs(closed)
    return entry


def compiled_forward(closed: Any) -> Callable[..., list[Any]]:
    """``forward(*args)``: the jaxpr's outputs; one ``jax.jit``, cached."""
    return _programs(closed).forward


def compiled_pullback(
    closed: Any, positions: tuple[int, ...], slots: tuple[int, ...]
) -> Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], list[Any]]:
    """``pullback(args, cotangents, totals)``: ``totals`` (one per slot) plus the cotangents of
    ``args[positions]`` (``positions[i]`` adding to ``totals[slots[i]]``), for cotangents of the
    jaxpr's floating outputs (in order); it recomputes the forward. One ``jax.jit``, cached.
    """
    entry = _programs(closed)
    key = (positions, slots)
    pullback = entry.pullbacks.get(key)
    if pullback is None:
        with _cache_lock:
            pullback = entry.pullbacks.get(key)
            if pullback is None:
                pullback = entry.pullbacks[key] = _build(closed, positions, slots)
    return pullback


def _alive(ref: weakref.ref[Any]) -> Any:
    closed = ref()
    assert closed is not None, "traced only while the jaxpr is in use"
    return closed


def _build(closed: Any, positions: tuple[int, ...], slots: tuple[int, ...]) -> Callable[..., Any]:
    ref = weakref.ref(closed)
    is_diff = [bool(jnp.issubdtype(aval.dtype, jnp.inexact)) for aval in closed.out_avals]

    @jax.jit
    def pullback(args: list[Any], cotangents: list[Any], totals: list[Any]) -> list[Any]:
        def diff_outputs(*primals: Any) -> list[Any]:
            full = list(args)
            for k, p in zip(positions, primals):
                full[k] = p
            return [o for o, d in zip(jaxpr_as_fun(_alive(ref))(*full), is_diff) if d]

        _, vjp = jax.vjp(diff_outputs, *(args[k] for k in positions))
        new = list(totals)
        for s, g in zip(slots, vjp(list(cotangents))):
            new[s] = new[s] + g
        return new

    return pullback
