"""The map: ``tmap`` on threads -- the chunks' forwards, their results wired into the caller's
graph through the join node (NOTE [the join node] in ``_node``), and the join's backward: every
chunk's pullback on the executor, summed in a fixed order (NOTE [chunk-order sum] in ``_join``).

NOTE [double backward recomputes]:
    A first-order gradient built with ``create_graph=True`` refers to the nodes of the graph it
    was pulled back through. Built on a chunk's stored graph, a second-order backward would reach
    that graph twice -- directly, and through the join again when the join's cotangent depends on
    the map's results -- and the first pass frees what the second needs. So a ``create_graph``
    backward recomputes each live chunk (replaying autocast and each element's random numbers) and
    pulls back through the fresh graph, which is connected to the same boundary; the stored graph
    stays the join's. ``remat=True`` recomputes the same way, with ``create_graph`` off.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from .._engine import ChunkRun
from .._join import JoinLayout, OrderedSum, Spent
from .._placement import EARLY_BYTES, key_of, learn_uniform_cotangents, uniform_cotangents
from .._request import MapRequest
from .._tree import fill_leaves
from ._call import CALLER, MapCall
from ._chunk import ACCUMULATE, ChunkRecord, nonzero_stacked, pull_back, stack_small
from ._early import (
    EarlyGradients,
    add_into,
    early_then_rest,
    forward_pulled_back,
    one_cotangent,
    unscaled,
)
from ._graph import (
    BlockHooks,
    Known,
    batched,
    buffers_kept,
    caller_only,
    hooks_quiet,
    keep_graph,
    needed,
    plain_backward,
    retains_grad,
)
from ._node import JoinGraph, JoinNode, layout_of
from ._state import ThreadState

__all__ = ["MapGraph", "map_torch"]

Tensor = torch.Tensor


def map_torch(request: MapRequest) -> list[Any]:
    """``[f(*args) for args in elements]`` on the request's executor (threads: chunks share the
    caller's memory), differentiable as the loop is."""
    f, elements = request.f, request.elements
    if caller_only() is not None:  # NOTE [state only the caller's thread has]
        return [f(*args) for args in elements]
    with_graph = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    # NOTE [tmap's losses pulled back early] (``_early``)
    early = (
        with_graph
        and request.executor.workers > 1  # (in one thread it would overlap nothing)
        and not request.remat
        and not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
        and uniform_cotangents(key_of(f))
    )
    call = MapCall(request, early=early)
    if with_graph:
        call.known = Known(f, elements, eager=True)
    if early:
        records, gradients = forward_pulled_back(call, keep_graphs=True)
        return _join(call, records, gradients)
    records = call.forward(with_graph)
    if not with_graph:
        return [y for r in records for y in r.plain_results()]
    return _join(call, records)


def _join(
    call: MapCall, records: list[ChunkRecord], early: EarlyGradients | None = None
) -> list[Any]:
    """Wire the chunks' results into the caller's graph through one join node (``early``: the
    gradients with cotangent one of the chunks pulled back in the forward)."""
    layout = layout_of(records)
    outputs = [t for r in records for t in r.outputs]
    if outputs and layout.inputs:
        graph = MapGraph(call, records, layout, early)
        joined: Sequence[Tensor] = JoinNode.apply(graph, *layout.inputs)
        graph.retained = _retained(records, joined, look=not call.gated)
    else:
        joined = outputs
        call.free()

    results: list[Any] = []
    start = 0
    for r in records:
        if r.results is not None:  # NOTE [a chunk of bare tensors]: the join's outputs in turn
            if r.results is r.outputs:
                results += joined[start : start + len(r.outputs)]
            else:
                results += r.results
        else:
            # The results take the leaves over: the graph keeps no reference to the join's
            # outputs (which would make a cycle through the join node's context).
            taken = ((el.take(), el.spec, el.diff) for el in r.elements)
            results += fill_leaves(taken, joined[start : start + len(r.outputs)])
        start += len(r.outputs)
    return results


