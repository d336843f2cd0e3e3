"""gradmap's worker processes: starting them, calls over their sockets, a worker's death, shutdown.

NOTE [worker processes]:
    A worker is a fresh interpreter (``subprocess``, ``sys.executable``), not a fork: forking a
    process that runs threads (gradmap's pool, OpenMP's, a user's) can copy a held lock into the
    child, and ``multiprocessing``'s spawn would import the caller's ``__main__`` again, which
    runs a script without an ``if __name__ == "__main__"`` guard a second time. The worker gets
    the caller's ``sys.path`` and working directory, imports torch once, and runs with
    ``threads_per_worker`` intra-op threads (``OMP_NUM_THREADS`` too). It talks to the caller
    over a Unix socket pair (calls and answers, pickled) and receives shared storages' file
    descriptors on a second one.

    Calls to one worker are answered in order, so the caller keeps, per worker, a queue of the
    calls in flight; a wait reads one answer from each worker that has one (``wait`` on the
    sockets) and hands it to the oldest call of that worker, whichever map it belongs to: maps
    called from several threads share the workers, and one thread at a time reads a worker's
    socket (under the worker's lock, and only if an answer is still there). A call the caller
    gave up on (cancelled by an interrupt or an error) stays in the queue until its answer
    comes, which is then dropped: a late answer is never taken for another call's.

    A worker that dies (killed, out of memory, a crash in native code) closes its socket: every
    call it had in flight ends with ``WorkerLost``, the pass runs those chunks again elsewhere
    (NOTE [a pass over the actors] in ``_remote/_schedule.py``), and the next call to that
    worker starts a new process in its place. Workers ignore ``SIGINT``, die with the caller
    (when their socket closes, and when their parent changes: ``_worker.py``), and are stopped
    at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from multiprocessing.connection import Connection, wait
from typing import Any

from .._errors import add_note
from .._placement import learn_caller_seconds
from .._remote._pickling import Payload
from .._remote._schedule import Transport, WorkerLost
from ._host import PAYLOADS_KEPT
from ._local import LocalHost
from ._shared import FDS_PER_MESSAGE, Sharer

__all__ = ["Pool", "ProcessTransport", "get_pool", "shutdown_pools"]

_COMMAND = "from gradmap._process._worker import main; main()"

#: Work methods whose answers end with the seconds the worker spent on them (``ProcessHost``).
_TIMED = ("forward", "forward_sum")
_SOCKET_BUFFER = 4 << 20  # bytes: a chunk's items in one write, where the kernel allows it
#: The folder that holds the ``gradmap`` package (three up from this file), put on the worker's
#: path so that it imports this gradmap.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Call:
    __slots__ = ("cancelled", "done", "error", "lost", "timed", "value", "worker")

    def __init__(self, worker: _Worker, timed: bool = False) -> None:
        self.worker = worker
        self.timed = timed  # the answer ends with the seconds the worker took (a forward)
        self.done = self.lost = self.cancelled = False
        self.value: Any = None
        self.error: BaseException | None = None


class _LocalCall:
    """A call to the caller's own host: run when the pass waits (``ProcessTransport.wait``)."""

    __slots__ = ("args", "cancelled", "done", "error", "lost", "method", "value")

    def __init__(self, method: str, args: tuple[Any, ...]) -> None:
        self.method, self.args = method, args
        self.done = self.lost = self.cancelled = False
        self.value: Any = None
        self.error: BaseException | None = None


