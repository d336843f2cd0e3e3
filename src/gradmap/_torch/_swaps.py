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
from collections.abc import Callable, Iterator
from typing import Any

from torch.nn.utils import stateless

from .._engine import alone, on_a_chunk

__all__ = ["guard_parameter_swaps", "wrap_once"]

_swapping = threading.RLock()  # held by a chunk's thread while a module's parameters are swapped
os.register_at_fork(after_in_child=_swapping._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]
_wrapping = threading.Lock()
os.register_at_fork(after_in_child=_wrapping._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]


def wrap_once(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace ``owner.<name>`` by ``wrap(original)``, once per process (the wrapper is marked;
    a later call is one check; nothing happens where ``owner`` has no such attribute)."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_gradmap_guarded", False):
        return
    with _wrapping:
        original = getattr(owner, name)
        if not getattr(original, "_gradmap_guarded", False):
            wrapped = wrap(original)
            wrapped._gradmap_guarded = True
            setattr(owner, name, wrapped)


def guard_parameter_swaps() -> None:
    """Wrap ``functional_call``'s swap in the lock of NOTE [parameters swapped by
    functional_call], once per process."""
    wrap_once(stateless, "_reparametrize_module", _guarded)


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

    return _reparametrize_module
