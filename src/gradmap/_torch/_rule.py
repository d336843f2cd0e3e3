"""The rule: forward in chunks, one join node, per-chunk pullbacks in parallel, a fixed-order sum.

NOTE [the join node]:
    Each chunk runs ``f`` on its elements in a worker thread, under grad mode, on stand-ins of the
    item tensors and of the foreign tensors ``f`` uses (see NOTE [capturing closure tensors]). The
    chunk's autograd graph stays where it was built. One ``autograd.Function`` -- the join --
    then takes as inputs every item tensor that requires grad and every foreign tensor any chunk
    used, and returns detached aliases of every differentiable result, so the user's graph sees the
    whole map as one node. Its inputs are only known once ``f`` has run, which is why the chunks run
    before ``apply`` and the join's forward merely hands their results out.

    The join's backward splits the cotangents by chunk and runs, on the executor, one
    ``autograd.grad`` per chunk with respect to the chunk's stand-ins (one engine call per chunk is
    cheaper than one per element, shared notes, trap 4; the engine releases the GIL, so chunks pull
    back in parallel). Elements whose cotangents are all missing or zero are left out, so they do no
    backward work. Item gradients go back to their items; the gradients of a foreign tensor are
    summed over chunks in chunk order, so the sum is the same for any number of workers.

    ``retain_graph``: the chunk graphs are always pulled back with ``retain_graph=True`` (so that a
    failing chunk can be re-run element by element to name the failing element), and dropped after
    the backward unless the outer call keeps the graph. A second backward then fails with PyTorch's
    own error, raised by the join's saved (dummy) tensor. ``create_graph``: the join's backward
    runs with grad mode on, the chunk pullbacks build their graphs through the stand-in views to the
    originals, and double backward is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from .._engine import ChunkRun, run_chunks
from .._errors import add_note, element_note
from .._executors import Executor
from .._plan import ChunkPlan
from .._progress import open_progress
from .._tree import Spec, flatten, unflatten
from ._capture import Capture, install_apply_hook
from ._random import ElementRandom, MapSeed
from ._state import ThreadState

__all__ = ["map_torch"]

Tensor = torch.Tensor


@dataclass(slots=True)
class _Element:
    """One element's results: the flattened leaves and which of them are join outputs."""

    leaves: list[Any]
    spec: Spec
    diff: list[int]  # positions in ``leaves`` of the differentiable outputs
    items: tuple[int, int]  # its range in the chunk's item lists
    outputs: tuple[int, int]  # its range in the chunk's output list


@dataclass
class _Chunk:
    """What a chunk's forward leaves for its backward."""

    indices: list[int]  # the elements it ran, in order
    elements: list[_Element] = field(default_factory=list)
    item_originals: list[Tensor] = field(default_factory=list)
    item_standins: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    originals: list[Tensor] = field(default_factory=list)
    standins: list[Tensor] = field(default_factory=list)


class _MapGraph:
    """The state shared by the join node's forward and backward."""

    def __init__(
        self,
        f: Any,
        elements: list[tuple[Any, ...]],
        executor: Executor,
        chunks: list[_Chunk],
        state: ThreadState,
        progress: Any,
        plan: ChunkPlan,
        seed: MapSeed,
        remat: bool,
    ) -> None:
        self.f: Any = f
        self.seed = seed
        self.remat = remat
        self.progress = progress
        self.plan = plan
        self.forward_state = state  # replayed by a create_graph backward
        # Kept for a create_graph backward, which recomputes.
        self.elements: list[tuple[Any, ...]] | None = elements
        self.executor = executor
        self.n = len(elements)
        self.chunks: list[_Chunk] | None = chunks
        # Where each chunk's foreign tensors sit among the join's captured inputs.
        self.captured: list[Tensor] = []
        self.captured_pos: list[list[int]] = []
        index: dict[int, int] = {}
        for chunk in chunks:
            positions = []
            for t in chunk.originals:
                p = index.get(id(t))
                if p is None:
                    p = index[id(t)] = len(self.captured)
                    self.captured.append(t)
                positions.append(p)
            self.captured_pos.append(positions)
        self.item_inputs = [t for chunk in chunks for t in chunk.item_originals]
        self.outputs = [t for chunk in chunks for t in chunk.outputs]
        bounds, lo = [], 0
        for chunk in chunks:
            bounds.append((lo, lo + len(chunk.outputs)))
            lo += len(chunk.outputs)
        self.output_bounds = bounds


