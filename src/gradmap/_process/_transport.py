"""The transport over gradmap's worker processes (``_workers.py``): a call sent to a worker, or
run by the caller as one more worker (NOTE [the caller works too] in ``_local.py``); ``f``'s
payload and the shared storages a worker lacks, sent before the call that needs them; waiting
for answers, and what a forward's answer says of the time it took.
"""

from __future__ import annotations

import hashlib
import socket
import time
from multiprocessing.connection import wait
from typing import Any

from .._placement import learn_caller_seconds
from .._remote._kept import KeptItems
from .._remote._pickling import Payload
from .._remote._schedule import Transport, WorkerLost
from ._host import PAYLOADS_KEPT
from ._local import LocalHost
from ._shared import FDS_PER_MESSAGE
from ._workers import CallInFlight, Pool, Worker

__all__ = ["ProcessTransport"]

#: Work methods whose answers end with the seconds the worker spent on them (``ProcessHost``).
_TIMED = ("forward", "forward_sum")


class _LocalCall:
    """A call to the caller's own host: run when the pass waits (``ProcessTransport.wait``)."""

    __slots__ = ("args", "cancelled", "done", "error", "lost", "method", "value")

    def __init__(self, method: str, args: tuple[Any, ...]) -> None:
        self.method, self.args = method, args
        self.done = self.lost = self.cancelled = False
        self.value: Any = None
        self.error: BaseException | None = None


class _Box:
    """``f``'s payload for one map: its digest, and the shared storages it names (kept alive
    while the map is)."""

    __slots__ = ("digest", "keys", "payload")

    def __init__(self, payload: bytes, storages: dict[tuple[int, int], Any]) -> None:
        self.payload = payload
        self.digest = hashlib.blake2b(payload, digest_size=16).digest()
        self.keys = storages