def _retained(
    records: list[ChunkRecord], joined: Sequence[Tensor], *, look: bool
) -> list[tuple[weakref.ref[Tensor], ChunkRecord, int]]:
    """The join outputs for results on which ``f`` called ``retain_grad()``, made to retain
    theirs, each with its chunk and its place among the chunk's outputs.

    NOTE [results that retain their gradient]:
        The loop hands out the tensor ``f`` called ``retain_grad()`` on, and the backward fills
        its ``.grad`` with all the gradient that reaches it, from the user's loss and from
        ``f``'s own later use of it. The user holds the join's output instead: it retains its
        gradient too, and after each backward the map's join sets it to the result's own
        ``.grad``, which the chunk's pullback filled with the whole of it (under ``remat``, the
        recomputed result's, added up over backwards: ``ChunkRecord.retained``). Only chunks
        whose walk found a hook are looked at (``Boundary.user``; every chunk with the Python
        walk, ``look``).
    """
    retained = []
    start = 0
    for r in records:
        if r.stored and (look or r.boundary.user):
            places = [o for o, t in enumerate(r.outputs) if t.retains_grad]
        else:
            places = list(r.retained or ())  # (noted before a remat forward freed the graph)
        for o in places:
            alias = joined[start + o]
            alias.retain_grad()
            retained.append((weakref.ref(alias), r, o))
        start += len(r.outputs)
    return retained


