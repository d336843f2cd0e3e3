"""The pool of worker actors: one per Ray connection (and thread budget), made on first use.

NOTE [actors, sized to the CPUs]:
    Chunks run on long-lived actors, not on tasks: a chunk's graph must stay where it was built
    until the backward (an actor's memory), a call to an actor costs about a millisecond where a
    task costs several, and an actor imports torch once. Each actor asks Ray for
    ``threads_per_worker`` CPUs (default 1) and runs PyTorch on that many intra-op threads; an
    actor keeps its CPUs for life, so the pool takes the CPUs free when it is made, never more
    (Ray would keep the extra actors pending, and a map waiting on them would hang). One intra-op
    thread per actor, whatever the number of actors, keeps results bitwise the same for any
    ``workers`` (NOTE [intra-op threads]).

    Stateless work -- ``remat=True``'s backward, and the chunks of a lost actor -- runs on the
    same actors (their ``recompute`` method), not on Ray tasks: tasks would need CPUs of their
    own, which the pool holds (a 1-CPU task would wait forever), or zero CPUs, which Ray does not
    bound (every chunk at once, oversubscribing the cores).

    Actors restart after their process dies (``max_restarts=-1``), without their state; calls are
    not retried by Ray (``max_task_retries=0``): gradmap decides what a lost call means (see
    NOTE [a pass over the actors]). The pool lives as long as the Ray connection; a new
    connection (after ``ray.shutdown()``) gets a new pool.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from ._transport import PutCache, RayHost

__all__ = ["WorkerPool", "get_pool", "shutdown_pools"]


class WorkerPool:
    """The actors of one connection.

    Attributes:
        actors: the actor handles.
        threads: intra-op threads (and CPUs) of each actor.
    """

    def __init__(self, actors: list[Any], threads: int) -> None:
        self.actors = actors
        self.threads = threads
        self.puts = PutCache()

    def __len__(self) -> int:
        return len(self.actors)

    def call_all(self, method: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        """``method(*args)`` on every actor; the results in actor order. An actor that Ray is
        restarting is asked again until it answers (for at most ``timeout`` seconds)."""
        return call_all(self.actors, method, *args, timeout=timeout)

    def kill(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a)
        self.actors = []


def call_all(actors: list[Any], method: str, *args: Any, timeout: float = 60.0) -> list[Any]:
    """``method(*args)`` on each of ``actors``, waiting out restarts (see ``WorkerPool``)."""
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * len(actors)
    todo = list(range(len(actors)))
    while True:
        refs = [getattr(actors[i], method).remote(*args) for i in todo]
        left = []
        for i, ref in zip(todo, refs):
            try:
                results[i] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                left.append(i)
        if not left:
            return results
        todo = left
        time.sleep(0.2)


_pools: dict[tuple[Any, ...], WorkerPool] = {}
_lock = threading.Lock()


def _connection_key(ray: Any) -> tuple[str, str]:
    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_node_id()


def get_pool(ray: Any, threads: int, start_timeout: float) -> WorkerPool:
    """The pool of the current Ray connection for ``threads`` threads per actor.

    Arguments:
        ray: the connected ``ray`` module.
        threads: CPUs and intra-op threads per actor.
        start_timeout: seconds to wait for new actors to start.

    Raises:
        RuntimeError: the cluster has no free CPU, or the actors did not start in time.
    """
    key = (*_connection_key(ray), threads)
    pool = _pools.get(key)
    if pool is not None:
        return pool
    with _lock:
        pool = _pools.get(key)
        if pool is not None:
            return pool
        for stale in [k for k in _pools if k[:2] != key[:2]]:
            del _pools[stale]  # pools of an earlier connection: their actors died with it
        free_cpus = float(ray.available_resources().get("CPU", 0.0))
        count = int(free_cpus // threads)
        if count < 1:
            raise RuntimeError(
                f"gradmap.tmap(executor='ray'): the Ray cluster has {free_cpus:g} CPUs free, "
                f"fewer than the {threads} one worker needs; gradmap's workers hold their CPUs "
                "for life, so free some (fewer actors of your own, or another RayExecutor's "
                "shutdown()) or lower threads_per_worker"
            )
        remote = ray.remote(RayHost).options(
            num_cpus=threads, max_restarts=-1, max_task_retries=0, max_concurrency=1
        )
        actors = [remote.remote(threads) for _ in range(count)]
        pool = WorkerPool(actors, threads)
        try:
            pool.call_all("pid", timeout=start_timeout)
        except Exception as exc:
            pool.kill()
            raise RuntimeError(
                f"gradmap.tmap(executor='ray'): {count} Ray workers did not start within "
                f"{start_timeout} s"
            ) from exc
        _pools[key] = pool
        return pool


def shutdown_pools(threads: int | None = None) -> None:
    """Kill the pools' actors (all pools, or those with ``threads`` threads per actor)."""
    with _lock:
        for key in [k for k in _pools if threads is None or k[2] == threads]:
            _pools.pop(key).kill()
