"""gradmap on Ray: chunks run on Ray actors, in other processes or on other machines.

``RayExecutor`` imports without Ray (it says how to install Ray when it is missing); ``map_ray``,
the rule gradmap dispatches to for an executor that does not share memory, imports Ray on use.
The design notes are in ``_map.py`` (the rule), ``_pickling.py`` (identities of tensors),
``_schedule.py`` (a pass over the actors, lost workers), ``_pool.py`` (the actors) and
``_cluster.py`` (starting Ray on loopback, or connecting to a cluster).
"""

from __future__ import annotations

from typing import Any

from .._executors import Executor
from .._plan import ChunkPlan
from ._executor import RayExecutor

__all__ = ["RayExecutor", "map_ray"]


def map_ray(
    f: Any,
    elements: list[tuple[Any, ...]],
    executor: Executor,
    plan: ChunkPlan,
    *,
    remat: bool = False,
    progress: Any = False,
) -> list:
    """``[f(*args) for args in elements]`` on Ray actors, differentiable as the loop is (see
    ``gradmap._ray._map.map_ray``). A wrapper so that ``import gradmap`` does not import Ray:
    ``_map`` needs Ray's cloudpickle at import."""
    from ._map import map_ray as run

    return run(f, elements, executor, plan, remat=remat, progress=progress)
