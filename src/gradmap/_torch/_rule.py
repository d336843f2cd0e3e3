"""The rule: chunk forwards, one join node, per-chunk pullbacks in parallel, a chunk-order sum.

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
    PyTorch's own error, raised by the join's saved (dummy) tensor.

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
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from .._engine import ChunkRun, run_chunks, run_pipeline
from .._executors import Executor, FuturesExecutor, SerialExecutor, ThreadExecutor
from .._join import JoinLayout, sum_in_chunk_order
from .._placement import Placement, placement_for
from .._plan import ChunkPlan
from .._progress import open_progress
from .._tree import flatten, unflatten
from ._chunk import ACCUMULATE, DEFERRED, ChunkRecord, pull_back, pull_back_sum, run_forward
from ._graph import (
    BlockHooks,
    Known,
    buffers_kept,
    hooked,
    hooks_quiet,
    keep_graph,
    needed,
    plain_backward,
    retains_grad,
    transforms_active,
)
from ._native import native
from ._random import MapRandom
from ._state import ThreadState
from ._swaps import guard_parameter_swaps

__all__ = ["map_torch", "sum_results", "sum_torch"]

Tensor = torch.Tensor

_CALLER = SerialExecutor()


class MapCall:
    """One call of ``tmap``/``tsum``: what every pass needs."""

    def __init__(
        self,
        f: Callable[..., Any],
        elements: list[tuple[Any, ...]],
        executor: Executor,
        plan: ChunkPlan,
        *,
        remat: bool,
        progress: Any,
        placement: str,
        api: str,
    ) -> None:
        self.f: Callable[..., Any] | None = f
        self.elements: list[tuple[Any, ...]] | None = elements
        self.executor = executor
        self.plan = plan
        self.remat = remat
        self.progress = progress
        self.api = api
        self.n = len(elements)
        self.state = ThreadState()
        self.random = MapRandom()
        self.placement: Placement = placement_for(
            f,
            forced_many=placement == "many",
            forced_one=placement == "one",
            # maps of one f over counts within a factor of two share a history
            kind=(api, remat, torch.is_grad_enabled(), len(elements).bit_length()),
        )
        self.known: Known | None = None
        self.owner = object()  # what this map's blocking hooks answer to
        if executor.workers > 1:
            guard_parameter_swaps()  # NOTE [parameters swapped by functional_call]

    @property
    def gated(self) -> bool:
        """Whether chunk boundaries come from the native walk (NOTE [the native walk])."""
        return native() is not None

    # -- passes -------------------------------------------------------------------------------

    def run_pass(
        self,
        phase: str,
        run_chunk: Callable[[int, ChunkRun[Any]], Any],
        *,
        executor: Executor | None = None,
        reverse: bool = False,
        context: Callable[[bool], Any] | None = None,
    ) -> list[Any]:
        """One pass over the chunks, with the caller's state and an optional progress bar."""
        plan = self.plan
        bar = open_progress(self.progress, phase, plan.n, self.api)
        on_done = None if bar is None else (lambda k: bar.update(len(range(*plan.bounds(k)))))
        try:
            return run_chunks(
                executor or self.executor,
                plan.count,
                run_chunk,
                reverse=reverse,
                context=context or self.state.enter,
                on_done=on_done,
            )
        finally:
            if bar is not None:
                bar.close()

    def forward(self, with_graph: bool) -> list[ChunkRecord]:
        """Every chunk's forward, placed in one thread or on the pool."""
        f, elements, plan = self.f, self.elements, self.plan
        assert f is not None and elements is not None
        known = self.known if with_graph else None
        placement = self.placement
        seeded = None if placement.many else self.random

        def forward_chunk(k: int, run: ChunkRun[ChunkRecord]) -> ChunkRecord:
            record = run_forward(
                f,
                elements,
                range(*plan.bounds(k)),
                known=known,
                random=seeded,
                stop=lambda: run.stopped(k),
                api=self.api,
            )
            if self.remat:
                record.drop_graph()  # its boundary is read: free it before the next chunk
            return record

        def one_thread() -> list[ChunkRecord]:
            with self.random.seeding():
                return self.run_pass("forward", forward_chunk, executor=self.one_thread())

        if placement.many:
            records = placement.timed(lambda: self.run_pass("forward", forward_chunk), self.n)
        else:
            records = placement.timed(one_thread, self.n)
        placement.learned_random(self.random.drew)
        return records

    @property
    def off_caller(self) -> bool:
        """Whether chunk forwards may run on other threads than the caller's."""
        return not isinstance(self.executor, SerialExecutor)

    def one_thread(self) -> Executor:
        """Where a forward in one thread runs: the caller's thread for the serial reference (as
        its loop would), one thread of a user's executor (NOTE [a user's executor runs every
        chunk]), else one of gradmap's pool threads, which compute as the pool's other threads do
        (one intra-op thread: NOTE [forward placement])."""
        if isinstance(self.executor, ThreadExecutor):
            return ThreadExecutor(1)
        if isinstance(self.executor, FuturesExecutor):
            return self.executor.one_thread()
        return _CALLER

    def recompute(self, indices: list[int], seeded: bool = False) -> ChunkRecord:
        """A fresh forward of some elements, with a graph (in a backward pass's thread); with
        ``seeded``, replaying each element's random numbers even if ``f`` was not seen to draw."""
        assert self.f is not None and self.elements is not None and self.known is not None
        self.known.complete()
        replay = self.random.replaying(seeded)
        with torch.enable_grad(), self.state.autocast_context(), replay as seeded_by:
            return run_forward(
                self.f, self.elements, indices, known=self.known, random=seeded_by, api=self.api
            )

    def free(self) -> None:
        self.f = self.elements = None
        self.known = None