class MapGraph(JoinGraph):
    """The state shared by the join node's forward and backward."""

    def __init__(
        self,
        call: MapCall,
        records: list[ChunkRecord],
        layout: JoinLayout[Tensor],
        early: EarlyGradients | None = None,
    ):
        self.call = call
        self.records: list[ChunkRecord] | None = records
        self.layout = layout
        #: NOTE [tmap's losses pulled back early]: the chunks' gradients with cotangent one.
        self.ones = early
        self.key = key_of(call.f)
        self.outputs = [t for r in records for t in r.outputs]
        self.spent = Spent(len(self.outputs))
        #: NOTE [results that retain their gradient]: (the join output, the result) pairs.
        self.retained: list[tuple[weakref.ref[Tensor], ChunkRecord, int]] = []
        hooks = BlockHooks((node for r in records for node in r.boundary.nodes), call.owner)
        # Removed in the caller's backward once the graph is done with (the finalizer is for a
        # graph never pulled back): a collection in any thread could otherwise remove them while
        # another map's pullback runs the same shared node's pre-hooks.
        self._remove_hooks = weakref.finalize(self, hooks.remove)

    def join_outputs(self) -> tuple[Tensor, ...]:
        outputs, self.outputs = self.outputs, []
        joined = [t.detach() for t in outputs]
        start = 0
        for r in self.records or ():
            # NOTE [results that view a tensor made before the map] (``_chunk``)
            for i in r.views or ():
                t = outputs[start + i]
                joined[start + i] = t.view_as(t)
            start += len(r.outputs)
        return tuple(joined)

    def join_backward(self, ctx: Any, cotangents: tuple[Tensor | None, ...]) -> list[Any]:
        call, layout, spent = self.call, self.layout, self.spent
        free_graph = not keep_graph()
        spent.spend(cotangents, free=free_graph)  # raises for results gone through before
        records = self.records
        assert records is not None
        create_graph = torch.is_grad_enabled()
        fresh = call.recompute if (create_graph or call.remat) else None
        if fresh is not None:
            call.check_versions()  # NOTE [a recompute reads what the forward read] (``_graph``)
        wanted = self.wanted(ctx)
        # Which cotangents are zero, for every chunk in one stack here (a map's losses), not per
        # chunk in the pullbacks' threads: five small ops per chunk there held the GIL the
        # engine's threads wanted (py-spy, ragged bags: a tenth of the pullbacks' GIL time).
        under_vmap = batched(cotangents)
        stacked = None if under_vmap else stack_small(cotangents)
        nonzero = (
            None if fresh is not None or stacked is None else nonzero_stacked(cotangents, stacked)
        )
        one = None if create_graph or under_vmap else one_cotangent(cotangents, stacked)
        if call.api == "gradmap.tmap" and not call.remat:
            learn_uniform_cotangents(self.key, one is not None and self.early_fits())
        early = self.ones if one is not None and fresh is None and not self.retained else None
        scale = None if one is None or unscaled(one, not free_graph) else one
        first = None if early is None or not any(early.pulled) else early.added(layout)

        def backward_chunk(k: int, run: ChunkRun[Any]) -> Any:
            if first is not None and early is not None and early.pulled[k]:
                return None  # (in ``first``)
            return pull_back(
                records[k],
                chunk_cotangents(k),
                n=call.n,
                owner=call.owner,
                recompute=fresh,
                create_graph=create_graph,
                free_graph=free_graph and self.chunk_spent(k),
                rerun=call.recompute,
                wanted=wanted(k),
                nonzero=None if nonzero is None else chunk_nonzero(k, nonzero),
                api=call.api,
                made_before=call.made_before,
            )

        def chunk_nonzero(k: int, flags: list[bool]) -> list[bool]:
            lo, hi = layout.output_bounds[k]
            return flags[lo:hi]

        def chunk_cotangents(k: int) -> Sequence[Tensor | None]:
            lo, hi = layout.output_bounds[k]
            return cotangents[lo:hi]

        return self.backward(
            backward_chunk,
            chunk_cotangents,
            create_graph=create_graph,
            recomputes=fresh is not None,
            batched=under_vmap,
            first=first,
            scale=scale,
        )

    def early_fits(self) -> bool:
        """Whether a gradient of every join input stays within ``EARLY_BYTES`` (NOTE [tmap's
        losses pulled back early]): the early chunks' gradients are added up as they come, one
        sum per tensor kept to the backward (NOTE [gradients added as they come]). A tensor's
        size is its dense gradient's, the most a gradient of it (of any layout: a sparse one's
        sum over elements grows with them, uncoalesced) holds; ``nbytes`` has no sparse value."""
        return sum(t.numel() * t.element_size() for t in self.layout.inputs) <= EARLY_BYTES

    def chunk_spent(self, k: int) -> bool:
        """Whether backwards that free the graph went through all of chunk ``k``'s results."""
        return self.spent.spent(*self.layout.output_bounds[k])

    def wanted(self, ctx: Any) -> Callable[[int], list[bool] | None]:
        """For each chunk, which of its boundary entries the running backward needs (``None``:
        all): ``autograd.grad`` with some inputs runs no element that reaches none of them, as
        the engine prunes the loop's graph. ``ctx``: the join's, in its backward."""
        mask = needed(ctx, len(self.layout.inputs))
        if all(mask):
            return lambda k: None
        positions = self.layout.positions
        return lambda k: [mask[p] for p in positions[k]]

    def backward(
        self,
        backward_chunk: Callable[[int, ChunkRun[Any]], Any],
        chunk_cotangents: Callable[[int], Sequence[Tensor | None]],
        *,
        create_graph: bool,
        recomputes: bool,
        batched: bool = False,
        first: list[Tensor | None] | None = None,
        scale: Tensor | None = None,
    ) -> list[Tensor | None]:
        """The join's backward: every chunk's pullback on the executor, its gradients added in
        chunk order as they come (NOTE [gradients added as they come] in ``_join``), the chunks
        that need a plain ``backward()`` after them (NOTE [reentrant checkpoint]); and ``first``,
        the gradients of the chunks pulled back in the forward, added up (``None``: none; their
        ``backward_chunk`` gives ``None``), times ``scale`` (``early_then_rest``).
        ``batched``: a backward under vmap, whose levels only this thread knows: the chunks are
        pulled back here, one after another."""
        call, layout, records = self.call, self.layout, self.records
        assert records is not None
        state = ThreadState(grad_enabled=create_graph)
        # The Python walk's pullbacks reach the boundary tensors' own hooks: a retained
        # gradient's hook writes .grad from each pullback (one at a time), and the hooks are set
        # aside meanwhile. Past the native walk's gates no pullback runs them.
        gated = call.gated
        serial = CALLER if batched or (not gated and retains_grad(layout.inputs)) else None
        # NOTE [pullbacks on threads of their own] (``_executors``)
        pullbacks = serial or call.executor.for_pullbacks()
        quiet = nullcontext() if gated else hooks_quiet(layout.inputs)
        into = None if create_graph or batched else add_into  # (no sum in place in a graph)
        summed: OrderedSum[int, Tensor] = OrderedSum(len(records), torch.add, call.plan.group, into)
        positions = layout.positions
        plain: list[int] = []  # chunks to pull back with a plain backward()

        def pulled_back(k: int, run: ChunkRun[Any]) -> None:
            grads = backward_chunk(k, run)
            if grads is ACCUMULATE:
                plain.append(k)
                grads = None  # the plain backward passes everything on
            summed.put(k, None if grads is None else zip(positions[k], grads))

        try:
            with quiet, buffers_kept(call.f) if recomputes else nullcontext():
                call.run_pass(
                    "backward",
                    pulled_back,
                    executor=pullbacks,
                    reverse=call.executor.reverse_backward,
                    context=state.enter,
                    last_wins=True,  # NOTE [the error of the loop's element] (``_schedule``)
                )
        except BaseException as exc:
            summed.clear()
            if create_graph:
                call.state.explain_recompute(exc, call.api)
            raise
        for k in sorted(plain):
            _accumulate(call, records[k], chunk_cotangents(k))
        rest: list[Tensor | None] = [None] * len(layout.inputs)
        for p, g in summed.result().items():
            rest[p] = g
        grads = early_then_rest(first, scale, rest)
        for ref, record, o in self.retained:  # NOTE [results that retain their gradient]
            alias = ref()
            if record.stored:
                grad = record.outputs[o].grad
            else:
                grad = record.retained[o] if isinstance(record.retained, dict) else None
            if alias is not None and grad is not None:
                alias.grad = grad
        if not keep_graph():
            if self.spent.left == 0:
                self.retained = []
                self.records = None
                self.ones = None
                call.free()
                self._remove_hooks()
            else:  # a backward of some results: the chunks whose results are all gone through
                for k, record in enumerate(records):
                    if record.stored and self.chunk_spent(k):
                        record.drop_graph()
        return grads


