"""The rule on Ray: chunk forwards on actors, one join node on the driver, pullbacks where the
graphs live, a fixed-order sum.

NOTE [the map on Ray]:
    The thread executor's rule (``_torch/_rule.py``) with the chunks in other processes:

    - Identity. ``f`` is pickled once per call and put in Ray's object store; each chunk's items
      are pickled when the chunk is first sent. Every tensor that requires grad reachable from
      them travels as an id (NOTE [tensors travel as identities]); the driver keeps id ->
      original. On a worker they are leaves, so a chunk's graph ends at them: its boundary
      (NOTE [the boundary of a chunk]) is the caller's tensors it used.
    - Forward. Chunks go to the actors (NOTE [a pass over the actors]); each runs a chunk record's
      forward (``_torch/_chunk.py``, as threads do) under the caller's grad mode and autocast,
      keeps the record keyed by (call, chunk), and returns the results with their join outputs
      detached, and the ids of the caller's tensors the chunk used.
    - The join. One ``autograd.Function`` on the driver takes as inputs the originals of every id
      some chunk used, and returns the join outputs, so the caller's graph sees the whole map as
      one node, as with threads. Its state object has a ``weakref.finalize`` that sends a release
      to the actors: a graph freed without a backward (results dropped, an exception) leaves no
      state on them.
    - Backward. Each chunk's cotangents go to the actor holding its graph, which pulls it back
      (the chunk record's ``pull_back``: missing and zero cotangents skip the work) and
      sends one gradient per id: the chunk's sum, computed there -- one tensor per parameter per
      chunk, not per element. The driver sums them per id in chunk order, so the gradients are
      bitwise the same for any number of actors, any assignment of chunks and any run.
      ``retain_graph`` keeps the actors' graphs for another backward; otherwise they are released.
    - ``remat=True``: the forward keeps nothing on the actors; the backward runs each chunk's
      ``recompute`` (forward and pullback in one call, on whichever actor is free).
    - A lost actor (its process died): its chunks are run again elsewhere: a forward again, or a
      ``recompute`` in the backward, from the items the driver kept. ``f`` must then be
      deterministic apart from its random numbers (replayed, as with ``remat``); the gradients
      are the same, bitwise, as without the loss. The price: the driver keeps every chunk's
      pickled items until the graph is released (``remat`` needs them anyway).
    - Random numbers: each element draws from its own generator seeded from ``base + i``, with
      the base the thread executor would draw (``ShippedSeed``), so a random ``f`` gives the
      same results on Ray as on threads.

    Not supported on Ray: a ``create_graph=True`` backward through the map (double backward),
    which raises ``NotImplementedError``; ``torch.func`` transforms and forward AD run the plain
    loop in the caller's process, as with threads. A ``tmap`` inside ``f`` on a worker runs there,
    with the serial executor.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

import torch

from .._errors import add_note
from .._executors import Executor, SerialExecutor
from .._join import sum_by_position
from .._plan import ChunkPlan
from .._progress import open_progress
from .._torch._graph import transforms_active as _transforms_active
from .._torch._rule import map_torch
from .._torch._state import ThreadState
from .._tree import flatten, unflatten
from ._cluster import import_ray
from ._executor import RayExecutor
from ._pickling import TensorTable, dumps, dumps_results, loads_results
from ._schedule import Job, run_pass
from ._worker import CallSpec, in_worker

__all__ = ["map_ray"]

Tensor = torch.Tensor


def _release(actors: list[Any], call_id: str) -> None:
    """Tell every actor to forget a call (fire and forget; nothing to do once Ray is down)."""
    try:
        import ray

        if not ray.is_initialized():
            return
        for actor in actors:
            actor.release.remote(call_id)
    except Exception:  # pragma: no cover - interpreter shutdown, a lost connection
        pass


class _Call:
    """The driver's state of one map: what the join's backward needs, and the release."""

    def __init__(
        self,
        actors: list[Any],
        f_payload: bytes,
        table: TensorTable,
        plan: ChunkPlan,
        executor: RayExecutor,
        remat: bool,
        progress: Any,
    ) -> None:
        ray = import_ray()
        self.id = uuid.uuid4().hex
        self.actors = actors
        self.table = table
        self.plan = plan
        self.timeout = executor.timeout
        self.restart_timeout = executor.start_timeout
        self.remat = remat
        self.progress = progress
        self.box = [ray.put(f_payload)]  # a list: Ray passes the ref itself, not its value
        self.items: list[bytes | None] = [None] * plan.count
        self.owners = [-1] * plan.count
        self.diff: list[list[list[int]]] = [[] for _ in range(plan.count)]
        self.bounds: list[tuple[int, int]] = []
        self.inputs: list[int] = []  # the pids of the join's inputs
        self.outputs: list[Tensor] = []  # the join outputs, until the join is applied
        self._finalizer = weakref.finalize(self, _release, actors, self.id)
        self._finalizer.atexit = False

    def release(self) -> None:
        self._finalizer()

    def _run(self, jobs: list[Job], submit: Any, on_result: Any) -> None:
        run_pass(
            len(self.actors),
            jobs,
            submit,
            on_result,
            lambda a: self.actors[a].pid.remote(),
            timeout=self.timeout,
            restart_timeout=self.restart_timeout,
            describe=self._describe,
        )

    def _describe(self, k: int) -> str:
        start, stop = self.plan.bounds(k)
        return f"the chunk of elements {start}..{stop - 1} (of {self.plan.n})"

    def pack_items(self, elements: list[tuple[Any, ...]], k: int) -> bytes:
        payload = self.items[k]
        if payload is None:
            start, stop = self.plan.bounds(k)
            try:
                payload = dumps(elements[start:stop], self.table)
            except Exception as exc:
                add_note(exc, _unpicklable(elements, start, stop))
                raise
            self.items[k] = payload
        return payload

    def forward(self, elements: list[tuple[Any, ...]]) -> list[tuple[list[Any], Any]]:
        """Run every chunk's forward; the results of each chunk, in chunk order."""
        plan = self.plan
        per_chunk: list[Any] = [None] * plan.count
        used: set[int] = set()
        drawn = False
        bar = open_progress(self.progress, "forward", plan.n)

        def submit(jobs: list[Job], a: int, recompute: bool) -> Any:
            chunks = [
                (j.chunk, plan.bounds(j.chunk)[0], self.pack_items(elements, j.chunk)) for j in jobs
            ]
            return self.actors[a].forward.remote(self.id, self.box, chunks)

        def on_result(k: int, a: int, value: bytes) -> None:
            nonlocal drawn
            trees, diff, pids, chunk_drawn = loads_results(value)
            per_chunk[k] = (trees, diff)
            self.owners[k] = a
            used.update(pids)
            drawn = drawn or chunk_drawn
            if bar is not None:
                bar.update(len(trees))

        try:
            self._run([Job(k, None) for k in range(plan.count)], submit, on_result)
        finally:
            if bar is not None:
                bar.close()
        if drawn:
            # Leave the global generator where the thread executor would have left it.
            torch.randint(0, 2**62, (), dtype=torch.int64)
        self.inputs = sorted(used)
        return per_chunk

    def backward(self, cotangents: tuple[Tensor | None, ...], keep_graph: bool) -> list[Any]:
        """Pull every chunk back; the gradient of each join input (``None`` where none came)."""
        plan = self.plan
        state = ThreadState(grad_enabled=False)
        payloads: dict[int, bytes] = {}
        jobs = []
        for k, (lo, hi) in enumerate(self.bounds):
            if any(g is not None for g in cotangents[lo:hi]):
                payloads[k] = dumps_results(list(cotangents[lo:hi]))
                jobs.append(Job(k, None if self.remat else self.owners[k], recompute=self.remat))
        per_chunk: dict[int, list[tuple[int, Tensor]]] = {}
        bar = open_progress(self.progress, "backward", plan.n)

        def submit(jobs: list[Job], a: int, recompute: bool) -> Any:
            actor = self.actors[a]
            if recompute:
                chunks = [
                    (plan.bounds(k)[0], self.items[k], self.diff[k], payloads[k])
                    for k in (j.chunk for j in jobs)
                ]
                return actor.recompute.remote(self.id, self.box, chunks, state)
            return actor.backward.remote(
                self.id, [(j.chunk, payloads[j.chunk]) for j in jobs], state
            )

        def on_result(k: int, a: int, value: bytes) -> None:
            per_chunk[k] = loads_results(value)
            if bar is not None:
                start, stop = plan.bounds(k)
                bar.update(stop - start)

        try:
            self._run(jobs, submit, on_result)
        finally:
            if bar is not None:
                bar.close()
        index = {pid: p for p, pid in enumerate(self.inputs)}
        chunks = sorted(per_chunk)  # chunk order: the same sum for any assignment of chunks
        totals = sum_by_position(
            len(self.inputs),
            [[index[pid] for pid, _ in per_chunk[k]] for k in chunks],
            [[g for _, g in per_chunk[k]] for k in chunks],
            torch.add,
        )
        if not keep_graph:
            self.release()
        return totals


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        ctx.set_materialize_grads(False)
        with torch._C.DisableTorchFunction():
            ctx.save_for_backward(torch.empty(0))
            return tuple(t.detach() for t in call.outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.saved_tensors  # noqa: B018 - raises PyTorch's error if the graph was already freed
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "gradmap.tmap(executor='ray'): a create_graph=True backward through the map "
                "(double backward) is not supported on Ray; use executor='threads'"
            )
        call: _Call = ctx.call
        keep_graph = torch._C._autograd._get_current_graph_task_keep_graph()
        return (None, *call.backward(cotangents, keep_graph))