def map_torch(
    f: Callable[..., Any],
    elements: list[tuple[Any, ...]],
    executor: Executor,
    plan: ChunkPlan,
    *,
    remat: bool = False,
    progress: Any = False,
    placement: str = "auto",
) -> list[Any]:
    """``[f(*args) for args in elements]`` on ``executor`` (threads: chunks share the caller's
    memory), differentiable as the loop is."""
    if transforms_active():
        # NOTE [torch.func and forward AD]: functorch's interpreter stack and forward-AD levels
        # are state the worker threads do not share, and the join node has no forward rule, so
        # under a transform the map runs as the plain loop, in the caller's thread.
        return [f(*args) for args in elements]
    call = MapCall(
        f,
        elements,
        executor,
        plan,
        remat=remat,
        progress=progress,
        placement=placement,
        api="gradmap.tmap",
    )
    with_graph = torch.is_grad_enabled() and not call.state.inference
    if with_graph:
        call.known = Known(f, elements, eager=call.off_caller)
    records = call.forward(with_graph)
    if not with_graph:
        return [unflatten(el.leaves, el.spec) for r in records for el in r.elements]
    return _join(call, records)


def _join(call: MapCall, records: list[ChunkRecord]) -> list[Any]:
    """Wire the chunks' results into the caller's graph through one join node."""
    layout: JoinLayout[Tensor] = JoinLayout(
        [r.boundary.tensors for r in records],
        [r.boundary.keys for r in records],
        [len(r.outputs) for r in records],
    )
    outputs = [t for r in records for t in r.outputs]
    if outputs and layout.inputs:
        graph = _MapGraph(call, records, layout)
        joined: Sequence[Tensor] = _Join.apply(graph, *layout.inputs)
    else:
        joined = outputs
        call.free()
    results: list[Any] = []
    j = 0
    for r in records:
        for el in r.elements:
            # The results take the leaves over: the graph keeps no reference to the join's
            # outputs (which would make a cycle through the join node's context).
            leaves, el.leaves = el.leaves, []
            for pos in el.diff:
                leaves[pos] = joined[j]
                j += 1
            results.append(unflatten(leaves, el.spec))
    return results