class ProcessTransport(Transport):
    """Calls to the first ``count`` workers of a pool."""

    name = "processes"
    depth = 2

    def __init__(self, pool: Pool, count: int, local: LocalHost | None = None) -> None:
        """``count`` worker processes, and with ``local`` the caller too, as the last worker
        (NOTE [the caller works too] in ``_local.py``)."""
        super().__init__(count + (local is not None))
        self.pool = pool
        self._remote = count
        self._local = local
        self.seconds = 0.0  # the forward calls' seconds of work (any worker's), and chunks
        self.timed_chunks = 0
        self._workers = pool.ensure(count)
        pool.forget_dead()

    def local(self, worker: int) -> bool:
        return worker == self._remote

    def starting(self, worker: int) -> bool:
        if worker == self._remote:
            return False
        w = self._workers[worker]
        return w.alive and not w.answered

    def most(self, worker: int) -> int | None:
        # The caller runs one chunk at a time: between two, it answers the workers (if any).
        return 1 if worker == self._remote and self._remote else None

    def _worker(self, index: int) -> Worker:
        w = self._workers[index]
        if not w.alive and not w.pending:  # restart a dead worker when it is called again
            w = self._workers[index] = self.pool.ensure(index + 1)[index]
        return w

    def box(self, payload: bytes) -> Any:
        return _Box(payload, getattr(payload, "keys", {}))

    def call(self, worker: int, method: str, *args: Any) -> Any:
        if worker == self._remote:
            return _LocalCall(method, args)  # run by ``wait``, when no worker has an answer
        w = self._worker(worker)
        call = CallInFlight(w, method in _TIMED)
        if not w.alive:
            call.lost = call.done = True
            return call
        try:
            with w.lock:
                args = tuple(self._prepare(w, a) for a in args)
                w.send((method, args))
                w.pending.append(call)
        except (OSError, EOFError):
            w.died()
            call.lost = call.done = True
        except BaseException:
            # Not written (a message that would not pickle): the account of what the worker
            # holds may already count it, so this worker is replaced rather than trusted.
            w.died()
            raise
        return call

    def _prepare(self, w: Worker, arg: Any) -> Any:
        """A box as the worker gets it: the storages it lacks first, then the payload only if
        the worker does not keep it. Items (``Payload``, in a list of chunks) may name shared
        storages too."""
        if isinstance(arg, list):
            wired = []
            for chunk in arg:
                if isinstance(chunk, tuple):
                    for part in chunk:
                        if isinstance(part, Payload) and part.keys:
                            self._share(w, part.keys)
                    # NOTE [kept items cross to a worker process once] (``_remote/_kept.py``)
                    chunk = tuple(w.held.wire(p) if type(p) is KeptItems else p for p in chunk)
                wired.append(chunk)
            return wired
        if not isinstance(arg, _Box):
            return arg
        self._share(w, arg.keys)
        if arg.digest in w.payloads:
            w.payloads.move_to_end(arg.digest)
            return (arg.digest, None)
        w.payloads[arg.digest] = None
        while len(w.payloads) > PAYLOADS_KEPT:
            w.payloads.popitem(last=False)
        return (arg.digest, arg.payload)

    def _share(self, w: Worker, keys: Any) -> None:
        """Send the worker the descriptors of the storages it lacks."""
        missing = [key for key in keys if key not in w.storages]
        if missing:
            sharer = self.pool.sharer
            entries = []
            fds = []
            for key in missing:
                fd, size = sharer.fd(key)
                fds.append(fd)
                entries.append((key, size))
            for start in range(0, len(fds), FDS_PER_MESSAGE):
                socket.send_fds(w.fds, [b"s"], fds[start : start + FDS_PER_MESSAGE])
            w.send(("share", (entries,)))
            w.pending.append(CallInFlight(w))  # its answer (None) is read and dropped
            w.pending[-1].cancelled = True
            w.storages.update(missing)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        ready = [h for h in handles if h.done]
        if ready:
            return ready
        local = next((h for h in handles if type(h) is _LocalCall), None)
        if local is None:
            return self._wait_remote(handles, timeout)
        # The workers' answers first (their next calls go out before the caller runs a chunk).
        if len(handles) > 1:
            ready = self._wait_remote(handles, 0.0)
            if ready:
                return ready
        self._run_local(local)
        return [local]

    def _run_local(self, call: _LocalCall) -> None:
        assert self._local is not None
        start = time.perf_counter()
        try:
            if not call.cancelled:
                call.value = self._local.run(call.method, call.args)
        except Exception as exc:
            call.error = exc
        finally:
            call.done = True
            if call.method in _TIMED and call.error is None:
                self.seconds += time.perf_counter() - start
                self.timed_chunks += len(call.args[3])  # (call_id, box, spec, chunks)
            call.args = ()

    def learn(self, f: Any, api: str, chunks: int, elements: int) -> None:
        if self._local is not None and self.timed_chunks:
            seconds = self.seconds / self.timed_chunks * chunks / max(1, elements)
            learn_caller_seconds(f, api, seconds)

    def _wait_remote(self, handles: list[Any], timeout: float) -> list[Any]:
        handles = [h for h in handles if type(h) is not _LocalCall]
        ready = [h for h in handles if h.done]
        if ready:
            return ready
        deadline = time.monotonic() + timeout
        while True:
            workers = {id(h.worker): h.worker for h in handles if not h.done}
            conns = {w.conn: w for w in workers.values() if w.alive}
            if not conns:
                return [h for h in handles if h.done]
            left = max(0.0, deadline - time.monotonic())
            for conn in wait(list(conns), timeout=left):
                conns[conn].read_ready()  # type: ignore[index]
            ready = [h for h in handles if h.done]
            if ready or time.monotonic() >= deadline:
                return ready

    def get(self, handle: Any) -> Any:
        call: CallInFlight = handle
        if call.lost:
            raise WorkerLost(
                f"gradmap: worker process {call.worker.pid} died ({call.worker.exit_status()})"
            )
        if call.error is not None:
            raise call.error
        if getattr(call, "timed", False):
            *values, seconds = call.value
            self.seconds += seconds
            self.timed_chunks += len(values)
            return values
        return call.value

    def cancel(self, handle: Any) -> None:
        handle.cancelled = True

    def abandon(self, worker: int) -> None:
        if worker == self._remote:
            return  # the caller: its calls run in this thread, never left in flight
        w = self._workers[worker]
        with w.lock:
            if w.alive:
                w.died()  # killed; the pool starts another when it is next called

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every worker process; the values, in worker order."""
        handles = [self.call(index, method, *args) for index in range(self._remote)]
        while not all(h.done for h in handles):
            self.wait([h for h in handles if not h.done], 1.0)
        return [self.get(h) for h in handles]

    def release(self, call_id: str, workers: list[int] | None = None) -> None:
        # The answers are read (and dropped) by the next wait on each worker.
        for index in range(self.workers) if workers is None else workers:
            if index == self._remote:
                assert self._local is not None
                with self._local.lock:
                    self._local.release(call_id)
            elif self._workers[index].alive:
                self.call(index, "release", call_id).cancelled = True
