"""The caller as one more worker: chunks of a map run in the caller's own thread while it waits
for the worker processes.

NOTE [the caller works too]:
    On a machine with few cores, a caller that only waits leaves one core to the workers'
    bookkeeping and idle time: with two cores, the caller and two workers are three processes on
    two cores, and the workers' chunks cost more (the pickling of items and results, the
    boundary walk) than the loop's elements. So by default a map on ``workers`` runs ``workers - 1``
    worker processes, and the caller's thread runs chunks itself, between its work for them.

    The caller's chunks are run by the same host as the workers' (``_remote/_host.py``), from the
    same payloads: ``f`` unpickled from its payload (its tensors are leaves over the same shared
    storages, ``caller_storages``; the classes of the user's script as copies, whose objects
    come back as the user's own: NOTE [the user's classes stay theirs]), items unpickled from
    theirs, the same results and gradients.
    A chunk's results and gradients are therefore bitwise the same wherever it runs, and the
    driver's sum in chunk order does not depend on which chunks the caller took.

    A caller's chunk runs inside ``ProcessTransport.wait``, when no worker has an answer ready:
    the workers are sent their next calls first (each has up to two in flight), so they are
    rarely idle while the caller runs one. While it runs, the caller's thread is a worker's:
    - one intra-op thread, as the workers have (set, and set back after: a thread that starts
      its first parallel op in that instant would take one intra-op thread for its life);
    - the global generator is seeded per element as in a worker, and set back after, so the
      caller's random numbers continue as if the map had run elsewhere;
    - a map inside ``f`` runs serially, as in a worker (``in_worker``);
    - one lock per process: maps called from several threads at once take turns on it.
    One difference remains: an ``f`` that cloudpickle sends by reference (a function of an
    importable module) runs in the caller with the caller's own module globals, and in a worker
    with the worker's copy; state that ``f`` keeps in its module should not be counted on with
    processes (tensors that require grad there are refused either way, ``ForeignTensorError``).

    A map so small that a worker's round trips would cost more than its work runs in the caller
    alone: each map measures the caller's forward seconds per element of ``f`` (told apart as in
    NOTE [forward placement]), and the next map of that ``f`` whose forward would take the caller
    under ``TINY`` seconds sends nothing to the workers. It goes on measuring, so a map whose
    elements grow goes back to the workers at its next call.
"""

from __future__ import annotations

import os
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .._engine import on_a_chunk, working_on_a_chunk
from .._placement import caller_seconds
from .._remote._classes import as_users, as_users_class, fresh_classes
from .._remote._host import Host, hosting
from .._remote._pickling import LeafTable
from .._torch._random import SEEDING
from ._host import PAYLOADS_KEPT

__all__ = ["TINY", "LocalHost", "local_host", "tiny"]

#: Seconds of forward work under which a map runs in the caller alone (two round trips to a
#: worker, forward and backward, cost about half a millisecond on an idle machine).
TINY = 1e-3


def tiny(f: Any, api: str, n: int) -> bool:
    """Whether a map of ``f`` over ``n`` elements is known to be too small for the workers (the
    caller's measured seconds are kept with the placement's, in ``_placement``)."""
    seconds = caller_seconds(f, api)
    return seconds is not None and seconds * n < TINY


class LocalHost(Host):
    """The host of the caller's own chunks (one per process)."""

    executor = "processes"
    functions_kept = PAYLOADS_KEPT

    def __init__(self) -> None:
        super().__init__(1, process=False)
        self.lock = threading.RLock()

    def load_f(self, box: Any) -> tuple[Any, LeafTable]:
        return self._kept_function(box.digest, lambda: box.payload)

    def loads_payload(self, payload: bytes, leaves: LeafTable) -> Any:
        with fresh_classes():  # NOTE [the user's classes stay theirs]
            return super().loads_payload(payload, leaves)

    def _loading(self) -> AbstractContextManager[object]:
        return fresh_classes()  # type: ignore[no-any-return]

    def _handed_out(self, results: list[Any]) -> list[Any]:
        return [y if type(y) is torch.Tensor else _users_tree(y) for y in results]

    def run(self, method: str, args: tuple[Any, ...]) -> Any:
        """``method(*args)`` in this thread, as a worker would run it."""
        # (Nested in a chunk of a map on threads, the outer map holds ``SEEDING`` already.)
        with self.lock, nullcontext() if on_a_chunk() else SEEDING:
            generator = torch.default_generator
            state = generator.get_state()
            threads = torch.get_num_threads()
            if threads != 1:
                torch.set_num_threads(1)
            try:
                with hosting(), working_on_a_chunk():
                    return getattr(self, method)(*args)
            except BaseException as exc:
                as_users(exc)  # NOTE [the user's classes stay theirs]: ``except MyError`` works
                raise
            finally:
                if threads != 1:
                    torch.set_num_threads(threads)
                generator.set_state(state)


def _users_tree(y: Any, depth: int = 0) -> Any:
    """A result of the caller's own chunks, its objects -- containers too (a named tuple of the
    script's) -- of the user's own classes."""
    kind = type(y)
    if kind is torch.Tensor or depth > 20:
        return y
    if kind in (list, tuple) or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
        items = [_users_tree(v, depth + 1) for v in y]
        if kind is list:
            return items
        kind = as_users_class(kind)
        return tuple(items) if kind is tuple else kind(*items)
    if kind is dict:
        return {k: _users_tree(v, depth + 1) for k, v in y.items()}
    return as_users(y)


_host_of_process: LocalHost | None = None
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _host_of_process
    _host_of_process = None  # (its lock may be held by a thread of the parent: NOTE [after a fork])
    _lock._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_after_fork_in_child)


def local_host() -> LocalHost:
    """This process's host of the caller's chunks."""
    global _host_of_process
    with _lock:
        if _host_of_process is None:
            _host_of_process = LocalHost()
        return _host_of_process