class _MapGraph:
    """The state shared by the join node's forward and backward."""

    def __init__(self, call: MapCall, records: list[ChunkRecord], layout: JoinLayout[Tensor]):
        self.call = call
        self.records: list[ChunkRecord] | None = records
        self.layout = layout
        self.outputs = [t for r in records for t in r.outputs]
        hooks = BlockHooks((node for r in records for node in r.boundary.nodes), call.owner)
        # Removed in the caller's backward once the graph is done with (the finalizer is for a
        # graph never pulled back): a collection in any thread could otherwise remove them while
        # another map's pullback runs the same shared node's pre-hooks.
        self._remove_hooks = weakref.finalize(self, hooks.remove)

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
    ) -> tuple[Tensor | None, ...]:
        """The join's backward: every chunk's pullback on the executor, the chunks that need a
        plain ``backward()`` after them (NOTE [reentrant checkpoint]), the chunk-order sum."""
        call, layout, records = self.call, self.layout, self.records
        assert records is not None
        state = ThreadState(grad_enabled=create_graph)
        # The Python walk's pullbacks reach the boundary tensors' own hooks: a retained
        # gradient's hook writes .grad from each pullback (one at a time), and the hooks are set
        # aside meanwhile. Past the native walk's gates no pullback runs them.
        gated = call.gated
        serial = _CALLER if not gated and retains_grad(layout.inputs) else None
        quiet = nullcontext() if gated else hooks_quiet(layout.inputs)
        with quiet, buffers_kept(call.f) if recomputes else nullcontext():
            per_chunk = call.run_pass(
                "backward",
                backward_chunk,
                executor=serial,
                reverse=call.executor.reverse_backward,
                context=state.enter,
            )
        for k, grads_k in enumerate(per_chunk):
            if grads_k is ACCUMULATE:
                _accumulate(call, records[k], chunk_cotangents(k))
                per_chunk[k] = None  # the plain backward passed everything on
        grads = sum_in_chunk_order(layout, per_chunk, torch.add)
        if not keep_graph():
            self.records = None
            call.free()
            self._remove_hooks()
        return (None, *grads)


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: _MapGraph, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.graph = graph
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(torch.empty(0))
        outputs, graph.outputs = graph.outputs, []
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ctx.saved_tensors  # noqa: B018 - raises PyTorch's error if the graph was already freed
        graph: _MapGraph = ctx.graph
        call, layout, records = graph.call, graph.layout, graph.records
        assert records is not None
        create_graph = torch.is_grad_enabled()
        fresh = call.recompute if (create_graph or call.remat) else None
        free_graph = not keep_graph()
        wanted = graph.wanted(ctx)

        def backward_chunk(k: int, run: ChunkRun[Any]) -> Any:
            return pull_back(
                records[k],
                chunk_cotangents(k),
                n=call.n,
                owner=call.owner,
                recompute=fresh,
                create_graph=create_graph,
                free_graph=free_graph,
                rerun=call.recompute,
                wanted=wanted(k),
                api=call.api,
            )

        def chunk_cotangents(k: int) -> Sequence[Tensor | None]:
            lo, hi = layout.output_bounds[k]
            return cotangents[lo:hi]

        return graph.backward(
            backward_chunk,
            chunk_cotangents,
            create_graph=create_graph,
            recomputes=fresh is not None,
        )


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


# -- tsum ---------------------------------------------------------------------------------------


