"""The executor a call runs on: ``executor`` and ``workers`` checked and turned into an
[`Executor`][gradmap.Executor], by the names the calling API accepts.

The names live here, with the API, and not with the executors: ``"processes"`` and ``"ray"``
name backends that sit above the executors (they run the rule in ``gradmap._remote``), and
each API says which names it takes (``gradmap.jax`` runs on threads only).
"""

from __future__ import annotations

import concurrent.futures
import operator
from collections.abc import Callable, Mapping

from ._executors import Executor, FuturesExecutor, SerialExecutor, ThreadExecutor

__all__ = ["EXECUTORS", "Names", "resolve_executor"]

#: An executor's name -> what makes it from ``workers``.
Names = Mapping[str, Callable[[int | None], Executor]]


def _ray_executor(workers: int | None) -> Executor:
    from ._ray import RayExecutor  # lazy: Ray is an optional extra, imported on use

    return RayExecutor(workers)


def _process_executor(workers: int | None) -> Executor:
    from ._process import default_executor  # lazy: starts no process until a map needs one

    return default_executor(workers)


#: The names ``gradmap.tmap`` and ``gradmap.tsum`` accept.
EXECUTORS: Names = {
    "threads": ThreadExecutor,
    "serial": SerialExecutor,
    "processes": _process_executor,
    "ray": _ray_executor,
}


def resolve_executor(executor: object, workers: int | None, names: Names, api: str) -> Executor:
    """Turn a call's ``executor`` and ``workers`` arguments into an [`Executor`][].

    Arguments:
        executor: ``None`` (the shared pool), one of ``names``, a gradmap [`Executor`][], or any
            `concurrent.futures.Executor`.
        workers: threads that may run chunks at once, the caller's included; ``None`` for the
            executor's own default (the available cores for the shared pool).
        names: the executor names the calling API accepts (``EXECUTORS`` for ``gradmap.tmap``).
        api: the public function called, named in errors (``"gradmap.tsum"``, ...).

    Returns:
        The executor to run chunks on.
    """
    if workers is not None:
        if isinstance(workers, bool):
            raise TypeError(f"{api}: workers must be an int or None, got {workers!r}")
        try:
            workers = operator.index(workers)
        except TypeError:
            raise TypeError(f"{api}: workers must be an int or None, got {workers!r}") from None
        if workers < 1:
            raise ValueError(
                f"{api}: workers must be at least 1, got {workers}; "
                "pass workers=None for the available cores"
            )
    if executor is None:
        return ThreadExecutor(workers)
    if isinstance(executor, str):
        make = names.get(executor)
        if make is None:
            raise ValueError(
                f"{api}: unknown executor {executor!r}; expected one of "
                f"{sorted(names)}, a concurrent.futures.Executor, or a gradmap.Executor"
            )
        return make(workers)
    if isinstance(executor, FuturesExecutor):
        return executor.named(api)
    if isinstance(executor, Executor):
        return executor
    if isinstance(executor, concurrent.futures.Executor):
        return FuturesExecutor(executor, workers, api=api)
    raise TypeError(
        f"{api}: executor must be None, a name (one of {sorted(names)}), a "
        f"concurrent.futures.Executor or a gradmap.Executor; got {type(executor).__name__}"
    )
