"""Ray as a transport of the rule in ``gradmap._remote``: actors host the chunks, and calls,
waits and the payload of ``f`` go through Ray."""

from __future__ import annotations

from typing import Any

from .._errors import add_note
from .._remote._host import Host
from .._remote._pickling import LeafTable, loads
from .._remote._schedule import Transport, WorkerLost

__all__ = ["RayHost", "RayTransport"]


class RayHost(Host):
    """The actor class (wrapped with ``ray.remote`` by the pool): ``f``'s payload comes from
    Ray's object store, once per call."""

    executor = "ray"

    def load_f(self, box: Any) -> tuple[Any, LeafTable]:
        import ray

        leaves = LeafTable()
        return loads(ray.get(box[0]), leaves), leaves


class RayTransport(Transport):
    """Calls to a list of actors."""

    name = "ray"

    def __init__(self, actors: list[Any]) -> None:
        super().__init__(len(actors))
        self.actors = actors

    def call(self, worker: int, method: str, *args: Any) -> Any:
        return getattr(self.actors[worker], method).remote(*args)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        import ray

        ready, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        return list(ready)

    def get(self, handle: Any) -> Any:
        import ray

        try:
            return ray.get(handle)
        except BaseException as exc:
            if _lost_actor(exc):
                raise WorkerLost(str(exc)) from exc
            raise _unwrap(exc) from None

    def cancel(self, handle: Any) -> None:
        import ray

        ray.cancel(handle)

    def box(self, payload: bytes) -> Any:
        import ray

        return [ray.put(payload)]  # a list: Ray passes the ref itself, not its value

    def release(self, call_id: str, workers: list[int] | None = None) -> None:
        import ray

        if not ray.is_initialized():
            return
        for index in range(len(self.actors)) if workers is None else workers:
            self.actors[index].release.remote(call_id)


def _unwrap(exc: BaseException) -> BaseException:
    """The exception ``f`` raised, out of Ray's ``RayTaskError`` wrapper, with the worker's
    traceback as a note."""
    from ray.exceptions import RayTaskError

    if not isinstance(exc, RayTaskError):
        return exc
    cause = getattr(exc, "cause", None)
    if not isinstance(cause, BaseException):
        return exc
    trace = getattr(exc, "traceback_str", "")
    if trace:
        add_note(cause, "gradmap: the Ray worker's traceback:\n" + trace.rstrip())
    return cause


def _lost_actor(exc: BaseException) -> bool:
    from ray.exceptions import (
        ObjectLostError,
        RayActorError,
        RayTaskError,
        TaskCancelledError,
        WorkerCrashedError,
    )

    system = (RayActorError, WorkerCrashedError, ObjectLostError, TaskCancelledError)
    if isinstance(exc, RayTaskError):
        return isinstance(getattr(exc, "cause", None), system)
    return isinstance(exc, system)