def sum_torch(
    f: Callable[..., Any],
    elements: list[tuple[Any, ...]],
    executor: Executor,
    plan: ChunkPlan,
    *,
    remat: bool = False,
    progress: Any = False,
    placement: str = "auto",
) -> Any:
    """``sum(f(*args) for args in elements)``, leaf by leaf, differentiable as the loop is.

    NOTE [tsum pulls back during the forward]:
        When every element's result is one 0-d tensor (a loss), the cotangent of each element
        is the sum's own, whatever it turns out to be; so each chunk is pulled back with
        cotangent one as soon as its forward ends, on the pool, while the next chunks' forwards
        run, and its graph is freed at once (about one chunk's graph per worker is alive). The
        sum's backward multiplies the chunk gradients, added in chunk order, by its cotangent.
        Chunks with other results keep their graph (or nothing, under ``remat``) and are pulled
        back in the sum's backward, with the sum's cotangent for every element; a
        ``create_graph=True`` backward recomputes every chunk (NOTE [double backward
        recomputes]).
    """
    if transforms_active():
        return sum_results(map_torch(f, elements, executor, plan, remat=remat, progress=progress))
    call = MapCall(
        f,
        elements,
        executor,
        plan,
        remat=remat,
        progress=progress,
        placement=placement,
        api="gradmap.tsum",
    )
    if not (torch.is_grad_enabled() and not call.state.inference):
        records = call.forward(False)
        results = [unflatten(el.leaves, el.spec) for r in records for el in r.elements]
        return sum_results(results, [len(r.elements) for r in records])
    call.known = Known(f, elements, eager=call.off_caller)
    return _sum_join(call, _forward_pulled_back(call))


def _loss_like(record: ChunkRecord) -> bool:
    """Whether every element returned one 0-d tensor (requiring grad or not)."""
    return all(
        len(el.leaves) == 1 and (not el.diff or record.outputs[el.outputs[0]].dim() == 0)
        for el in record.elements
    )


def _forward_pulled_back(call: MapCall) -> list[tuple[ChunkRecord, list[Tensor | None] | None]]:
    """Every chunk's forward, each loss-like chunk pulled back with cotangent one at once."""
    f, elements, plan = call.f, call.elements, call.plan
    assert f is not None and elements is not None
    placement = call.placement

    def forward(k: int, stopped: Callable[[], bool], seeded: MapRandom | None) -> ChunkRecord:
        return run_forward(
            f,
            elements,
            range(*plan.bounds(k)),
            known=call.known,
            random=seeded,
            stop=stopped,
            api=call.api,
        )

    def early(
        k: int, record: ChunkRecord, pulled: deque[ChunkRecord] | None = None
    ) -> tuple[ChunkRecord, list[Tensor | None] | None]:
        # A boundary tensor's own hooks (and retained gradient) are set aside only around the
        # sum's backward (``hooks_quiet``): such chunks are pulled back there.
        hooks = not call.gated and hooked(record.boundary.tensors)
        if not record.stored or not _loss_like(record) or hooks:
            if call.remat:
                record.drop_graph()
            return record, None
        keep = pulled is not None
        grads = pull_back_sum(record, n=call.n, owner=call.owner, keep_graph=keep, api=call.api)
        if grads is ACCUMULATE or grads is DEFERRED:  # pulled back (recomputed) in the backward
            return record, None
        if pulled is not None:
            pulled.append(record)
        else:
            record.drop_graph()
        return record, grads

    def pipeline() -> Any:
        bar = open_progress(call.progress, "forward", plan.n, call.api)
        backward_state = ThreadState(grad_enabled=False)
        # NOTE [graphs freed by the producer]: freeing a graph takes the GIL for every tensor
        # with a Python object it frees; done by the pullbacks' threads, it fought the forward
        # for the GIL (a raw experiment: a forward 1.4-1.9x slower alongside). So pullbacks keep
        # their graph, and the producer drops the graphs of pulled-back chunks between its
        # forwards. Measured A/B (2 cores, tsum vs the 1-thread loop, medians of 7-9): tree
        # 1.63-1.65x against 1.48-1.49x, small bags 1.22-1.23x against 1.02-1.21x, ragged bags
        # 1.16-1.22x against 1.26-1.32x (large tensors, few Python objects: freeing them costs
        # the producer).
        pulled: deque[ChunkRecord] = deque()

        def drop_pulled() -> None:
            while pulled:
                pulled.popleft().drop_graph()

        def produce(k: int, stopped: Callable[[], bool]) -> ChunkRecord:
            drop_pulled()
            record = forward(k, stopped, call.random)
            if bar is not None:
                bar.update(len(range(*plan.bounds(k))))
            return record

        try:
            with call.random.seeding():
                return run_pipeline(
                    call.executor,
                    plan.count,
                    produce,
                    lambda k, record: early(k, record, pulled),
                    context=backward_state.enter,
                    produce_context=call.state.enter,
                )
        finally:
            drop_pulled()
            if bar is not None:
                bar.close()

    if placement.many:

        def both(k: int, run: ChunkRun[Any]) -> Any:
            return early(k, forward(k, lambda: run.stopped(k), None))

        out = placement.timed(lambda: call.run_pass("forward", both), call.n)
    else:
        out = placement.timed(pipeline, call.n)
    placement.learned_random(call.random.drew)
    return out  # type: ignore[return-value]


