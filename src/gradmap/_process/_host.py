"""The host of a worker process: ``gradmap._remote``'s host, with ``f``'s payloads kept by digest
and storages in shared memory received as file descriptors."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

from .._remote._host import CallSpec, Host
from .._remote._pickling import LeafTable
from ._shared import FDS_PER_MESSAGE, worker_storages

__all__ = ["PAYLOADS_KEPT", "ProcessHost"]

#: Payloads of ``f`` (and the functions unpickled from them) a worker keeps, by digest; the
#: caller keeps the same account of what each worker holds.
PAYLOADS_KEPT = 8


class ProcessHost(Host):
    """What a worker process runs (see ``_worker.py`` for the loop around it)."""

    executor = "processes"
    functions_kept = PAYLOADS_KEPT

    def __init__(self, threads: int, fds: socket.socket) -> None:
        super().__init__(threads)
        # A thread takes the descriptors off their socket as they come: a datagram socket holds
        # only a few messages, and the caller must never block on sending them.
        self._received: queue.SimpleQueue[int | None] = queue.SimpleQueue()

        def receive() -> None:
            try:
                while True:
                    _, fds_got, _, _ = socket.recv_fds(fds, 16, FDS_PER_MESSAGE)
                    if not fds_got:
                        break
                    for fd in fds_got:
                        self._received.put(fd)
            except OSError:
                pass
            self._received.put(None)

        threading.Thread(target=receive, name="gradmap-fds", daemon=True).start()

    # A box is ``(digest, payload or None)``: the payload comes the first time this worker needs
    # it, and the caller's account of what each worker keeps mirrors the host's functions
    # (every call with a box touches both, in the same order); ``f`` is unpickled when a call
    # first needs it.

    def _touch(self, box: tuple[bytes, bytes | None]) -> None:
        self._functions.touch(*box)

    def load_f(self, box: Any) -> tuple[Any, LeafTable]:
        return self._kept_function(box[0], lambda: box[1])

    # The forwards answer with the seconds they took last: the caller learns how long a map's
    # elements take (NOTE [the caller works too]); the transport takes them off.

    def forward(self, call_id: str, box: Any, spec: CallSpec, chunks: list[Any]) -> list:
        start = time.perf_counter()
        self._touch(box)
        return [*super().forward(call_id, box, spec, chunks), time.perf_counter() - start]

    def forward_sum(
        self,
        call_id: str,
        box: Any,
        spec: CallSpec,
        chunks: list[Any],
        folds: list[list[int]] | None = None,
    ) -> list:
        start = time.perf_counter()
        self._touch(box)
        out = super().forward_sum(call_id, box, spec, chunks, folds)
        return [*out, time.perf_counter() - start]

    def recompute(
        self,
        call_id: str,
        box: Any,
        spec: CallSpec,
        chunks: list[Any],
        state: Any,
        wanted: list[int] | None = None,
    ) -> list:
        self._touch(box)
        return super().recompute(call_id, box, spec, chunks, state, wanted)

    # -- shared storages ----------------------------------------------------------------------

    def share(self, entries: list[tuple[tuple[int, int], int]]) -> None:
        """Receive the file descriptor of each ``(key, size)``, sent on the second socket."""
        for key, size in entries:
            fd = self._received.get()
            if fd is None:
                raise RuntimeError("gradmap: the caller closed the socket of shared storages")
            worker_storages.add(key, fd, size)

    def forget(self, keys: list[tuple[int, int]]) -> None:
        worker_storages.forget(keys)
