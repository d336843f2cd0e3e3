"""Compiled programs for elements: a forward, pullbacks, and the steps of a sum.

Why this file exists: measured (NOTE [one jitted call, one compiled pullback]): 2 ms -> 0.13 ms.

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

NOTE [a sum's element is one compiled step]:
    ``tsum`` knows the cotangent of every element's result before the backward pass starts, up
    to a factor: all elements feed one sum, so the cotangent of an element's 0-d loss is the
    sum's cotangent, whatever it turns out to be, and the element's pullback is linear in it.
    So each element runs as one compiled *step*: ``jax.value_and_grad`` of its 0-d result with
    respect to the differentiated arguments, adding the value to the chunk's running totals and
    the gradient to the chunk's running gradients, in one XLA call (the loop of jitted
    ``value_and_grad`` calls a user writes, without the eager additions between them). The
    backward pass only adds the chunks' gradients in chunk order and scales them by the
    cotangent (exact when it is one, as under ``jax.grad``). Results that are not one real 0-d
    array per element take a forward step (totals only) and the pullback above. Measured
    (``gradmap bench --jax``, ragged bags, N=256, 2 cores, jax 0.10.2): ``tsum`` about 1.05x the
    loop of per-bag jitted ``value_and_grad`` calls, ``tmap`` and a sum 0.60x.

NOTE [a loss keeps its gradient]:
    ``tmap``'s elements have cotangents of their own, unknown until the backward pass; but an
    element whose one differentiable output is a real 0-d array (a loss, the common case) has a
    pullback that is its gradient times that cotangent. Such an element runs, in the forward,
    as one compiled ``jax.value_and_grad`` call -- what the loop of jitted ``value_and_grad``
    calls does -- and keeps its gradient; the backward pass multiplies each by its cotangent
    and adds them, one compiled call per chunk, instead of recomputing the forward in a
    pullback per element. That is a quarter less compute, and no Python per element in the
    backward. It holds one gradient per element (the size of the arrays it is differentiated
    with respect to: the parameters) until the backward pass, so a map does it only while
    ``n`` times that size is at most ``STORED_GRADIENTS`` (``_element``); beyond, its elements
    take the compiled pullback above. The choice depends on ``n`` and the shapes only, so the
    gradients are bitwise the same for any number of workers.

Programs are cached per *owner* (weakly): an inner jaxpr of a jitted function, shared by every
element and every call that calls it with those shapes; or a trace of ``f`` that is reused
across calls (NOTE [reusing traces across calls] in ``_closure``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, jaxpr_as_fun
from jax.extend.core import primitives as _primitives

__all__ = ["CompiledCall", "Programs", "programs", "single_call"]

_jit_p = getattr(_primitives, "jit_p", None) or getattr(_primitives, "pjit_p", None)


class CompiledCall:
    """An element whose jaxpr is one call ``outs = jit_p[inner](*args)``.

    Attributes:
        inner: the called (closed) jaxpr.
        sources: for each argument of the call, its position among the element's arguments
            (the trace's constants, then its inputs), or a ``Literal``.
        out_index: for each output of the element, the output of the call it is.
    """

    def __init__(self, inner: Any, sources: list[int | Literal], out_index: list[int]) -> None:
        self.inner = inner
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
    """The element as one plain ``jit`` call, if its jaxpr is just that; else ``None``.

    The element's arguments are ``jaxpr``'s constants, then its inputs."""
    if len(jaxpr.eqns) != 1:
        return None
    eqn = jaxpr.eqns[0]
    if eqn.primitive is not _jit_p or not _plain(eqn):
        return None
    position = {id(v): k for k, v in enumerate([*jaxpr.constvars, *jaxpr.invars])}
    sources: list[int | Literal] = []
    for v in eqn.invars:
        if isinstance(v, Literal):
            sources.append(v)
        elif id(v) in position:
            sources.append(position[id(v)])
        else:  # pragma: no cover - a jaxpr of one equation has no other variables
            return None
    outs = {id(v): k for k, v in enumerate(eqn.outvars)}
    out_index = []
    for v in jaxpr.outvars:
        k = outs.get(id(v))
        if k is None:  # an output that is an input or a literal
            return None
        out_index.append(k)
    return CompiledCall(eqn.params["jaxpr"], sources, out_index)


class Programs:
    """The compiled programs of one function of a flat list of arrays.

    Arguments:
        body: ``body(*args)``: the list of outputs. It must not refer to the owner strongly.
        out_avals: the outputs' types.
        compile: ``False`` for the same programs run op by op (a trace used for one call only,
            not worth a compilation).
    """

    def __init__(
        self, body: Callable[..., list[Any]], out_avals: Sequence[Any], compile: bool = True
    ) -> None:
        self._body = body
        self._float = [k for k, aval in enumerate(out_avals) if _inexact(aval)]
        self._lock = threading.Lock()
        self._jit: Callable[[Any], Any] = jax.jit if compile else (lambda fun: fun)
        self.forward: Callable[..., list[Any]] = self._jit(body)
        self._pullbacks: dict[Any, Callable[..., Any]] = {}
        self._steps: dict[Any, Callable[..., Any]] = {}
        self._gradients: dict[Any, Callable[..., Any]] = {}

    def pullback(
        self, positions: tuple[int, ...], slots: tuple[int, ...]
    ) -> Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], list[Any]]:
        """``pullback(args, cotangents, totals)``: ``totals`` (one per slot) plus the cotangents
        of ``args[positions]`` (``positions[i]`` adding to ``totals[slots[i]]``), for cotangents
        of the floating outputs (in order); it recomputes the forward. One ``jax.jit``, cached.
        """
        return self._cached(self._pullbacks, (positions, slots), self._build_pullback)

    def step(
        self,
        positions: tuple[int, ...],
        slots: tuple[int, ...],
        out_index: tuple[int, ...],
        loss: int | None,
    ) -> Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], tuple[list[Any], list[Any]]]:
        """``step(args, totals, grads)``: ``totals[t] + outs[out_index[t]]`` for each ``t``, and,
        when ``loss`` is an output (a real 0-d one), ``grads`` (one per slot) plus the gradient of
        that output with respect to ``args[positions]`` (``positions[i]`` adding to
        ``grads[slots[i]]``). See NOTE [a sum's element is one compiled step]. One ``jax.jit``,
        cached."""
        return self._cached(self._steps, (positions, slots, out_index, loss), self._build_step)

    def value_and_grad(
        self, positions: tuple[int, ...], slots: tuple[int, ...], loss: int
    ) -> Callable[[Sequence[Any]], tuple[list[Any], list[Any]]]:
        """``value_and_grad(args)``: the outputs, and the gradient of output ``loss`` (a real
        0-d one) with respect to ``args[positions]``, added up per slot (``positions[i]`` to
        slot ``slots[i]``). See NOTE [a loss keeps its gradient]. One ``jax.jit``, cached."""
        return self._cached(self._gradients, (positions, slots, loss), self._build_value_and_grad)

    def _cached(
        self, table: dict[Any, Callable[..., Any]], key: Any, build: Callable[[Any], Any]
    ) -> Any:
        """``table[key]``, ``build(key)`` (under the lock, once) on first use."""
        program = table.get(key)
        if program is None:
            with self._lock:
                program = table.setdefault(key, build(key))
        return program

    def _build_value_and_grad(self, key: tuple[tuple[int, ...], tuple[int, ...], int]) -> Any:
        positions, slots, loss = key
        body = self._body
        count = max(slots) + 1

        @self._jit
        def value_and_grad(args: list[Any]) -> tuple[list[Any], list[Any]]:
            outs, gs = _outputs_and_grads(body, args, positions, loss)
            grads: list[Any] = [None] * count
            for s, g in zip(slots, gs):
                grads[s] = g if grads[s] is None else grads[s] + g
            return outs, grads

        return value_and_grad

    def _build_pullback(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
        positions, slots = key
        body, floats = self._body, self._float

        @self._jit
        def pullback(args: list[Any], cotangents: list[Any], totals: list[Any]) -> list[Any]:
            def float_outputs(*primals: Any) -> list[Any]:
                outs = body(*_with_primals(args, positions, primals))
                return [outs[k] for k in floats]

            _, vjp = jax.vjp(float_outputs, *(args[k] for k in positions))
            new = list(totals)
            for s, g in zip(slots, vjp(list(cotangents))):
                new[s] = new[s] + g
            return new

        return pullback

    def _build_step(
        self, key: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int | None]
    ) -> Any:
        positions, slots, out_index, loss = key
        body = self._body

        @self._jit
        def step(args: list[Any], totals: list[Any], grads: list[Any]) -> Any:
            if loss is None:
                outs = body(*args)
                new_grads = list(grads)
            else:
                outs, gs = _outputs_and_grads(body, args, positions, loss)
                new_grads = list(grads)
                for s, g in zip(slots, gs):
                    new_grads[s] = new_grads[s] + g
            return [t + outs[k] for t, k in zip(totals, out_index)], new_grads

        return step


def _with_primals(args: list[Any], positions: Sequence[int], primals: Sequence[Any]) -> list[Any]:
    """``args`` with ``primals`` at ``positions``: the arguments a program differentiates at."""
    full = list(args)
    for k, p in zip(positions, primals):
        full[k] = p
    return full


def _outputs_and_grads(
    body: Callable[..., Any], args: list[Any], positions: Sequence[int], loss: int
) -> tuple[list[Any], tuple[Any, ...]]:
    """Inside a program being traced: ``body(*args)``'s outputs, and the gradient of output
    ``loss`` with respect to each of ``args[positions]``."""

    def value(*primals: Any) -> tuple[Any, list[Any]]:
        outs = body(*_with_primals(args, positions, primals))
        return outs[loss], outs

    argnums = tuple(range(len(positions)))
    (_, outs), gs = jax.value_and_grad(value, argnums=argnums, has_aux=True)(
        *(args[k] for k in positions)
    )
    return outs, gs


def _inexact(aval: Any) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


_cache: weakref.WeakKeyDictionary[Any, Programs] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def programs(owner: Any, make: Callable[[], Programs]) -> Programs:
    """The programs cached for ``owner`` (weakly): made by ``make()`` on first use."""
    entry = _cache.get(owner)
    if entry is None:
        with _cache_lock:
            entry = _cache.get(owner)
            if entry is None:
                entry = _cache[owner] = make()
    return entry


def inner_programs(inner: Any) -> Programs:
    """The programs of a jitted function's inner (closed) jaxpr, cached on it."""

    def make() -> Programs:
        ref = weakref.ref(inner)

        def body(*args: Any) -> list[Any]:
            closed = ref()
            assert closed is not None, "traced only while the jaxpr is in use"
            return jaxpr_as_fun(closed)(*args)  # type: ignore[no-any-return]

        return Programs(body, inner.out_avals)

    return programs(inner, make)
