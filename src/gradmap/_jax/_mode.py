"""Which JAX transformation is active where ``tmap`` is called, and so how the map runs.

NOTE [three ways to run the map]:
    JAX's transformations are traces, and the current trace is thread-local: a worker thread
    starts at the top level, where every value must be concrete. What a worker may do therefore
    depends on the trace ``tmap`` is called under.

    - ``EAGER`` (no transformation): items and closed-over arrays are concrete, so ``f`` itself
      runs on the workers, in chunks, exactly as the builtin ``map`` would call it.
    - ``VJP`` (``jax.grad``, ``jax.vjp``, ``jax.value_and_grad``, ``jax.jacrev`` ... directly
      over concrete values: a vjp-mode ``LinearizeTrace`` whose parent is the top level): each
      differentiated value is a tracer wrapping a concrete primal. The workers trace each
      element and hoist those tracers out of it, run it on the primals with ``jax.vjp``, and one
      ``custom_vjp`` join node hands the outputs to the caller's trace; its backward runs the
      element pullbacks in chunks on the workers (see ``_rule``).
    - ``LOOP`` (anything else: ``jax.jit``, ``vmap``, ``jvp``, ``linearize``, ``checkpoint``,
      nested differentiation such as ``jax.hessian`` or grad-of-grad, named axes): the map is the
      plain loop ``[f(*args) for args in elements]`` in the caller's thread, under the caller's
      trace, so every transformation sees what it would see in the loop and composes as it
      would. Under ``jax.jit`` this is the traced loop: the compiled program has no Python and
      no GIL left to parallelise (see NOTE [under jit, the traced loop] in ``_map``).

    Telling the traces apart uses JAX internals (``jax._src.core.trace_ctx``,
    ``LinearizeTrace``), all in this module. Where they are missing or changed, the mode is
    ``LOOP``: correct, in one thread.
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager, nullcontext
from typing import Any

__all__ = ["Mode", "VjpTrace", "current_mode", "top_level"]


class Mode(enum.Enum):
    """How a map runs; see NOTE [three ways to run the map]."""

    EAGER = "eager"
    VJP = "vjp"
    LOOP = "loop"


class VjpTrace:
    """The caller's reverse-mode trace: recognises its tracers and reads their primals."""

    def __init__(self, trace: Any, tracer_type: type) -> None:
        self._trace = trace
        self._tracer_type = tracer_type

    def owns(self, x: Any) -> bool:
        """Whether ``x`` is a tracer of this trace (a value being differentiated)."""
        return isinstance(x, self._tracer_type) and getattr(x, "_trace", None) is self._trace

    @staticmethod
    def primal(x: Any) -> Any:
        """The concrete value a tracer of this trace wraps."""
        return x.primal


def current_mode() -> tuple[Mode, VjpTrace | None]:
    """The mode for a map called now in this thread, and the reverse-mode trace for ``VJP``."""
    try:
        from jax._src import core
        from jax._src.interpreters import ad

        if core.trace_state_clean():
            return Mode.EAGER, None
        trace = core.trace_ctx.trace
        if (
            isinstance(trace, ad.LinearizeTrace)
            and trace.is_vjp
            and isinstance(trace.parent_trace, core.EvalTrace)
            and not core.nonempty_axis_env()
        ):
            return Mode.VJP, VjpTrace(trace, ad.LinearizeTracer)
    except (ImportError, AttributeError):  # pragma: no cover - a JAX whose internals moved
        pass
    return Mode.LOOP, None


def top_level() -> AbstractContextManager[object]:
    """Run at the top level (no trace) in this thread until the block ends: what a worker
    thread starts with, and what the caller's thread needs while it works on chunks itself."""
    try:
        from jax._src.core import take_current_trace
    except ImportError:  # pragma: no cover - a JAX whose internals moved (no VJP mode there)
        return nullcontext()
    return take_current_trace()  # type: ignore[no-any-return]
