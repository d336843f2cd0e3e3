"""``ProcessExecutor``: chunks run in gradmap's worker processes, past the GIL."""

from __future__ import annotations

import os
import threading
from typing import Any

from .._executors import RemoteExecutor, available_cores

__all__ = ["ProcessExecutor", "default_executor"]


class ProcessExecutor(RemoteExecutor):
    """Chunks run in worker processes on this machine: forwards of small ops, which threads
    cannot run in parallel under the GIL, run on every core.

    ``gradmap.tmap(f, xs, executor="processes")`` (or ``executor=gradmap.ProcessExecutor(...)``)
    runs each chunk's forward in one of a pool of worker processes, started on first use and
    reused after, which keeps the chunk's autograd graph; the backward sends each chunk's
    cotangents to the worker that holds it. ``tsum`` runs each chunk's forward and backward in
    one call. The gradients are the plain loop's, to the items and to every tensor ``f`` uses,
    bitwise the same for any ``workers`` and from run to run. ``f`` and the items must be
    picklable (cloudpickle: lambdas and closures are); ``f``'s parameters and other tensors move
    to shared memory the first time they are sent, so an optimizer's in-place step reaches the
    workers with nothing sent. A worker that dies has its chunks recomputed by the others.
    Design notes: ``gradmap/_remote/_map.py`` (the rule), ``gradmap/_process/_workers.py`` (the
    processes) and ``gradmap/_process/_shared.py`` (shared memory).

    What differs from threads: ``f`` runs on copies of the objects it refers to, so what it
    changes in them (BatchNorm's running statistics, a counter) stays in the worker, except
    tensors in shared memory; a ``create_graph=True`` backward through the map raises.

    By default the caller's thread runs chunks too, between its work for the worker processes
    (NOTE [the caller works too] in ``gradmap/_process/_local.py``): ``workers=4`` is three
    processes and the caller.

    Arguments:
        workers: how many run the chunks of one map at once, the caller included. Default: the
            cores available.
        caller_helps: the caller runs chunks too (``workers - 1`` processes); ``False``:
            ``workers`` processes run them while the caller waits. With ``workers=1``, one
            process runs them.
        threads_per_worker: PyTorch intra-op threads of each worker.
        timeout: seconds a pass may go without any chunk finishing before it fails with
            ``TimeoutError``; ``None`` (default) waits as long as ``f`` takes. A worker still
            starting (importing PyTorch) does not count against it, for up to ``start_timeout``.
        start_timeout: seconds a pass may wait for its workers to start, or to start again after
            they died.
    """

    name = "processes"

    def __init__(
        self,
        workers: int | None = None,
        *,
        caller_helps: bool = True,
        threads_per_worker: int = 1,
        timeout: float | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        for label, value in (("workers", workers), ("threads_per_worker", threads_per_worker)):
            if value is None and label == "workers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"gradmap.ProcessExecutor: {label} must be a positive int, got {value!r}"
                )
        super().__init__(workers or max(1, available_cores() // threads_per_worker))
        self.caller_helps = bool(caller_helps) and self.workers > 1  # type: ignore[misc]
        self.processes = self.workers - self.caller_helps
        self.threads_per_worker = threads_per_worker
        self.timeout = timeout
        self.start_timeout = start_timeout

    def _pool(self) -> Any:
        from ._workers import get_pool

        return get_pool(self.threads_per_worker)

    @property
    def share(self) -> Any:  # type: ignore[override]
        return self._pool().sharer

    def transport(self, f: Any = None, api: str = "", n: int = 0) -> Any:
        """The transport of a map of ``f`` over ``n`` elements: the caller alone for a map known
        to be tiny (NOTE [the caller works too])."""
        from ._local import local_host, tiny
        from ._transport import ProcessTransport

        if not self.caller_helps:
            return ProcessTransport(self._pool(), self.processes)
        count = 0 if f is not None and tiny(f, api, n) else self.processes
        return ProcessTransport(self._pool(), count, local_host())

    def worker_pids(self) -> list[int]:
        """The process id of each worker process a map uses (starting them if needed)."""
        return [w.pid for w in self._pool().ensure(self.processes)]

    def stored_calls(self) -> list[int]:
        """How many maps each worker holds state for (graphs awaiting their backward)."""
        return self.transport().call_all("stored")

    def shutdown(self) -> None:
        """Stop the worker processes (of this ``threads_per_worker``); the next map starts new
        ones."""
        from ._workers import shutdown_pools

        shutdown_pools(self.threads_per_worker)

    def __repr__(self) -> str:
        return (
            f"ProcessExecutor(workers={self.workers}, caller_helps={self.caller_helps}, "
            f"threads_per_worker={self.threads_per_worker})"
        )


_defaults: dict[int | None, ProcessExecutor] = {}
_lock = threading.Lock()
os.register_at_fork(after_in_child=_lock._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]


def default_executor(workers: int | None) -> ProcessExecutor:
    """The executor ``executor="processes"`` names (one per ``workers``)."""
    with _lock:
        executor = _defaults.get(workers)
        if executor is None:
            executor = _defaults[workers] = ProcessExecutor(workers)
        return executor