def sum_results(results: list[Any], chunks: list[int] | None = None) -> Any:
    """The leaf-by-leaf sum of the elements' results: within each chunk in element order, then
    the chunks' sums in chunk order (the order of the differentiable path, so that a sum under
    ``no_grad`` is bitwise the one under grad mode). ``chunks``: elements per chunk; ``None``
    for one chunk."""
    if not results:
        raise ValueError(
            "gradmap.tsum: there are no elements to sum; the sum of nothing has no shape. "
            "Check the iterables, or handle an empty batch before the call"
        )
    leaves, spec = flatten(results[0])
    sizes = chunks or [len(results)]
    total: list[Any] | None = None
    i = 0
    for size in sizes:
        start = i
        partial: list[Any] | None = None
        for y in results[i : i + size]:
            more, other = flatten(y)
            if other != spec or len(more) != len(leaves):
                raise ValueError(
                    f"gradmap.tsum: element {i} returned a result of another structure than "
                    "element 0's; every element must return the same structure (a tensor, or a "
                    "pytree of tensors) to be summed"
                )
            partial = more if partial is None else _add(partial, more, (i, i), (start, i - 1))
            i += 1
        assert partial is not None
        total = partial if total is None else _add(total, partial, (start, i - 1), (0, start - 1))
    assert total is not None
    return unflatten(total, spec)


def _sum_join(call: MapCall, chunks: list[tuple[ChunkRecord, list[Tensor | None] | None]]) -> Any:
    """The sum of every element's result, one join node for its differentiable leaves."""
    records = [r for r, _ in chunks]
    first = records[0].elements[0]
    spec = first.spec
    width = len(first.leaves)
    differentiable: set[int] = set()  # leaves that require grad in some element's result
    partial: list[Any] = []
    for r in records:
        totals: list[Any] | None = None
        for el in r.elements:
            if el.spec != spec or len(el.leaves) != width:
                raise ValueError(
                    f"gradmap.tsum: element {el.index} returned a result of another structure "
                    "than element 0's; every element must return the same structure (a tensor, "
                    "or a pytree of tensors) to be summed"
                )
            differentiable.update(el.diff)
            values = list(el.leaves)
            for o, j in zip(range(*el.outputs), el.diff):
                values[j] = r.outputs[o].detach()
            if totals is not None:
                before = (r.elements[0].index, el.index - 1)
                totals = _add(totals, values, (el.index, el.index), before)
            else:
                totals = values
            el.leaves = []
        partial.append(totals)
    sums = partial[0]
    for r, more in zip(records[1:], partial[1:]):
        lo, hi = r.elements[0].index, r.elements[-1].index
        sums = _add(sums, more, (lo, hi), (0, lo - 1))
    diff = sorted(differentiable)
    layout: JoinLayout[Tensor] = JoinLayout(
        [r.boundary.tensors for r in records],
        [r.boundary.keys for r in records],
        [len(r.outputs) for r in records],
    )
    if diff and layout.inputs:
        graph = _SumGraph(call, chunks, layout, [sums[j] for j in diff], diff)
        joined = _SumJoin.apply(graph, *layout.inputs)
        for j, t in zip(diff, joined):
            sums[j] = t
    else:
        call.free()
    return unflatten(sums, spec)


