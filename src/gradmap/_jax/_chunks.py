"""What a chunk does around each element: stop early when told, and wait for its arrays.

A chunk checks between elements whether it should stop: after a failure, ``run.stopped(k)`` lets
chunks before the failing one run on, so that the error reported is the lowest element's, as in
the loop.

NOTE [a worker waits for each element]:
    JAX dispatches asynchronously: ``f`` returns arrays that XLA is still computing, and a worker
    can dispatch a whole chunk before any of it ran. Threads that dispatched without waiting
    sometimes overlapped poorly (jax 0.10.2, 2 cores, 32 elements of a jitted 1500-step 16x16
    matmul chain, best of 10: the loop 29.5 ms; two threads that never wait 30.7 ms at 1.16
    cores busy, as a ``ThreadPoolExecutor.map`` did; threads that wait for each element 23.4 ms
    at 1.88 cores), and sometimes well (a later run, best of 20: loop 29.4 ms; never waiting,
    waiting for each element and waiting for the element before last all 18.4-18.8 ms). Waiting
    for each element costs the overlap of one element's Python (tracing, dispatch) with the
    previous element's execution in the same thread. So a worker waits for the element before
    last (``Pending.LAG = 1``): at most two of its elements are in flight, and its Python still
    overlaps its own executions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import jax

from .._engine import ChunkRun
from .._errors import add_note, element_note
from .._plan import ChunkPlan

__all__ = ["TMAP", "TSUM", "Pending", "chunk_elements", "settled"]

# The names in error messages and notes.
TMAP = "gradmap.jax.tmap"
TSUM = "gradmap.jax.tsum"

T = TypeVar("T")


def chunk_elements(run: ChunkRun[Any], k: int, plan: ChunkPlan) -> Iterator[int]:
    """The elements of chunk ``k``, in order, until the pass says the chunk should stop."""
    for i in range(*plan.bounds(k)):
        if run.stopped(k):
            return
        yield i


def settled(tree: T) -> T:
    """``tree`` once XLA has computed its arrays (see NOTE [a worker waits for each element]);
    tracers (a pullback run under ``vmap``) have nothing to wait for."""
    if isinstance(tree, jax.Array):
        if not isinstance(tree, jax.core.Tracer):
            tree.block_until_ready()
        return tree
    arrays = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    ]
    if arrays:
        jax.block_until_ready(arrays)
    return tree


class Pending:
    """A worker's elements in flight: ``push`` an element's arrays, and those pushed ``LAG``
    elements before are waited for (see NOTE [a worker waits for each element]); ``wait`` for
    the rest. An error that surfaces while waiting gets the note of its element (of ``api``)."""

    LAG = 1  # elements a worker may have in flight besides the one it is dispatching

    def __init__(self, n: int, phase: str, api: str, lag: int | None = None) -> None:
        self._n = n
        self._phase = phase
        self._api = api
        self._lag = self.LAG if lag is None else lag
        self._trees: list[tuple[int, Any]] = []

    def push(self, index: int, tree: Any) -> None:
        self._trees.append((index, tree))
        while len(self._trees) > self._lag:
            self._settle()

    def wait(self) -> None:
        while self._trees:
            self._settle()

    def _settle(self) -> None:
        index, tree = self._trees.pop(0)
        try:
            settled(tree)
        except BaseException as exc:
            add_note(exc, element_note(index, self._n, self._phase, self._api))
            raise