def _accumulate(call: MapCall, record: ChunkRecord, cotangents: Sequence[Tensor | None]) -> None:
    """A chunk's pullback as a plain ``backward()``, in the caller's backward.

    NOTE [reentrant checkpoint]:
        ``torch.utils.checkpoint(..., use_reentrant=True)`` refuses to run inside
        ``autograd.grad`` or a backward with ``inputs=`` -- a chunk pullback -- and in the loop
        works only under a plain ``.backward()``. When a chunk meets it, and the caller's backward
        is such a plain one, the chunk is pulled back the way the loop would: a ``backward()`` of
        its outputs, run here in the caller's backward, one chunk after another in chunk order,
        accumulating into the leaves' ``.grad`` and running the graph behind the chunk's
        non-leaf boundary with the chunk's share (so the join passes nothing on for that
        chunk). Under ``autograd.grad`` the loop fails with PyTorch's error, and so does the map.
    """
    if not plain_backward():
        raise RuntimeError(
            "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or "
            "passing an `inputs` parameter to .backward(); f uses it, so the map's backward "
            "must be a plain .backward() too, as in the loop. Fix: use_reentrant=False."
        )
    live = [
        e
        for e, el in enumerate(record.elements)
        if any(cotangents[o] is not None for o in range(*el.outputs))
    ]
    source = record if record.stored else call.recompute([record.elements[e].index for e in live])
    outs, grads = [], []
    for e, el in enumerate(source.elements):
        original = record.elements[e if record.stored else live[e]]
        for o, o_src in zip(range(*original.outputs), range(*el.outputs)):
            g = cotangents[o]
            if g is not None:
                outs.append(source.outputs[o_src])
                grads.append(g)
    torch.autograd.backward(outs, grads, retain_graph=True)