def _add(
    totals: list[Any], values: list[Any], added: tuple[int, int], before: tuple[int, int]
) -> list[Any]:
    """Leaf by leaf, as ``+`` adds in the loop; results that do not add (shapes that do not
    broadcast) raise an error naming the elements on both sides and their shapes.

    Arguments:
        totals: the sum so far, of the elements ``before`` (first and last index).
        values: the result (or partial sum) of the elements ``added`` (first and last index).
    """
    out = []
    for j, (a, b) in enumerate(zip(totals, values)):
        try:
            out.append(a + b)
        except RuntimeError as exc:
            leaf = "" if len(totals) == 1 else f" (leaf {j} of the result's pytree)"
            raise ValueError(
                f"gradmap.tsum: the result of {_elements(added)}{leaf}, of shape "
                f"{_shape(b)}, does not add to the sum of {_elements(before)}, of shape "
                f"{_shape(a)} ({exc}). Every element must return results of one shape (or of "
                "shapes that broadcast together, as + adds them in the loop)."
            ) from exc
    return out


def _elements(span: tuple[int, int]) -> str:
    lo, hi = span
    return f"element {lo}" if lo == hi else f"elements {lo}..{hi}"


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return "()" if shape is None else str(tuple(shape))


class _SumGraph(_MapGraph):
    def __init__(
        self,
        call: MapCall,
        chunks: list[tuple[ChunkRecord, list[Tensor | None] | None]],
        layout: JoinLayout[Tensor],
        sums: list[Tensor],
        diff: list[int],
    ) -> None:
        super().__init__(call, [r for r, _ in chunks], layout)
        self.early = [g for _, g in chunks]
        self.outputs = sums
        self.place = {j: i for i, j in enumerate(diff)}  # a result leaf's place among the sums


class _SumJoin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: _SumGraph, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.graph = graph
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(torch.empty(0))
        outputs, graph.outputs = graph.outputs, []
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ctx.saved_tensors  # noqa: B018 - raises PyTorch's error if the graph was already freed
        graph: _SumGraph = ctx.graph
        call, records = graph.call, graph.records
        assert records is not None
        create_graph = torch.is_grad_enabled()

        place = graph.place

        def chunk_cotangents(k: int) -> list[Tensor | None]:
            # The sum's cotangent for each element's leaves that require grad.
            return [cotangents[place[j]] for el in records[k].elements for j in el.diff]

        def recomputed(k: int) -> bool:
            # Early chunks' graphs are gone; others are kept unless remat dropped them.
            return create_graph or graph.early[k] is not None or not records[k].stored

        wanted = graph.wanted(ctx)

        def backward_chunk(k: int, run: ChunkRun[Any]) -> Any:
            early = graph.early[k]
            if early is not None and not create_graph:
                c = cotangents[0]
                return None if c is None else [None if g is None else g * c for g in early]
            return pull_back(
                records[k],
                chunk_cotangents(k),
                n=call.n,
                owner=call.owner,
                recompute=call.recompute if recomputed(k) else None,
                create_graph=create_graph,
                wanted=wanted(k),
                api=call.api,
            )

        return graph.backward(
            backward_chunk,
            chunk_cotangents,
            create_graph=create_graph,
            recomputes=create_graph or any(not r.stored for r in records),
        )
