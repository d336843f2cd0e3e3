"""gradmap's worker processes: starting them, the calls in flight to each over its sockets, a
worker's death, shutdown. The calls themselves (what is sent, and the caller as one more worker)
are the transport's (``_transport.py``).

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
import os
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
from collections import OrderedDict, deque
from multiprocessing.connection import Connection
from typing import Any

from .._errors import add_note
from .._remote._classes import users_classes
from .._remote._kept import PayloadAccount
from ._shared import Sharer

__all__ = ["CallInFlight", "Pool", "Worker", "get_pool", "shutdown_pools"]

_COMMAND = "from gradmap._process._worker import main; main()"

_SOCKET_BUFFER = 4 << 20  # bytes: a chunk's items in one write, where the kernel allows it
#: The folder that holds the ``gradmap`` package (three up from this file), put on the worker's
#: path so that it imports this gradmap.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CallInFlight:
    """A call in flight to a worker process: its answer, once read (``Worker.read_one``), or
    that the worker died first (``lost``)."""

    __slots__ = ("cancelled", "done", "error", "lost", "timed", "value", "worker")

    def __init__(self, worker: Worker, timed: bool = False) -> None:
        self.worker = worker
        self.timed = timed  # the answer ends with the seconds the worker took (a forward)
        self.done = self.lost = self.cancelled = False
        self.value: Any = None
        self.error: BaseException | None = None


class Worker:
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
        self.pending: deque[CallInFlight] = deque()
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
        self.answered = False  # an answer came: the worker has started (NOTE [a worker starting])
        self.payloads: OrderedDict[bytes, None] = OrderedDict()  # mirrors the worker's cache
        self.held = PayloadAccount()  # NOTE [kept items cross to a worker process once]
        self.sent_bytes = 0  # of the calls written to the worker (for tests and the curious)
        self.received_bytes = 0  # of the answers read from it (likewise)
        self.storages: set[tuple[int, int]] = set()
        self.send(("init", {"path": list(sys.path), "cwd": os.getcwd(), "threads": threads}))

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: Any) -> None:
        data = pickle.dumps(message[1] if message[0] == "init" else message, protocol=5)
        self.sent_bytes += len(data)
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
        self._lose_pending()
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
        self.received_bytes += len(data)
        self.answered = True
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
        # Its calls in flight are lost, as when it dies: a call left pending (one a map stopped
        # waiting for) kept the stopped worker from being started again, and a later backward
        # waited start_timeout for it before failing.
        self._lose_pending()

    def _lose_pending(self) -> None:
        while self.pending:
            call = self.pending.popleft()
            call.lost = call.done = True


def _remote_error(payload: bytes | None, text: str, worker: Worker) -> BaseException:
    exc: BaseException | None = None
    if payload is not None:
        try:
            with users_classes():  # NOTE [the user's classes stay theirs]: ``except MyError``
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
        self.workers: list[Worker] = []
        self.sharer = Sharer()
        self.lock = threading.Lock()
        self.stopped = False

    def ensure(self, count: int) -> list[Worker]:
        """The first ``count`` workers, starting (or restarting) those needed."""
        with self.lock:
            started = False
            while len(self.workers) < count:
                self.workers.append(Worker(self.threads))
                started = True
            for i in range(count):
                if not self.workers[i].alive and not self.workers[i].pending:
                    self.workers[i] = Worker(self.threads)
                    started = True
            restarted = started and self.stopped
            if restarted:
                self.stopped = False
            workers = self.workers[:count]
        if restarted:
            # A map that outlived its pool's shutdown (its backward still to come when an
            # executor's block ended) started a worker on it: the pool is known again, so that
            # the next shutdown stops it too (it was left running, with its writer thread).
            _known_again(self)
        return workers

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
                    call = CallInFlight(w)
                    call.cancelled = True
                    w.pending.append(call)

    def shutdown(self) -> None:
        with self.lock:
            workers, self.workers = self.workers, []
            self.stopped = True
        for w in workers:
            w.stop()


_pools: dict[int, Pool] = {}
#: Pools that started workers again after their shutdown while another pool of their
#: ``threads`` was current: stopped with it.
_restarted: list[Pool] = []
_lock = threading.Lock()


def _known_again(pool: Pool) -> None:
    with _lock:
        if _pools.setdefault(pool.threads, pool) is not pool and pool not in _restarted:
            _restarted.append(pool)


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
        pools += [p for p in _restarted if threads is None or p.threads == threads]
        _restarted[:] = [p for p in _restarted if p not in pools]
    for pool in pools:
        pool.shutdown()


atexit.register(shutdown_pools)
_left_in_the_parent: list[object] = []


def _after_fork_in_child() -> None:
    # The parent's workers stay the parent's: kept from the collector, never stopped from here
    # (NOTE [after a fork] in ``_executors``).
    _left_in_the_parent.append((dict(_pools), list(_restarted)))
    _pools.clear()
    _restarted.clear()
    _lock._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_after_fork_in_child)
