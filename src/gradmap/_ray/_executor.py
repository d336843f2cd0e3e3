"""``RayExecutor``: where a map's chunks run when they run on Ray (importable without Ray)."""

from __future__ import annotations

from typing import Any

from .._executors import RemoteExecutor, available_cores
from ._cluster import RAY_MISSING, ensure_connected, ray_installed

__all__ = ["RayExecutor"]


def _positive(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"gradmap.RayExecutor: {name} must be a positive int, got {value!r}")


class RayExecutor(RemoteExecutor):
    """Chunks run on Ray actors, in other processes (or on other machines).

    ``gradmap.tmap(f, xs, executor="ray")`` (or ``executor=gradmap.RayExecutor(...)``) runs each
    chunk's forward on a pool of Ray actors, which keep the chunk's autograd graph; the backward
    sends each chunk's cotangents to the actor that holds it. The gradients are those of the plain
    loop, to the items and to every tensor ``f`` uses, and bitwise the same from run to run and
    for any ``workers``. ``f`` and the items must be picklable (cloudpickle); the results come
    back by pickle. An actor that dies mid-map has its chunks recomputed elsewhere, with the same
    gradients. See ``gradmap/_remote/_map.py`` for the design notes.

    Arguments:
        workers: actors that run the chunks of one map. Default: all of the pool's, which holds
            one actor per ``threads_per_worker`` CPUs free in the cluster when it is made.
        address: the Ray cluster to connect to when this process is not connected yet:
            ``"auto"``, ``"host:port"`` or ``"ray://host:port"``. Default: ``RAY_ADDRESS`` if
            set, else a new local instance with the process's cores, listening on loopback only.
            A connection made before (``ray.init(...)``) is used as it is.
        threads_per_worker: CPUs each actor holds, and its PyTorch intra-op threads.
        timeout: seconds a pass may go without any chunk finishing before it fails with
            ``TimeoutError``; ``None`` (default) waits as long as ``f`` takes.
        start_timeout: seconds to wait for the actors to start.
        init_kwargs: more keyword arguments for the ``ray.init`` call gradmap makes.
    """

    name = "ray"

    def __init__(
        self,
        workers: int | None = None,
        *,
        address: str | None = None,
        threads_per_worker: int = 1,
        timeout: float | None = None,
        start_timeout: float = 120.0,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not ray_installed():
            raise ImportError(RAY_MISSING)
        _positive("workers", workers)
        _positive("threads_per_worker", threads_per_worker, allow_none=False)
        self.address = address
        self.threads_per_worker = threads_per_worker
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.init_kwargs = dict(init_kwargs or {})
        super().__init__(workers or 0)

    @property
    def workers(self) -> int:  # type: ignore[override]
        """The actors a map uses: ``workers=`` if given, else the pool's size once it exists,
        else the cores of this process."""
        if self._workers:
            return self._workers
        from ._pool import _pools

        for key, pool in _pools.items():
            if key[2] == self.threads_per_worker:
                return len(pool)
        return max(1, available_cores() // self.threads_per_worker)

    @workers.setter
    def workers(self, value: int) -> None:
        self._workers = value

    # -- the actors ------------------------------------------------------------------------

    def transport(self, f: Any = None, api: str = "", n: int = 0) -> Any:
        """Calls to the actors a map uses (connecting to Ray and starting the pool if needed)."""
        from ._transport import RayTransport

        pool = self._pool()
        return RayTransport(self._used(pool), pool.puts)

    def _pool(self) -> Any:
        from ._pool import get_pool

        ray = ensure_connected(self.address, self.init_kwargs)
        return get_pool(ray, self.threads_per_worker, self.start_timeout)

    def _used(self, pool: Any) -> list[Any]:
        count = len(pool) if not self._workers else min(self._workers, len(pool))
        return pool.actors[:count]  # type: ignore[no-any-return]

    def actors(self) -> list[Any]:
        """The actor handles a map uses, connecting to Ray and starting the pool if needed."""
        return self._used(self._pool())

    def worker_pids(self) -> list[int]:
        """The process id of each actor a map uses (starting them if needed)."""
        from ._pool import call_all

        return call_all(self.actors(), "pid")

    def stored_calls(self) -> list[int]:
        """How many maps each actor holds state for (graphs awaiting their backward)."""
        from ._pool import call_all

        return call_all(self.actors(), "stored")

    def shutdown(self) -> None:
        """Kill the pool's actors (freeing their CPUs); the next map starts new ones."""
        from ._pool import shutdown_pools

        shutdown_pools(self.threads_per_worker)

    def __repr__(self) -> str:
        workers = self._workers or None
        return (
            f"RayExecutor(workers={workers}, address={self.address!r}, "
            f"threads_per_worker={self.threads_per_worker})"
        )
