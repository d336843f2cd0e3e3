"""Modules whose parameters ``f`` swaps for others while it runs (``torch.func.functional_call``).

NOTE [parameters swapped by functional_call]:
    ``torch.func.functional_call(model, params, args)`` runs ``model`` with ``params`` in place of
    its own by writing them into the module's parameter and buffer dictionaries, and writing the
    originals back when the call returns. A module is one object for every thread: when chunks
    of one map call it on two threads at once, one thread's forward reads the other's
    parameters (results off by any amount, with no error), and the originals written back may
    be the other thread's swapped-in tensors, so the module keeps functorch's wrappers after the
    map. A plain ``ThreadPoolExecutor`` fails the same way: the race is PyTorch's.

    gradmap makes the swap safe rather than refusing it: on the first map whose chunks may run
    on several threads, it wraps ``torch.nn.utils.stateless._reparametrize_module`` (the context
    that ``torch.func.functional_call`` and ``torch.nn.utils.stateless.functional_call`` swap
    through) so that a thread running a chunk holds one process-wide lock from the swap until
    the originals are back. Outside a chunk the wrapper only calls the original, so the loop
    and the user's own threads see what they would without gradmap. Swapped calls therefore run
    one at a time across chunks: the results and gradients are the loop's, and the parts of
    ``f`` outside the swap still run in parallel. A map called while the lock is held (a
    ``tmap`` inside the swapped module's forward) runs every chunk in its caller's thread
    (``alone``), so no chunk waits for a lock its own caller holds. For parallel swapped calls
    use ``executor="processes"`` (each worker has its own module), or pass the parameters to
    ``f`` and call modules that do not share state across elements.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

from .._engine import alone, on_a_chunk

__all__ = ["guard_parameter_swaps"]

_swapping = threading.RLock()  # held by a chunk's thread while a module's parameters are swapped
_installing = threading.Lock()
os.register_at_fork(after_in_child=_swapping._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]
os.register_at_fork(after_in_child=_installing._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]
_installed = False


def guard_parameter_swaps() -> None:
    """Wrap ``functional_call``'s swap in the lock of NOTE [parameters swapped by
    functional_call], once per process (a later call is one check)."""
    global _installed
    if _installed:
        return
    with _installing:
        if _installed:
            return
        from torch.nn.utils import stateless

        original = getattr(stateless, "_reparametrize_module", None)
        if original is not None and not getattr(original, "_gradmap_guarded", False):
            stateless._reparametrize_module = _guarded(original)
        _installed = True


def _guarded(original: Any) -> Any:
    @contextlib.contextmanager
    @functools.wraps(original)
    def _reparametrize_module(*args: Any, **kwargs: Any) -> Iterator[None]:
        if not on_a_chunk():
            with original(*args, **kwargs):
                yield
            return
        with _swapping, alone(), original(*args, **kwargs):
            yield

    _reparametrize_module._gradmap_guarded = True  # type: ignore[attr-defined]
    return _reparametrize_module