def map_ray(
    f: Any,
    elements: list[tuple[Any, ...]],
    executor: Executor,
    plan: ChunkPlan,
    *,
    remat: bool = False,
    progress: Any = False,
) -> list:
    """``[f(*args) for args in elements]`` on Ray actors, differentiable as the loop is.

    Arguments:
        f: the function (picklable with cloudpickle).
        elements: the argument tuples, one per element (picklable).
        executor: a [`RayExecutor`][].
        plan: the chunk plan for ``len(elements)``.
        remat: keep no graph on the actors; recompute each chunk in the backward.
        progress: ``tmap``'s ``progress`` argument.

    Returns:
        The results, in element order.
    """
    if _transforms_active():
        # NOTE [torch.func and forward AD] in _rule: the plain loop, in the caller's process.
        return [f(*args) for args in elements]
    if in_worker():
        # A map inside f, on a worker: this process is one actor with its CPUs, so it runs here.
        return map_torch(f, elements, SerialExecutor(), plan, remat=remat, progress=progress)
    if not isinstance(executor, RayExecutor):
        raise TypeError(f"gradmap: map_ray needs a RayExecutor, got {type(executor).__name__}")
    if not elements:
        return []
    actors = executor.actors()
    graph = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    spec = CallSpec(
        n=plan.n,
        rng_state=torch.get_rng_state(),
        forward_state=ThreadState(),
        default_dtype=torch.get_default_dtype(),
        graph=graph,
        remat=remat,
    )
    table = TensorTable()
    try:
        f_payload = dumps((f, spec), table)
    except Exception as exc:
        add_note(
            exc,
            "gradmap.tmap(executor='ray'): f must be picklable with cloudpickle to run on Ray "
            "workers (a lambda or closure is; an object holding locks, files or sockets is not)",
        )
        raise
    call = _Call(actors, f_payload, table, plan, executor, remat, progress)
    try:
        per_chunk = call.forward(elements)
    except BaseException:
        call.release()
        raise
    if not graph:
        call.release()
        return [y for trees, _ in per_chunk for y in trees]
    # The join outputs, in chunk order, and each element's place for them.
    placed: list[tuple[list[Any], Any, list[int]]] = []
    for k, (trees, diff) in enumerate(per_chunk):
        lo = len(call.outputs)
        call.diff[k] = diff
        for tree, positions in zip(trees, diff):
            leaves, spec_ = flatten(tree)
            for pos in positions:
                call.outputs.append(leaves[pos])
            placed.append((leaves, spec_, positions))
        call.bounds.append((lo, len(call.outputs)))
    inputs = [call.table.tensors[pid] for pid in call.inputs]
    if not (call.outputs and inputs):
        # Nothing to differentiate through: the results stand as they came.
        call.release()
        call.outputs = []
        return [unflatten(leaves, spec_) for leaves, spec_, _ in placed]
    joined = _Join.apply(call, *inputs)
    call.outputs = []  # the join's outputs are the results' now (no cycle through the join)
    results: list[Any] = []
    j = 0
    for leaves, spec_, positions in placed:
        for pos in positions:
            leaves[pos] = joined[j]
            j += 1
        results.append(unflatten(leaves, spec_))
    return results


def _unpicklable(elements: list[tuple[Any, ...]], start: int, stop: int) -> str:
    """A note naming the first element whose items do not pickle."""
    for i in range(start, stop):
        try:
            dumps(elements[i], TensorTable())
        except Exception:
            return (
                f"gradmap.tmap(executor='ray'): the items of element {i} (of "
                f"{len(elements)}) do not pickle; items must be picklable to reach Ray workers"
            )
    return "gradmap.tmap(executor='ray'): the items of a chunk do not pickle"
