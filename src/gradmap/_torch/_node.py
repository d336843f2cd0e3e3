"""The join node: the one ``autograd.Function`` of a map, whose inputs are every chunk's boundary
and whose outputs are its differentiable results; for threads (``_map``, ``_sum``) and for the
driver of a map in other processes (``gradmap/_remote/_map.py``) alike.

NOTE [the join node]:
    Each chunk runs ``f`` untouched (NOTE [forward placement] says in which thread) and leaves a
    record: its outputs with their graph, and its boundary, read off that graph (NOTE [the boundary
    of a chunk] in ``_graph``). One ``autograd.Function`` -- the join -- then takes as inputs every
    chunk's boundary tensors, each once (``_join.JoinLayout``), and returns detached aliases of
    every differentiable result: the user's graph sees the whole map as one node, whose edges are
    the leaves and the tensors made before the call that the map reached. Those are only known
    once ``f`` has run, which is why the chunks run before ``apply``.

    The join's backward splits the cotangents by chunk and runs each chunk's pullback on the
    executor: one ``autograd.grad`` with the chunk's boundary as ``inputs`` (the engine runs it
    without the GIL, so chunks pull back in parallel, and writes no ``.grad``). Elements whose
    cotangents are all missing or zero do no backward work. The gradients of an input several
    chunks reach are added in chunk order (NOTE [chunk-order sum]).

    ``retain_graph``: chunk graphs are always pulled back with ``retain_graph=True`` (so a failing
    chunk can be pulled back element by element to name the element) and dropped after the
    backward unless the outer backward keeps the graph; a second backward then fails with
    PyTorch's own error. A backward of some of a map's results frees only their chunks' share,
    as the loop's frees only their elements' graphs (NOTE [a backward of some results] in
    ``_join``).

NOTE [one backward of a join at a time]:
    Two threads may pull back different results of one map at once (``autograd.grad`` of the
    even results in one, of the odd in another), as they may two elements' graphs in the loop.
    The join's account of what was gone through, and the freeing of the map's state when the
    last result is, are not safe to interleave: the backward that spends the last results could
    free what the other backward's pullbacks still run (``remat``'s recompute failed so). So
    each join runs one backward at a time (a lock per join node; reentrant, for a backward that
    reaches the same join again from the caller's thread); the chunks of each still pull back in
    parallel.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from .._join import JoinLayout
from ._chunk import ChunkRecord

__all__ = ["JoinGraph", "JoinNode", "layout_of"]

Tensor = torch.Tensor


def layout_of(records: Sequence[ChunkRecord]) -> JoinLayout[Tensor]:
    """Where each chunk's boundary and differentiable results sit among the join's inputs and
    outputs."""
    return JoinLayout(
        [r.boundary.tensors for r in records],
        [r.boundary.keys for r in records],
        [len(r.outputs) for r in records],
    )


class JoinGraph:
    """What a join node holds: the outputs it hands out, once, and its backward."""

    def join_context(self) -> AbstractContextManager[object]:
        """The context the join's forward runs in."""
        return nullcontext()

    def join_outputs(self) -> tuple[Tensor, ...]:
        """The join's outputs (its forward's), handed out once."""
        raise NotImplementedError

    def join_backward(self, ctx: Any, cotangents: tuple[Tensor | None, ...]) -> Sequence[Any]:
        """The gradient of each join input (``None`` where none), given the outputs'
        cotangents; ``ctx`` is the join's. Raises PyTorch's error for outputs that a backward
        freeing the graph went through before (``_join.Spent``)."""
        raise NotImplementedError


class _Join(torch.autograd.Function):
    """The join: ``JoinNode.apply(graph, *inputs)`` returns ``graph``'s outputs, as one node of
    the caller's graph whose edges are ``inputs``."""

    @staticmethod
    def forward(ctx: Any, graph: JoinGraph, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.graph = graph
        ctx.lock = threading.RLock()  # NOTE [one backward of a join at a time]
        ctx.set_materialize_grads(False)
        with graph.join_context(), _collection_paused():
            return graph.join_outputs()

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        # (It saves nothing for the engine to free: the graph keeps its own account of what a
        # backward went through, NOTE [a backward of some results] in ``_join``.)
        graph: JoinGraph = ctx.graph
        with ctx.lock:
            return (None, *graph.join_backward(ctx, cotangents))


@contextmanager
def _collection_paused() -> Iterator[None]:
    """No automatic garbage collection while the join's outputs are made.

    NOTE [no collection while the join hands out]:
        The join makes one tensor object per result (``detach``), thousands for a map of small
        elements, and every 700 new objects the interpreter runs a collection of the young
        generation, every tenth of those the next one: a third to a half of the join's time
        (small bags, 2,048 results: the join took 4.6 ms with collections, 2.2 ms without).
        These objects make no cycles, so the collections find nothing; they are paused while
        the outputs are made (unless they are off already) and the interpreter collects once
        after, as it would have anyway.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


#: The join; its node in the caller's graph is a ``_JoinBackward`` (``_SumJoinBackward`` for
#: ``tsum`` on threads: a subclass), as users see in ``grad_fn``.
JoinNode = _Join