def map_torch(
    f: Any,
    elements: list[tuple[Any, ...]],
    executor: Executor,
    plan: ChunkPlan,
    *,
    remat: bool = False,
    progress: Any = False,
) -> list:
    """``[f(*args) for args in elements]`` on ``executor``, differentiable as the loop is.

    Arguments:
        f: the function.
        elements: the argument tuples, one per element.
        executor: where chunks run.
        plan: the chunk plan for ``len(elements)``.
        remat: keep no graph in the forward; recompute each chunk in the backward.
        progress: ``tmap``'s ``progress`` argument.

    Returns:
        The results, in element order.
    """
    if not executor.shares_memory:  # chunks in other processes: Ray
        from .._ray import map_ray

        return map_ray(f, elements, executor, plan, remat=remat, progress=progress)
    if _transforms_active():
        # NOTE [torch.func and forward AD]: functorch's interpreter stack and forward-AD levels
        # are state the worker threads do not share, and the join node has no forward rule, so
        # under a transform the map runs as the plain loop, in the caller's thread.
        return [f(*args) for args in elements]
    state = ThreadState()
    if not (torch.is_grad_enabled() and not state.inference):
        return _map_without_graph(f, elements, executor, plan, state, progress)

    install_apply_hook()
    seed = MapSeed()

    def forward_chunk(k: int, run: ChunkRun[_Chunk]) -> _Chunk:
        return _forward_elements(
            f, elements, range(*plan.bounds(k)), lambda: run.stopped(k), seed, remat=remat
        )

    chunks = _run_pass(executor, plan, forward_chunk, state, progress, "forward")
    graph = _MapGraph(f, elements, executor, chunks, state, progress, plan, seed, remat)
    inputs = graph.item_inputs + graph.captured
    # With nothing to differentiate through, the results stand as f made them.
    joined = _Join.apply(graph, *inputs) if graph.outputs and inputs else graph.outputs
    results: list[Any] = []
    j = 0
    for chunk in chunks:
        for el in chunk.elements:
            # The results take the leaves over: the graph keeps no reference to the join's
            # outputs (which would make a cycle through the join node's context).
            leaves, el.leaves = el.leaves, []
            for pos in el.diff:
                leaves[pos] = joined[j]
                j += 1
            results.append(unflatten(leaves, el.spec))
    return results


def _transforms_active() -> bool:
    """Whether a ``torch.func`` transform or a forward-AD dual level is active."""
    return bool(torch._C._are_functorch_transforms_active()) or fwAD._current_level >= 0


def _run_pass(
    executor: Executor,
    plan: ChunkPlan,
    run_chunk: Any,
    state: ThreadState,
    progress: Any,
    phase: str,
    reverse: bool = False,
) -> list:
    """One pass over the plan's chunks, with the caller's state and an optional progress bar."""
    bar = open_progress(progress, phase, plan.n)
    on_done = None if bar is None else (lambda k: bar.update(len(range(*plan.bounds(k)))))
    try:
        return run_chunks(
            executor, plan.count, run_chunk, reverse=reverse, context=state.enter, on_done=on_done
        )
    finally:
        if bar is not None:
            bar.close()


def _map_without_graph(
    f: Any,
    elements: list[tuple[Any, ...]],
    executor: Executor,
    plan: ChunkPlan,
    state: ThreadState,
    progress: Any,
) -> list:
    n = len(elements)

    def chunk_results(k: int, run: ChunkRun[list]) -> list:
        start, stop = plan.bounds(k)
        out = []
        for i in range(start, stop):
            if run.stopped(k):
                break
            try:
                out.append(f(*elements[i]))
            except BaseException as exc:
                add_note(exc, element_note(i, n, "forward"))
                raise
        return out

    chunks = _run_pass(executor, plan, chunk_results, state, progress, "forward")
    return [y for chunk in chunks for y in chunk]


