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

    The lock covers the swap only, and ``f`` may read the module outside it: the common
    per-element-weights (MAML) pattern builds ``{k: v * s for k, v in
    net.named_parameters()}`` and then calls ``functional_call(net, params, x)``, and that read
    picked up another thread's swapped-in tensors (a helper: wrong values and gradients, no
    error, in 45-53 of 300 maps on threads, 266-274 of 300 on a user's pool). No lock can cover
    every read of a module, so a map learns instead: each swap in a chunk is counted in its
    thread (``swaps_here``), a chunk notes whether ``f`` swapped, and an ``f`` seen to swap
    keeps its forwards in one thread from then on, as an ``f`` that draws random numbers does
    (its first forward is in one thread whatever the executor, so it is learnt there), and its
    recomputes run one at a time under the lock. A forward on several threads that swapped
    (an ``f`` that started swapping after its first call) raises, saying so: its results may be
    wrong.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils import stateless

from .._engine import alone, on_a_chunk

__all__ = ["guard_parameter_swaps", "one_swapper", "swaps_here", "wrap_once"]

_swapping = threading.RLock()  # held by a chunk's thread while a module's parameters are swapped
_counted = threading.local()  # ``swaps``: the swaps chunks made in this thread
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
        # (torch.compile's tracing swaps too, nothing in: not counted)
        swapped = args[1] if len(args) > 1 else kwargs.get("parameters_and_buffers")
        if swapped and not torch.compiler.is_compiling():
            _counted.swaps = getattr(_counted, "swaps", 0) + 1
        with _swapping, alone(), original(*args, **kwargs):
            yield

    return _reparametrize_module


def swaps_here() -> int:
    """How many swaps chunks made in this thread so far."""
    return getattr(_counted, "swaps", 0)


@contextlib.contextmanager
def one_swapper() -> Iterator[None]:
    """Around a recompute of an ``f`` that swaps: one at a time (NOTE [parameters swapped by
    functional_call])."""
    with _swapping, alone():
        yield