class _Worker:
    """One worker process and the caller's account of it."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd_ours, fd_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        for sock in (ours, theirs):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _COMMAND, str(theirs.fileno()), str(fd_theirs.fileno())],
            pass_fds=(theirs.fileno(), fd_theirs.fileno()),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        fd_theirs.close()
        self.lock = threading.RLock()  # a release from a finalizer may run inside a call
        self.sock = ours  # written to directly (``send``); read through ``conn``
        self.conn = Connection(os.dup(ours.fileno()))
        self.fds = fd_ours
        self.pending: deque[_Call] = deque()
        # NOTE [writing calls]: a call is written by the caller's thread at once when the
        # socket takes it whole (a non-blocking send: the common case, no thread switch);
        # what does not fit goes to a thread of the worker's own, which blocks on it, and so do
        # the calls after it until it is through. So the caller's thread never blocks on a
        # write while the worker blocks on writing an answer (a ``tsum`` chunk's items one way,
        # its gradients the other) -- neither would read, and both would wait for ever.
        self.outbox: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self.queued = 0  # messages handed to the writer thread and not yet written
        self.writer = threading.Thread(target=self._write, name="gradmap-writer", daemon=True)
        self.writer.start()
        self.alive = True
        self.payloads: OrderedDict[bytes, None] = OrderedDict()  # mirrors the worker's cache
        self.storages: set[tuple[int, int]] = set()
        self.send(("init", {"path": list(sys.path), "cwd": os.getcwd(), "threads": threads}))

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: Any) -> None:
        data = pickle.dumps(message[1] if message[0] == "init" else message, protocol=5)
        # The framing of ``multiprocessing.connection.Connection``, which the worker reads with.
        if len(data) > 0x7FFFFFFF:
            header = struct.pack("!i", -1) + struct.pack("!Q", len(data))
        else:
            header = struct.pack("!i", len(data))
        view = memoryview(header + data) if len(data) < 4096 else None
        parts = [view] if view is not None else [memoryview(header), memoryview(data)]
        with self.lock:
            if not self.queued:
                try:
                    while parts:
                        sent = self.sock.sendmsg(parts, (), socket.MSG_DONTWAIT)
                        while parts and sent >= len(parts[0]):
                            sent -= len(parts[0])
                            parts.pop(0)
                        if parts and sent:
                            parts[0] = parts[0][sent:]
                except BlockingIOError:
                    pass
                except OSError:
                    return  # the worker died: the reading side notices
            for part in parts:
                self.queued += 1
                self.outbox.put(part)

    def _write(self) -> None:
        while True:
            data = self.outbox.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except (OSError, ValueError):
                return  # the worker died: the reading side notices
            finally:
                with self.lock:
                    self.queued -= 1

    def died(self) -> None:
        """The worker is gone: its calls in flight are lost."""
        self.alive = False
        self.outbox.put(None)
        while self.pending:
            call = self.pending.popleft()
            call.lost = call.done = True
        self._close()
        with contextlib.suppress(Exception):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.wait(timeout=5)

    def _close(self) -> None:
        """Close this side's sockets (the worker reads EOF and exits)."""
        for end in (self.conn, self.sock, self.fds):
            with contextlib.suppress(Exception):
                end.close()

    def exit_status(self) -> str:
        code = self.process.poll()
        if code is None:
            return "running"
        if code < 0:
            import signal

            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def read_ready(self) -> None:
        """Read one answer if one is there: maps called from several threads wait on the same
        workers, and only one thread may read a socket at a time (another thread may have
        taken the answer that woke this one)."""
        with self.lock:
            if not self.alive:
                return
            try:
                ready = self.conn.poll(0)
            except (EOFError, OSError):
                ready = True  # read_one notices the death
            if ready:
                self.read_one()

    def read_one(self) -> None:
        """Read one answer and give it to the oldest call in flight."""
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            self.died()
            return
        call = self.pending.popleft()
        kind, *rest = pickle.loads(data)
        if kind == "ok":
            call.value = rest[0]
        else:
            call.error = _remote_error(rest[0], rest[1], self)
        call.done = True

    def stop(self, timeout: float = 2.0) -> None:
        self.outbox.put(None)
        self.writer.join(timeout)
        self._close()
        try:
            self.process.wait(timeout=timeout)
        except Exception:
            with contextlib.suppress(Exception):
                self.process.kill()
                self.process.wait(timeout=timeout)
        self.alive = False


def _remote_error(payload: bytes | None, text: str, worker: _Worker) -> BaseException:
    exc: BaseException | None = None
    if payload is not None:
        try:
            exc = pickle.loads(payload)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"gradmap: a worker process raised an error:\n{text}")
    else:
        add_note(exc, f"gradmap: raised in worker process {worker.pid}; its traceback:\n" + text)
    return exc


class Pool:
    """The worker processes of one ``threads_per_worker``, grown on demand."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.workers: list[_Worker] = []
        self.sharer = Sharer()
        self.lock = threading.Lock()

    def ensure(self, count: int) -> list[_Worker]:
        """The first ``count`` workers, starting (or restarting) those needed."""
        with self.lock:
            while len(self.workers) < count:
                self.workers.append(_Worker(self.threads))
            for i in range(count):
                if not self.workers[i].alive and not self.workers[i].pending:
                    self.workers[i] = _Worker(self.threads)
            return self.workers[:count]

    def forget_dead(self) -> None:
        """Tell the workers to forget the storages that died in the caller."""
        dead = self.sharer.take_dead()
        if not dead:
            return
        with self.lock:
            workers = list(self.workers)
        for w in workers:
            with w.lock:
                gone = w.storages & dead
                if gone and w.alive:
                    w.storages -= gone
                    w.send(("forget", (sorted(gone),)))
                    call = _Call(w)
                    call.cancelled = True
                    w.pending.append(call)

    def shutdown(self) -> None:
        with self.lock:
            workers, self.workers = self.workers, []
        for w in workers:
            w.stop()


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

    def most(self, worker: int) -> int | None:
        # The caller runs one chunk at a time: between two, it answers the workers (if any).
        return 1 if worker == self._remote and self._remote else None

    def _worker(self, index: int) -> _Worker:
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
        call = _Call(w, method in _TIMED)
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
        return call

    def _prepare(self, w: _Worker, arg: Any) -> Any:
        """A box as the worker gets it: the storages it lacks first, then the payload only if
        the worker does not keep it. Items (``Payload``, in a list of chunks) may name shared
        storages too."""
        if isinstance(arg, list):
            for chunk in arg:
                if isinstance(chunk, tuple):
                    for part in chunk:
                        if isinstance(part, Payload) and part.keys:
                            self._share(w, part.keys)
            return arg
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

    def _share(self, w: _Worker, keys: Any) -> None:
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
            w.pending.append(_Call(w))  # its answer (None) is read and dropped
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
        call: _Call = handle
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


_pools: dict[int, Pool] = {}
_lock = threading.Lock()


def get_pool(threads: int) -> Pool:
    with _lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = Pool(threads)
        return pool


def shutdown_pools(threads: int | None = None) -> None:
    """Stop the worker processes (all pools, or those with ``threads`` threads per worker)."""
    with _lock:
        pools = [_pools.pop(t) for t in list(_pools) if threads is None or t == threads]
    for pool in pools:
        pool.shutdown()


atexit.register(shutdown_pools)