def _forward_elements(
    f: Any,
    elements: list[tuple[Any, ...]],
    indices: Sequence[int],
    stop: Callable[[], bool] | None,
    seed: MapSeed,
    *,
    connected: bool = False,
    remat: bool = False,
) -> _Chunk:
    """Run ``f`` on ``elements[i] for i in indices`` under one capture: a chunk's forward.

    With ``remat``, ``f`` runs without recording a graph: the chunk keeps what it used (items,
    foreign tensors) and its results, and every floating-point result leaf is a join output.
    """
    if remat:
        with torch.no_grad():
            return _forward_elements(f, elements, indices, stop, seed, connected=connected)
    capture = Capture(connected)
    chunk = _Chunk(list(indices))
    item_originals, item_standins, outputs = (
        chunk.item_originals,
        chunk.item_standins,
        chunk.outputs,
    )
    n = len(elements)
    for i in indices:
        if stop is not None and stop():
            break
        item_lo = len(item_originals)
        args = []
        for arg in elements[i]:
            if isinstance(arg, Tensor):  # the common case, without the pytree round trip
                if arg.requires_grad:
                    item_originals.append(arg)
                    arg = capture.item_standin(arg)
                    item_standins.append(arg)
                args.append(arg)
                continue
            leaves, spec = flatten(arg)
            changed = False
            for j, leaf in enumerate(leaves):
                if isinstance(leaf, Tensor) and leaf.requires_grad:
                    item_originals.append(leaf)
                    leaves[j] = capture.item_standin(leaf)
                    item_standins.append(leaves[j])
                    changed = True
            args.append(unflatten(leaves, spec) if changed else arg)
        capture.begin_element(ElementRandom(seed, i))
        # The mode is entered around f alone: gradmap's bookkeeping stays out of its way.
        try:
            with capture:
                y = f(*args)
        except BaseException as exc:
            add_note(exc, element_note(i, n, "forward"))
            raise
        out_lo = len(outputs)
        leaves, spec = flatten(y)
        diff = []
        for j, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                continue
            if leaf.requires_grad:
                leaf = leaves[j] = capture.route(leaf)  # a foreign tensor returned as it is
            elif torch.is_grad_enabled() or not (leaf.is_floating_point() or leaf.is_complex()):
                continue  # without a graph (remat), every floating-point result is an output
            outputs.append(leaf)
            diff.append(j)
        chunk.elements.append(
            _Element(leaves, spec, diff, (item_lo, len(item_originals)), (out_lo, len(outputs)))
        )
    capture.begin_element()
    chunk.originals = capture.originals
    if torch.is_grad_enabled():
        chunk.standins = capture.standins
    else:  # remat: the chunk keeps no graph; its stand-ins are made anew in the backward
        chunk.item_standins = []
    return chunk


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: _MapGraph, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.graph = graph
        ctx.set_materialize_grads(False)
        with torch._C.DisableTorchFunction():
            ctx.save_for_backward(torch.empty(0))
            return tuple(t.detach() for t in graph.outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ctx.saved_tensors  # noqa: B018 - raises PyTorch's error if the graph was already freed
        graph: _MapGraph = ctx.graph
        chunks = graph.chunks
        assert chunks is not None
        keep_graph = torch._C._autograd._get_current_graph_task_keep_graph()
        create_graph = torch.is_grad_enabled()
        executor = graph.executor

        def backward_chunk(k: int, run: ChunkRun[Any]) -> Any:
            lo, hi = graph.output_bounds[k]
            return _backward_chunk(graph, chunks[k], cotangents[lo:hi], create_graph)

        state = ThreadState(grad_enabled=create_graph)
        per_chunk = _run_pass(
            executor,
            graph.plan,
            backward_chunk,
            state,
            graph.progress,
            "backward",
            reverse=executor.reverse_backward,
        )
        item_grads: list[Tensor | None] = []
        captured: list[Tensor | None] = [None] * len(graph.captured)
        for chunk, positions, grads in zip(chunks, graph.captured_pos, per_chunk):
            if grads is None:
                item_grads.extend([None] * len(chunk.item_originals))
                continue
            n_items = len(chunk.item_originals)
            item_grads.extend(grads[:n_items])
            for p, g in zip(positions, grads[n_items:]):
                if g is not None:
                    total = captured[p]
                    captured[p] = g if total is None else total + g
        if not keep_graph:
            graph.chunks = None
            graph.f = graph.elements = None
        return (None, *item_grads, *captured)


def _accumulate(outputs: list[Tensor], grads: list[Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads, retain_graph=True)`` straight into the engine:
    the cotangents come from the engine with the right shapes already, and the per-output checks
    of ``torch.autograd`` in Python cost microseconds per element."""
    _run_backward(tuple(outputs), tuple(grads), True, False, (), True, True)


def _clear_grads(tensors: list[Tensor]) -> None:
    for t in tensors:
        t.grad = None


_run_backward = torch.autograd.Variable._execution_engine.run_backward  # type: ignore[attr-defined]


def _nonzero(g: Tensor) -> bool:
    if g.requires_grad or g.layout != torch.strided:
        return True  # a zero cotangent that requires grad still carries a second-order term
    return bool(g.any())


def _backward_chunk(
    graph: _MapGraph, chunk: _Chunk, cotangents: tuple[Tensor | None, ...], create_graph: bool
) -> list[Tensor | None] | None:
    """The pullback of one chunk: gradients for its item stand-ins, then its foreign stand-ins.

    Elements whose cotangents are all missing do no work and get no gradient; elements whose
    cotangents are all zero do no work either, and get zeros, as the loop would give them.
    """
    outputs: list[Tensor] = []
    grads_out: list[Tensor] = []
    live: list[tuple[int, int, int]] = []  # (element in chunk, range in outputs)
    zero: list[int] = []  # elements reached only by zero cotangents
    for e, el in enumerate(chunk.elements):
        lo = len(outputs)
        reached = False
        for o in range(*el.outputs):
            g = cotangents[o]
            if g is not None:
                reached = True
                if _nonzero(g):
                    outputs.append(chunk.outputs[o])
                    grads_out.append(g)
        if len(outputs) > lo:
            live.append((e, lo, len(outputs)))
        elif reached:
            zero.append(e)
    if not outputs and not zero:
        return None
    if not outputs:
        result: list[Tensor | None] = [None] * (len(chunk.item_originals) + len(chunk.originals))
    elif create_graph or graph.remat:
        result = _backward_recomputed(graph, chunk, cotangents, live, create_graph)
    else:
        result = _backward_stored(chunk, outputs, grads_out, live, graph.n)
    if zero:
        _fill_zeros(chunk, zero, result)
    return result


def _backward_stored(
    chunk: _Chunk,
    outputs: list[Tensor],
    grads_out: list[Tensor],
    live: list[tuple[int, int, int]],
    n: int,
) -> list[Tensor | None]:
    """Pull back through the chunk's stored graph into its stand-ins' ``.grad``."""
    standins = chunk.item_standins + chunk.standins

    def pull_back_one(one: tuple[int, int, int]) -> None:
        try:
            _accumulate(outputs[one[1] : one[2]], grads_out[one[1] : one[2]])
        finally:
            _clear_grads(standins)

    try:
        _accumulate(outputs, grads_out)
    except Exception as exc:
        _clear_grads(standins)
        _name_failing_element(exc, chunk, live, n, pull_back_one)
        raise
    result = [s.grad for s in standins]
    _clear_grads(standins)
    return result


def _fill_zeros(chunk: _Chunk, zero: list[int], result: list[Tensor | None]) -> None:
    """Zeros where the loop's backward would have sent zeros: the items of the elements reached
    only by zero cotangents, and the foreign tensors of their chunk."""
    for e in zero:
        for i in range(*chunk.elements[e].items):
            if result[i] is None:
                result[i] = torch.zeros_like(chunk.item_originals[i])
    n_items = len(chunk.item_originals)
    for j, t in enumerate(chunk.originals):
        if result[n_items + j] is None:
            result[n_items + j] = torch.zeros_like(t)


def _backward_recomputed(
    graph: _MapGraph,
    chunk: _Chunk,
    cotangents: tuple[Tensor | None, ...],
    live: list[tuple[int, int, int]],
    create_graph: bool,
) -> list[Tensor | None]:
    """A pullback on a fresh forward of the chunk's live elements: for ``remat=True``, and for
    every ``create_graph=True`` backward.

    NOTE [double backward recomputes]:
        A first-order gradient built with ``create_graph=True`` refers to tensors saved by the
        forward graph. Built on the chunk's stored graph, a second-order backward would run that
        graph's nodes twice -- directly, and again through the join (whose cotangent depends on the
        map's results) -- and the first run frees what the second needs. A fresh forward of the
        chunk gives the first-order gradient a graph of its own; the stored graph stays reserved
        for the join. The fresh forward uses stand-ins that are views of the original tensors, so
        the second-order gradients reach them exactly (shared notes, trap 5). It replays the
        forward's autocast and each element's random numbers (NOTE [random numbers per element]);
        otherwise ``f`` must be deterministic.
    """
    try:
        return _recompute_and_pull_back(graph, chunk, cotangents, live, create_graph)
    except Exception as exc:
        _name_failing_element(
            exc,
            chunk,
            live,
            graph.n,
            lambda one: _recompute_and_pull_back(graph, chunk, cotangents, [one], create_graph),
        )
        raise


def _has_gradmap_note(exc: BaseException) -> bool:
    return any(n.startswith("gradmap.tmap:") for n in getattr(exc, "__notes__", ()))


def _recompute_and_pull_back(
    graph: _MapGraph,
    chunk: _Chunk,
    cotangents: tuple[Tensor | None, ...],
    live: list[tuple[int, int, int]],
    create_graph: bool,
) -> list[Tensor | None]:
    assert graph.f is not None and graph.elements is not None
    with torch.enable_grad(), graph.forward_state.autocast_context():
        fresh = _forward_elements(
            graph.f,
            graph.elements,
            [chunk.indices[e] for e, _, _ in live],
            None,
            graph.seed,
            connected=create_graph,
        )
    outputs: list[Tensor] = []
    grads_out: list[Tensor] = []
    for (e, _, _), new in zip(live, fresh.elements):
        el = chunk.elements[e]
        for o, pos in zip(range(*el.outputs), el.diff):
            g = cotangents[o]
            leaf = new.leaves[pos]
            if g is not None and isinstance(leaf, Tensor) and leaf.requires_grad:
                outputs.append(leaf)
                grads_out.append(g)
    inputs = fresh.item_standins + fresh.standins
    grads: Sequence[Tensor | None]
    if not outputs:
        grads = [None] * len(inputs)
    elif create_graph:
        grads = torch.autograd.grad(
            outputs, inputs, grads_out, create_graph=True, allow_unused=True
        )
    else:
        _accumulate(outputs, grads_out)
        grads = [s.grad for s in inputs]
    # Back to the chunk's layout: its items, then its foreign tensors.
    result: list[Tensor | None] = [None] * (len(chunk.item_originals) + len(chunk.originals))
    for (e, _, _), new in zip(live, fresh.elements):
        el = chunk.elements[e]
        for i, new_i in zip(range(*el.items), range(*new.items)):
            result[i] = grads[new_i]
    where = {id(t): len(chunk.item_originals) + j for j, t in enumerate(chunk.originals)}
    n_items = len(fresh.item_standins)
    for t, g in zip(fresh.originals, grads[n_items:]):
        j = where.get(id(t))
        if j is None:
            raise RuntimeError(
                "gradmap.tmap: recomputing f (remat=True or a create_graph=True backward), f used "
                "a tensor that it did not use in the forward: f must be deterministic."
            )
        result[j] = g
    return result


def _name_failing_element(
    exc: Exception,
    chunk: _Chunk,
    live: list[tuple[int, int, int]],
    n: int,
    pull_back_one: Callable[[tuple[int, int, int]], object],
) -> None:
    """Name the element whose backward raised ``exc``: the chunk's only live element, or the
    first that raises when pulled back alone (that element's exception is raised instead)."""
    if len(live) > 1:
        for one in live:
            try:
                pull_back_one(one)
            except Exception as element_exc:
                if not _has_gradmap_note(element_exc):
                    add_note(element_exc, element_note(chunk.indices[one[0]], n, "backward"))
                raise element_exc from None
    if _has_gradmap_note(exc):
        return
    first, last = chunk.indices[live[0][0]], chunk.indices[live[-1][0]]
    if first == last:
        add_note(exc, element_note(first, n, "backward"))
    else:
        add_note(
            exc, f"gradmap.tmap: raised in the backward pass of elements {first}..{last} (of {n})"
        )
