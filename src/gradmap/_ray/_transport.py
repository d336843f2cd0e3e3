"""Ray as a transport of the rule in ``gradmap._remote``: actors host the chunks, and calls,
waits and the payload of ``f`` go through Ray."""

from __future__ import annotations

import hashlib
import io
import pickle
import threading
from collections import OrderedDict
from typing import Any

from .._errors import add_note
from .._remote._classes import users_classes
from .._remote._host import Host
from .._remote._pickling import LeafTable
from .._remote._schedule import Transport, WorkerLost

__all__ = ["PutCache", "RayHost", "RayTransport"]

#: Payloads of ``f`` kept in Ray's object store (and unpickled on each actor), by digest.
PAYLOADS_KEPT = 4


class RayHost(Host):
    """The actor class (wrapped with ``ray.remote`` by the pool): ``f``'s payload comes from
    Ray's object store the first time an actor meets its digest, and stays unpickled there while
    it is among the last ``PAYLOADS_KEPT``."""

    executor = "ray"
    functions_kept = PAYLOADS_KEPT

    def run(self, method: str, blob: bytes, refs: list[Any]) -> Any:
        """``method(*args)`` with the arguments pickled in one ``blob`` (Ray serializes each
        argument of a call on its own, at a cost per argument), and the object references in
        them passed beside it, in a list (so that Ray passes them as they are)."""
        args = _ArgsUnpickler(io.BytesIO(blob), refs).load()
        try:
            return getattr(self, method)(*args)
        except Exception as exc:
            raise _shipped(exc) from None

    def load_f(self, box: Any) -> tuple[Any, LeafTable]:
        import ray

        digest, refs = box
        return self._kept_function(digest, lambda: ray.get(refs[0]))


class PutCache:
    """The caller's side of the payloads of ``f``: digest -> the object store's reference, the
    last ``PAYLOADS_KEPT`` (an unchanged ``f`` is put once, not once per map: a put costs about
    half a millisecond)."""

    def __init__(self) -> None:
        self._refs: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def box(self, payload: bytes) -> tuple[bytes, list[Any]]:
        import ray

        digest = hashlib.blake2b(payload, digest_size=16).digest()
        with self._lock:
            ref = self._refs.get(digest)
            if ref is None:
                ref = self._refs[digest] = ray.put(payload)
                while len(self._refs) > PAYLOADS_KEPT:
                    self._refs.popitem(last=False)
            else:
                self._refs.move_to_end(digest)
        return digest, [ref]  # a list: Ray passes the ref itself, not its value


class RayTransport(Transport):
    """Calls to a list of actors."""

    name = "ray"

    def __init__(self, actors: list[Any], puts: PutCache | None = None) -> None:
        super().__init__(len(actors))
        self.actors = actors
        self.puts = puts or PutCache()

    def call(self, worker: int, method: str, *args: Any) -> Any:
        actor = self.actors[worker]
        if not args:
            return getattr(actor, method).remote()
        buffer = io.BytesIO()
        pickler = _ArgsPickler(buffer)
        pickler.dump(args)
        return actor.run.remote(method, buffer.getvalue(), pickler.refs)

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
        return self.puts.box(payload)

    def release(self, call_id: str, workers: list[int] | None = None) -> None:
        import ray

        if not ray.is_initialized():
            return
        for index in range(len(self.actors)) if workers is None else workers:
            self.actors[index].release.remote(call_id)


class _ArgsPickler(pickle.Pickler):
    """Pickles a call's arguments, setting Ray's object references aside."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.refs: list[Any] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj).__name__ == "ObjectRef" and type(obj).__module__.startswith("ray"):
            self.refs.append(obj)
            return len(self.refs) - 1
        return None


class _ArgsUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, refs: list[Any]) -> None:
        super().__init__(file)
        self._refs = refs

    def persistent_load(self, pid: Any) -> Any:
        return self._refs[pid]


class ShippedError(Exception):
    """An exception raised on an actor, pickled there with cloudpickle: Ray's own copy of
    cloudpickle keeps its own account of the classes sent by value, so an exception of a class
    ``f`` brought along (one of the user's script) would come back as a copy of the class, and
    ``except MyError`` in the caller would miss it; cloudpickle's account finds the caller's
    class, as on the process executor."""

    def __init__(self, payload: bytes, trace: str) -> None:
        super().__init__(payload, trace)
        self.payload = payload
        self.trace = trace


def _shipped(exc: Exception) -> Exception:
    """``exc`` as it leaves an actor: shipped; or as it is where cloudpickle cannot pickle it,
    and for Ray's own errors (a lost object while loading ``f``: ``_lost_actor`` reads those)."""
    import traceback

    import cloudpickle

    if type(exc).__module__.split(".")[0] == "ray":
        return exc
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        return ShippedError(cloudpickle.dumps(exc, protocol=5), trace)
    except Exception:
        return exc


def _unwrap(exc: BaseException) -> BaseException:
    """The exception ``f`` raised, out of Ray's ``RayTaskError`` wrapper, with the worker's
    traceback as a note."""
    from ray.exceptions import RayTaskError

    if not isinstance(exc, RayTaskError):
        return exc
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ShippedError):
        import cloudpickle

        try:
            with users_classes():  # NOTE [the user's classes stay theirs]
                original = cloudpickle.loads(cause.payload)
        except Exception:
            original = None
        if isinstance(original, BaseException):
            add_note(original, "gradmap: the Ray worker's traceback:\n" + cause.trace.rstrip())
            return original
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
