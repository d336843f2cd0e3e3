"""A worker process: the host of the rule in ``gradmap._remote``, answering calls over a socket.

Started by the pool (``_workers.py``) as ``python -c "...main()" <socket fd> <fd socket fd>``; it
reads calls ``(method, args)`` from the socket and answers each, in order, with ``("ok", value)``
or ``("error", exception, traceback)``. Its main thread reads the socket itself: a reading thread
would wait for the GIL (up to the 5 ms switch interval) on every piece of a large call while the
main thread runs ``f``. The caller writes from a thread of its own, so a worker blocked on a
large answer never waits for a caller blocked on a large call. Storages in shared memory arrive
as file descriptors on the second socket (NOTE [parameters in shared memory] in ``_shared.py``).

The worker exits when the caller's end of the socket closes (the caller exited, or shut the pool
down), and when its parent changes (a thread checks every second: the caller died while a child
of its own kept the socket open): no worker outlives its caller. (``PR_SET_PDEATHSIG`` would be
quicker, but Linux sends it when the *thread* that started the worker exits, and a map called
from a short-lived thread would lose its workers.) It ignores ``SIGINT``: a Ctrl-C in the
terminal is the caller's to handle.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main"]


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main() -> None:
    parent = os.getppid()
    threading.Thread(
        target=_watch_parent, args=(parent,), name="gradmap-parent", daemon=True
    ).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    fds = socket.socket(fileno=int(sys.argv[2]))
    init = pickle.loads(conn.recv_bytes())
    for path in reversed(init["path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.chdir(init["cwd"])

    from ._host import ProcessHost  # torch is imported here, after the path is set

    host = ProcessHost(init["threads"], fds)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        method, args = pickle.loads(message)
        try:
            reply: Any = ("ok", getattr(host, method)(*args))
        except BaseException as exc:
            reply = _error(exc)
        try:
            conn.send_bytes(_dumps(reply))
        except (BrokenPipeError, ConnectionResetError):
            break
    os._exit(0)  # no atexit work: the caller is gone or done


def _dumps(reply: Any) -> bytes:
    try:
        return pickle.dumps(reply, protocol=5)
    except Exception as exc:
        return pickle.dumps(_error(exc), protocol=5)


def _error(exc: BaseException) -> tuple[str, bytes | None, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    import cloudpickle

    payload: bytes | None
    try:
        payload = cloudpickle.dumps(exc, protocol=5)
        pickle.loads(payload)
    except Exception:
        # NOTE [an error that does not load]: an exception pickles as its class and args, and
        # loads by calling the class with them; one whose __init__ takes other arguments than
        # it passes on (``SolverDiverged(step, residual)`` calling ``super().__init__(text)``)
        # does not load, and came back a RuntimeError that ``except SolverDiverged`` missed.
        # Such an error travels as its class, args and attributes, made without __init__.
        try:
            payload = cloudpickle.dumps(_Rebuilt(exc), protocol=5)
        except Exception:
            payload = None
    return ("error", payload, text)


class _Rebuilt:
    """An exception that pickles as its class, args and attributes (NOTE [an error that does
    not load])."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        exc = self.exc
        return rebuilt_error, (type(exc), exc.args, dict(getattr(exc, "__dict__", {})))


def rebuilt_error(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]
) -> BaseException:
    """An exception of ``cls`` with ``args`` and attributes ``state``, made without its
    ``__init__``."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc
