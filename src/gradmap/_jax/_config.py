"""JAX's thread-local configuration, carried from the caller into the workers.

JAX's context managers (``jax.enable_x64``, ``jax.default_matmul_precision``,
``jax.numpy_rank_promotion``, ``jax.default_device``, meshes, ...) set thread-local values that a
worker thread would not see: ``f`` would run under the global settings instead of the caller's. A
[`JaxConfig`][] captures the caller's thread-local values when a pass starts and every helper
thread runs its chunks under them, as the torch adapter carries grad mode and autocast. The trace
itself is not among them: a worker always starts at the top level (see NOTE [three ways to run
the map] in ``_mode``).

The values are also part of the key of ``jax.jit``'s caches: a worker that ran under other
values than the caller would compile every program again (JAX's backward pass, for one, sets an
abstract mesh that the forward pass does not). So each pass captures the values anew: the
forward when the map starts, the backward when the join's backward starts.

The values live in ``jax._src.config`` (``config_states`` and the context managers beside them);
where that is missing, nothing is carried.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

__all__ = ["JaxConfig"]


def _states() -> tuple[list[Any], Any]:
    """JAX's thread-local settings: the options, and the context managers beside them (meshes,
    default device, ...); not the trace, which lives in ``jax._src.core``."""
    try:
        from jax._src import config

        states = list(config.config_states.values())
        states += [
            value
            for value in vars(config).values()
            if isinstance(value, config.config_ext.Config) and not isinstance(value, config.State)
        ]
        return states, config.config_ext.unset
    except (ImportError, AttributeError):  # pragma: no cover - a JAX whose internals moved
        return [], None


class JaxConfig:
    """The caller's thread-local JAX settings, to be entered by helper threads."""

    def __init__(self) -> None:
        states, unset = _states()
        self._unset = unset
        self._values: list[tuple[Any, Any]] = []
        for state in states:
            try:
                value = state.get_local()
            except AttributeError:  # pragma: no cover
                continue
            if value is not unset:
                self._values.append((state, value))

    def enter(self, is_caller: bool) -> AbstractContextManager[object]:
        """The context a thread enters around its chunks (``run_chunks``'s ``context``)."""
        if is_caller or not self._values:
            return nullcontext()
        return self._applied()

    @contextmanager
    def _applied(self) -> Iterator[None]:
        previous = []
        try:
            for state, value in self._values:
                previous.append((state, state.swap_local(value)))
                hook = getattr(state, "_update_thread_local_hook", None)
                if hook is not None:
                    hook(value)
            yield
        finally:
            for state, value in reversed(previous):
                state.set_local(value)
                hook = getattr(state, "_update_thread_local_hook", None)
                if hook is not None:
                    hook(None if value is self._unset else value)
