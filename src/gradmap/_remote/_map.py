"""The rule in other processes: chunk forwards on workers, one join node on the driver,
pullbacks where the graphs live, a fixed-order sum. Ray's actors and gradmap's worker processes
both run it; they differ only in the transport (``_schedule.Transport``).

NOTE [the map in other processes]:
    The thread executor's rule (``_torch/_map.py``, ``_torch/_sum.py``) with the chunks in other
    processes:

    - Identity. ``f`` is pickled once per call, and its payload is known by digest: Ray puts it
      in its object store, and the worker processes are sent it, once while it is unchanged, and
      the workers keep it unpickled (a few recent payloads each); each chunk's items are
      pickled when the chunk is first sent, or, unchanged since an earlier call, sent as they
      were then (NOTE [items kept from call to call]). Every tensor that requires grad reachable
      from them travels as an id (NOTE [tensors travel as identities]); the driver keeps id ->
      original. On a worker they are leaves, so a chunk's graph ends at them: its
      boundary (NOTE [the boundary of a chunk]) is the caller's tensors it used.
    - Forward. Chunks go to the actors (NOTE [a pass over the actors]); each runs a chunk record's
      forward (``_torch/_chunk.py``, as threads do) under the caller's grad mode and autocast,
      keeps the record keyed by (call, chunk), and returns the results with their join outputs
      detached, and the ids of the caller's tensors the chunk used.
    - The join. One ``autograd.Function`` on the driver takes as inputs the originals of every id
      some chunk used, and returns the join outputs, so the caller's graph sees the whole map as
      one node, as with threads. A worker keeps a map's state only while it holds a chunk of
      it (a pullback without ``retain_graph`` forgets the chunk), so a map pulled back whole
      costs no release message; the driver's state object has a ``weakref.finalize`` that sends
      a release to the workers still holding chunks: a graph freed without a backward (results
      dropped, an exception), or chunks that got no cotangent, leave no state on them.
    - Backward. Each chunk's cotangents go to the actor holding its graph, which pulls it back
      (the chunk record's ``pull_back``: missing and zero cotangents skip the work) and
      sends one gradient per id: the chunk's sum, computed there -- one tensor per parameter per
      chunk, not per element, or one per group of the sum for a call that held the whole group
      (added up there, in the same order). The driver sums them per id in the fixed order of
      NOTE [chunk-order sum] (``_join``), so the gradients are bitwise the same for any number
      of actors, any assignment of chunks and any run. A backward that needs some join inputs
      only (``autograd.grad(out, inputs=...)``) sends no chunk that reaches none of them, and
      the hosts pull back no element that reaches none (``_Driver.wanted``), as the engine
      prunes the loop's graph.
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
      same results in other processes as on threads.
    - ``tsum``: each chunk's forward and, for a chunk of losses (0-d results), its pullback with
      cotangent one run in one call, and the worker keeps nothing; the join takes each such
      chunk's sum as one output, and its backward adds the chunks' gradients up (a whole
      group's came added up) and scales the sum by the cotangent (NOTE [early gradients scaled
      once] in ``_torch/_sum``), with no call to the workers. Other chunks are kept as
      ``tmap``'s, and so is a chunk of losses whose pullback failed (its backward raises).
    - A ``tmap`` of losses whose backward is learnt to give every result one cotangent (``sum``,
      ``mean``) is pulled back so too, its graphs kept for a backward that does not (NOTE
      [tmap's losses pulled back early] in ``_torch/_early``).

    Not supported in other processes: a ``create_graph=True`` backward through the map (double
    backward), which raises ``NotImplementedError`` naming the thread executor; ``torch.func``
    transforms and forward AD run the plain loop in the caller's process, as with threads. A
    ``tmap`` inside ``f`` on a worker runs there, with the serial executor.
"""

from __future__ import annotations

import contextlib
import time
import uuid
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._errors import add_note
from .._executors import RemoteExecutor, SerialExecutor
from .._join import Spent, groups_of, sum_by_position
from .._placement import EARLY_BYTES, key_of, learn_uniform_cotangents, uniform_cotangents
from .._plan import ChunkPlan
from .._progress import open_progress
from .._request import MapRequest
from .._torch._chunk import stack_small
from .._torch._early import one_cotangent, scaled_sum, unscaled
from .._torch._graph import batched, buffers_kept, caller_only, keep_graph, needed
from .._torch._map import map_torch
from .._torch._node import JoinGraph, JoinNode
from .._torch._state import ThreadState
from .._torch._sum import sum_results
from .._tree import flatten, unflatten
from ._host import CallSpec, draw_base, in_worker, process_wide
from ._kept import KeptItems, items_cache
from ._pickling import (
    AsIs,
    LeafResult,
    TensorTable,
    dumps,
    dumps_results,
    loads_results,
    version_of,
)
from ._schedule import Job, Transport, run_pass
from ._settings import settings_of

__all__ = ["map_remote"]

Tensor = torch.Tensor


def _release(transport: Transport, call_id: str, held: dict[int, int] | None) -> None:
    # Fire and forget, to the workers still holding chunks (``None``: to every worker); nothing
    # to do at interpreter shutdown or over a lost connection.
    workers = None if held is None else sorted(set(held.values()))
    if workers == []:
        return
    with contextlib.suppress(Exception):
        transport.release(call_id, workers)


@dataclass(eq=False)
class _Chunk:
    """What the driver keeps of one chunk of the map."""

    items: bytes | KeptItems | None = None  # pickled once, when first sent (``pack_items``)
    owner: int = -1  # the worker that ran its forward and keeps its graph (-1: none did)
    diff: list[list[int]] = field(default_factory=list)  # per element: its join outputs' leaves
    pids: list[int] = field(default_factory=list)  # its boundary: the caller's tensors it used
    outputs: tuple[int, int] = (0, 0)  # its range among the join's outputs
    early: list[tuple[int, Tensor]] | None = None  # a tsum chunk of losses: its sum's gradients
    # a tmap chunk of losses: its gradients with cotangent one (NOTE [tmap's losses pulled
    # back early])
    ones: list[tuple[int, Tensor]] | None = None


class _Driver(JoinGraph):
    """The driver's state of one map: what the join's backward needs, and the release."""

    spent: Spent  # NOTE [a backward of some results] in ``_join``

    def __init__(
        self,
        f: Any,
        transport: Transport,
        f_payload: bytes,
        spec: CallSpec,
        table: TensorTable,
        plan: ChunkPlan,
        executor: RemoteExecutor,
        remat: bool,
        progress: Any,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.transport = transport
        self.api = f"{spec.api}(executor={transport.name!r})"
        self.spec = spec
        self.table = table
        self.plan = plan
        self.timeout = executor.timeout
        self.restart_timeout = executor.start_timeout
        self.remat = remat
        self.f = f  # whose buffers the recomputes must leave as they are
        self.key = key_of(f)  # (what the backward learns of the cotangents is kept under it)
        self.progress = progress
        self.box = transport.box(f_payload)
        self.elements: Sequence[tuple[Any, ...]] = []
        self.chunks = [_Chunk() for _ in range(plan.count)]
        self.inputs: list[int] = []  # the pids of the join's inputs
        self.outputs: list[Tensor] = []  # the join outputs, until the join is applied
        # chunk -> the worker keeping its graph: the release's account, which the finalizer
        # holds (it may not hold the driver)
        self.held: dict[int, int] = {}
        # NOTE [tensors changed in place before a backward]
        self.versions: list[tuple[Tensor, int]] = []
        self._finalizer = weakref.finalize(self, _release, transport, self.id, self.held)
        self._finalizer.atexit = False

    def release(self) -> None:
        self._finalizer()

    def note_versions(self) -> None:
        """After the forward: the versions of the caller's tensors that the workers read in
        shared memory (NOTE [tensors changed in place before a backward])."""
        seen: set[int] = set()
        for t in self.table.aliased:
            if id(t) not in seen:
                seen.add(id(t))
                self.versions.append((t, version_of(t)))

    def check_versions(self) -> None:
        """Before pulling back graphs kept on the workers, or recomputing chunks there: raise
        where a tensor the workers read in shared memory was changed in place since the forward.

        NOTE [tensors changed in place before a backward]:
            On worker processes, ``f``'s parameters and other tensors are read where they lie,
            in shared memory, through tensors of the worker's own, whose version counters the
            caller's in-place changes do not reach. A tensor changed in place between the
            forward and the backward would be read at its new value by the workers' saved
            graphs (and by a recompute), and the gradient silently taken at a point the forward
            never was, where the loop's backward raises PyTorch's error for a tensor it saved.
            So the driver notes their versions after the forward and checks them before a
            backward that runs on the workers; like ``remat``'s check (NOTE [a recompute reads
            what the forward read] in ``_torch/_graph``) it raises even where the loop's
            backward would not have needed that tensor: gradmap cannot tell. ``tsum``'s chunks
            of losses, pulled back in the forward, need no check (the threads' ``tsum`` takes
            them so too). On Ray the workers hold copies: nothing is aliased.
        """
        for t, version in self.versions:
            now = version_of(t)
            if now != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: a tensor f uses (shape {tuple(t.shape)}) was changed "
                    f"in place since the forward of {self.api} (its version was {version}, is "
                    f"now {now}). Its graphs on the worker processes read it in shared memory, so "
                    "this backward would differentiate at its new values, where the loop's "
                    "backward raises this error. Change it after the backward, or use "
                    "executor='threads'."
                )

    def release_all(self) -> None:
        """Release the call on every worker (after a failed pass: calls may still be running)."""
        self._finalizer.detach()
        _release(self.transport, self.id, None)

    def join_context(self) -> contextlib.AbstractContextManager[object]:
        return torch._C.DisableTorchFunction()

    def join_outputs(self) -> tuple[Tensor, ...]:
        self.spent = Spent(len(self.outputs))
        return tuple(_detached(t) for t in self.outputs)

    def join_backward(self, ctx: Any, cotangents: tuple[Tensor | None, ...]) -> list[Any]:
        if torch.is_grad_enabled():
            raise NotImplementedError(
                f"{self.api}: a create_graph=True backward through the map (double backward) is "
                "not supported in other processes; use executor='threads'"
            )
        if batched(cotangents):
            raise NotImplementedError(
                f"{self.api}: a batched backward through the map (under vmap: "
                "autograd.grad(..., is_grads_batched=True), jacobian(..., vectorize=True)) is "
                "not supported in other processes; use executor='threads', or vectorize=False"
            )
        keep = keep_graph()
        self.spent.spend(cotangents, free=not keep)  # raises for results gone through before
        return self.backward(cotangents, keep, self.wanted(ctx))

    def wanted(self, ctx: Any) -> list[int] | None:
        """The pids of the join inputs the running backward needs (``None``: all): as on threads
        (``MapGraph.wanted`` in ``_torch/_map``), a chunk that reaches none of them is not
        pulled back, nor, within a chunk, an element that reaches none (the host masks its
        boundary by them), as the engine prunes the loop's graph. ``ctx``: the join's."""
        mask = needed(ctx, len(self.inputs))
        if all(mask):
            return None
        return [pid for pid, want in zip(self.inputs, mask) if want]

    def one_cotangent(self, cotangents: tuple[Tensor | None, ...]) -> Tensor | None:
        """For a ``tmap`` whose chunks of losses were pulled back in the forward: the one
        cotangent every result got, if they all got the same nonzero one (their early gradients
        then serve, scaled by it); ``None`` otherwise. What it finds is learnt for the next map
        of ``f`` (NOTE [tmap's losses pulled back early] in ``_torch/_early``)."""
        if self.spec.api != "gradmap.tmap" or not self.spec.graph or self.remat:
            return None
        one = one_cotangent(cotangents, stack_small(cotangents))
        # (each chunk's early gradients are kept until the backward: not for a large model)
        learn_uniform_cotangents(self.key, one is not None and self.early_fits())
        return one if any(c.ones is not None for c in self.chunks) else None

    def early_fits(self) -> bool:
        """Whether a gradient per chunk of every join input stays within ``EARLY_BYTES``."""
        size = sum(_bytes(self.table.tensors[pid]) for pid in self.inputs)
        return size * self.plan.count <= EARLY_BYTES

    def _run(self, jobs: list[Job], submit: Any, on_result: Any, backward: bool = False) -> None:
        run_pass(
            self.transport,
            jobs,
            submit,
            on_result,
            timeout=self.timeout,
            restart_timeout=self.restart_timeout,
            describe=self._describe,
            group=self.plan.group,
            last_wins=backward,  # NOTE [the error of the loop's element] in ``_schedule``
        )

    def folds(self, jobs: list[Job], worker: int, in_pass: Counter[int]) -> list[list[int]]:
        """The positions among ``jobs`` of each group of the sum that the call to ``worker``
        holds whole (``in_pass``: how many chunks of each group the pass runs): a worker
        process adds up their gradients (NOTE [chunk-order sum] in ``_join``); none for the
        caller's own host, whose answers are not sent anywhere."""
        group = self.plan.group
        if group == 1 or len(jobs) < 2 or self.transport.local(worker):
            return []
        found: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            found.setdefault(job.chunk // group, []).append(i)
        return [at for g, at in found.items() if len(at) > 1 and len(at) == in_pass[g]]

    def _describe(self, k: int) -> str:
        start, stop = self.plan.bounds(k)
        return f"the chunk of elements {start}..{stop - 1} (of {self.plan.n})"

    def cotangents_for(self, cotangents: list[Any], worker: int) -> Any:
        if self.transport.local(worker):
            return AsIs(cotangents)
        return dumps_results(cotangents)

    def pack_items(self, k: int) -> bytes | KeptItems:
        """Chunk ``k``'s items, pickled once (for the caller's own host too: ``f`` runs on
        copies of the items wherever its chunk runs), or as an earlier call pickled them (NOTE
        [items kept from call to call])."""
        record = self.chunks[k]
        payload = record.items
        if payload is None:
            start, stop = self.plan.bounds(k)
            chunk = list(self.elements[start:stop])
            payload, found = items_cache.lookup(chunk)
            if payload is None:
                try:
                    pickled = dumps(chunk, self.table)
                except Exception as exc:
                    add_note(exc, _unpicklable(self.elements, start, stop, self.api))
                    raise
                payload = items_cache.keep(found, pickled) or pickled
            record.items = payload
        return payload

    def forward(self, elements: Sequence[tuple[Any, ...]], method: str = "forward") -> list[Any]:
        """Run every chunk's forward; the results of each chunk, in chunk order: ``(trees,
        diff)``, or for a ``forward_sum`` chunk of losses ``(None, total)``."""
        plan = self.plan
        per_chunk: list[Any] = [None] * plan.count
        used: set[int] = set()
        bar = open_progress(self.progress, "forward", plan.n, self.api)
        self.elements = elements

        in_pass = _per_group(range(plan.count), plan.group)

        def submit(jobs: list[Job], a: int, recompute: bool) -> Any:
            chunks = [(j.chunk, plan.bounds(j.chunk)[0], self.pack_items(j.chunk)) for j in jobs]
            if method == "forward_sum":
                folds = self.folds(jobs, a, in_pass)
                return self.transport.call(a, method, self.id, self.box, self.spec, chunks, folds)
            return self.transport.call(a, method, self.id, self.box, self.spec, chunks)

        def on_result(k: int, a: int, value: bytes) -> None:
            # (Each answer ends with whether its elements drew, which no longer decides
            # anything here: NOTE [the generator after a map] in ``_torch/_random``.)
            got = loads_results(value)
            if got[0] == "sum":
                _, total, grads, _drew = got
                per_chunk[k] = (None, total)
                self.chunks[k].early = grads
                self.chunks[k].pids = [pid for pid, _ in grads]
                used.update(self.chunks[k].pids)
            elif got[0] == "early":  # NOTE [tmap's losses pulled back early] (``_torch/_early``)
                _, trees, diff, pids, _drew, grads = got
                per_chunk[k] = (trees, diff)
                self.chunks[k].owner = self.held[k] = a
                self.chunks[k].ones = grads
                self.chunks[k].pids = pids
                used.update(pids)
            else:
                trees, diff, pids, _drew = got
                per_chunk[k] = (trees, diff)
                self.chunks[k].owner = a
                if self.spec.graph and not self.remat:  # the worker keeps the chunk
                    self.held[k] = a
                self.chunks[k].pids = pids
                used.update(pids)
            if bar is not None:
                bar.update(len(range(*plan.bounds(k))))

        try:
            self._run([Job(k, None) for k in range(plan.count)], submit, on_result)
        finally:
            if bar is not None:
                bar.close()
        # The map's one draw (NOTE [the generator after a map] in ``_torch/_random``).
        torch.randint(0, 2**62, (), dtype=torch.int64)
        self.inputs = sorted(used)
        return per_chunk

    def backward(
        self, cotangents: tuple[Tensor | None, ...], keep: bool, wanted: list[int] | None = None
    ) -> list[Any]:
        """Pull every chunk back (``wanted``: only those that reach these pids, ``None``: all);
        the gradient of each join input (``None`` where none came)."""
        plan = self.plan
        state = ThreadState(grad_enabled=False)
        payloads: dict[int, list[Any]] = {}
        per_chunk: dict[int, list[tuple[int, Tensor]]] = {}
        # Each chunk is kept for a later backward unless all its results are gone through.
        kept = [keep or not self.spent.spent(*record.outputs) for record in self.chunks]
        jobs = []
        early_chunks: set[int] = set()
        scale = None
        reached = None if wanted is None else set(wanted)
        one = self.one_cotangent(cotangents)  # NOTE [tmap's losses pulled back early]
        if one is not None:
            scale = None if unscaled(one, keep) else one
        for k, record in enumerate(self.chunks):
            lo, hi = record.outputs
            early = record.early
            if record.ones is not None and one is not None:
                per_chunk[k] = record.ones
                early_chunks.add(k)
            elif early is not None:  # a tsum chunk of losses: its sum's gradients, scaled
                c = cotangents[lo]  # (after the sum: NOTE [early gradients scaled once])
                if c is not None:
                    scale = None if unscaled(c, kept[k]) else c
                    per_chunk[k] = early
                    early_chunks.add(k)
            elif any(g is not None for g in cotangents[lo:hi]) and (
                reached is None or not reached.isdisjoint(record.pids)
            ):
                payloads[k] = list(cotangents[lo:hi])
                jobs.append(Job(k, None if self.remat else record.owner, recompute=self.remat))
        bar = open_progress(self.progress, "backward", plan.n, self.api)
        if bar is not None:
            # Pulled back already (a tsum's chunks of losses) or with nothing to pull back: done
            # now, as on threads, so that the bar ends full.
            waiting = {j.chunk for j in jobs}
            done = sum(len(range(*plan.bounds(k))) for k in range(plan.count) if k not in waiting)
            if done:
                bar.update(done)

        in_pass = _per_group((j.chunk for j in jobs), plan.group)

        buffers = contextlib.ExitStack()
        buffers_taken: list[bool] = []

        def submit(jobs: list[Job], a: int, recompute: bool) -> Any:
            if recompute:
                if not buffers_taken:
                    # (a lost worker's chunks, or remat's: NOTE [buffers a recompute updates])
                    buffers.enter_context(buffers_kept(self.f))
                    buffers_taken.append(True)
                chunks = [
                    (
                        plan.bounds(k)[0],
                        self.pack_items(k),
                        self.chunks[k].diff,
                        self.cotangents_for(payloads[k], a),
                    )
                    for k in (j.chunk for j in jobs)
                ]
                return self.transport.call(
                    a, "recompute", self.id, self.box, self.spec, chunks, state, wanted
                )
            pulls = [
                (j.chunk, self.cotangents_for(payloads[j.chunk], a), kept[j.chunk]) for j in jobs
            ]
            folds = self.folds(jobs, a, in_pass)
            return self.transport.call(a, "backward", self.id, pulls, state, folds, wanted)

        def on_result(k: int, a: int, value: bytes) -> None:
            per_chunk[k] = loads_results(value)
            if not kept[k]:
                self.held.pop(k, None)  # the worker forgot it (``Host.backward``)
            if bar is not None:
                start, stop = plan.bounds(k)
                bar.update(stop - start)

        if jobs or (one is not None and early_chunks):
            self.check_versions()
        try:
            # NOTE [buffers a recompute updates]: workers update the caller's buffers in shared
            # memory (BatchNorm's running statistics): the forward did, once; a recompute (under
            # remat, or of a lost worker's chunks) must not again. So the buffers are taken
            # before the first recompute is sent and put back after the pass (a pullback of a
            # kept graph updates none: a pass without recomputes takes nothing).
            with buffers:
                if jobs:
                    self._run(jobs, submit, on_result, backward=True)
        finally:
            if bar is not None:
                bar.close()
        index = {pid: p for p, pid in enumerate(self.inputs)}
        chunks = sorted(per_chunk)  # chunk order: the same sum for any assignment of chunks
        positions = [[index[pid] for pid, _ in per_chunk[k]] for k in chunks]
        groups = groups_of(chunks, plan.group)

        def add_up(grads: list[Any]) -> list[Tensor | None]:
            return sum_by_position(len(self.inputs), positions, grads, torch.add, groups)

        per_position = [[g for _, g in per_chunk[k]] for k in chunks]
        totals = scaled_sum(
            per_position, {i for i, k in enumerate(chunks) if k in early_chunks}, scale, add_up
        )
        if not keep and self.spent.left == 0:
            self.release()
        return totals


#: The size of ``f``'s pickle from which a call says what it costs (``_warn_heavy_f``), once
#: per ``f`` (by its code: ``key_of``).
HEAVY_F = 4 << 20
_WARNED_HEAVY: set[Any] = set()


def _warn_heavy_f(name: str, size: int, seconds: float) -> None:
    """Say that ``f``'s pickle is large: it is made and hashed on every call, before any chunk
    runs (only tensors travel apart, by shared memory, once)."""
    warnings.warn(
        f"{name}: f pickles to {size / 2**20:.1f} MiB, which every call pickles and hashes "
        f"before any chunk runs ({seconds * 1e3:.0f} ms in this one): data f holds that is not "
        "a torch tensor (numpy arrays, lists or dicts of numbers) travels inside f's pickle. "
        "Hold large data as torch tensors of their own (torch.tensor(a), a copy: a tensor "
        "that shares a numpy array's memory travels by value), which travel apart from f's "
        "pickle (on processes through shared memory, once), or pass it with the items (items "
        "that stay the same are sent once); or use executor='threads'.",
        RuntimeWarning,
        stacklevel=5,  # the user's line: _warn_heavy_f, map_remote, _run, tmap or tsum
    )


_WARNED_STATISTICS: set[Any] = set()


def _warn_statistics(name: str, transport: str) -> None:
    """Say that ``f``'s running statistics will not be the loop's on this executor.

    NOTE [running statistics on worker processes]:
        A module in train mode that keeps running statistics (BatchNorm, InstanceNorm with
        ``track_running_stats``) updates them in place at every element. On threads they come
        out as the loop's or nearly (measured after one map: 6e-8 to 2e-4 off, on scales of
        0.6-1.2). On worker processes the buffers lie in shared memory, each process updates
        them at once, in no fixed order, and updates are lost (measured: running_mean 1% off
        after 128 elements of 20-200 rows, 40% after 64 elements of 6 rows); on Ray each actor
        updates a copy of its own, which never reaches the caller. Gradients are not affected
        (each element's forward uses its own batch's statistics); the model's later evaluation
        is. Said once per ``f`` and executor.
    """
    if transport == "ray":
        what = "each actor updates a copy of its own, which never reaches your process"
    else:
        what = (
            "the worker processes update them in shared memory at once and in no fixed order, "
            "so updates are lost and the statistics differ from the loop's"
        )
    warnings.warn(
        f"{name}: f holds a module in train mode that updates running statistics at every "
        f"element (BatchNorm): {what} (gradients are not affected; an evaluation of the model "
        "after the map is). Put such modules in eval() mode for the map, update the statistics "
        "outside it, or use executor='threads', where they are the loop's.",
        RuntimeWarning,
        stacklevel=5,  # the user's line: _warn_statistics, map_remote, _run, tmap or tsum
    )


def map_remote(request: MapRequest) -> Any:
    """``[f(*args) for args in elements]`` (``api="gradmap.tmap"``) or their sum
    (``"gradmap.tsum"``) on the worker processes of the request's executor (Ray's, or the local
    processes'), differentiable as the loop is. ``f`` must pickle with cloudpickle and the
    items must pickle; ``remat`` keeps no graph on the workers and recomputes each chunk in the
    backward.

    Returns:
        The results, in element order; or their sum, for ``tsum``.
    """
    f, elements, plan = request.f, request.elements, request.plan
    executor, remat, api = request.executor, request.remat, request.api
    assert isinstance(executor, RemoteExecutor)
    summed = api == "gradmap.tsum"
    if caller_only() is not None or in_worker():
        # NOTE [state only the caller's thread has] in _torch/_graph: the plain loop, in the
        # caller's thread. A map inside f, on a worker: this process is one worker with its
        # CPUs, so it runs here.
        here = replace(request, executor=SerialExecutor(), placement="auto")
        results = map_torch(here)
        return sum_results(results) if summed else results
    transport: Transport = executor.transport(f, api, plan.n)  # type: ignore[assignment]
    graph = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    spec = CallSpec(
        n=plan.n,
        seed_base=draw_base(),
        forward_state=ThreadState(),
        graph=graph,
        remat=remat,
        api=api,
        settings=settings_of(f),
        **process_wide(),
    )
    table = TensorTable(executor.share)
    name = f"{api}(executor={transport.name!r})"
    started = time.perf_counter()
    try:
        f_payload = dumps(f, table, share=True)
    except Exception as exc:
        add_note(
            exc,
            f"{name}: f must be picklable with cloudpickle to run in other processes (a lambda "
            "or closure is; an object holding locks, files or sockets is not); or use "
            "executor='threads'",
        )
        raise
    call = _Driver(f, transport, f_payload, spec, table, plan, executor, remat, request.progress)
    if len(f_payload) >= HEAVY_F and call.key not in _WARNED_HEAVY:
        _WARNED_HEAVY.add(call.key)
        _warn_heavy_f(name, len(f_payload), time.perf_counter() - started)
    if f_payload.statistics and (call.key, transport.name) not in _WARNED_STATISTICS:
        _WARNED_STATISTICS.add((call.key, transport.name))
        _warn_statistics(name, transport.name)
    try:
        early = not summed and graph and not remat and uniform_cotangents(call.key)
        per_chunk = call.forward(
            elements, "forward_sum" if graph and (summed or early) else "forward"
        )
    except BaseException:
        call.release_all()
        raise
    if graph:
        call.note_versions()
    transport.learn(f, api, plan.count, plan.n)
    if not graph:
        call.release()
        results = [y for trees, _ in per_chunk for y in trees]
        if not summed:
            results = _leaves_handed_out(results, table)
        if summed:
            return sum_results(results, [len(trees) for trees, _ in per_chunk])
        return results
    # The join outputs, in chunk order, and each element's place for them (a tsum chunk of
    # losses is one "element": its sum).
    # A chunk of bare tensors, each its element's one join output, is placed as its list.
    placed: list[tuple[list[Any], Any, list[int]] | list[Tensor]] = []
    sizes: list[int] = []
    spans: list[tuple[int, int]] = []  # the elements each result stands for
    for k, (trees, diff) in enumerate(per_chunk):
        lo = len(call.outputs)
        first, stop = plan.bounds(k)
        if trees is None:
            call.outputs.append(diff)
            placed.append(([diff], None, [0]))
            sizes.append(1)
            spans.append((first, stop - 1))
        else:
            spans.extend((i, i) for i in range(first, first + len(trees)))
            call.chunks[k].diff = diff
            if all(type(t) is Tensor for t in trees) and all(p == _FIRST for p in diff):
                call.outputs += trees  # NOTE [a chunk of bare tensors]: no record per element
                placed.append(trees)
                sizes.append(len(trees))
                call.chunks[k].outputs = (lo, len(call.outputs))
                continue
            fresh: dict[int, Tensor] = {}
            for tree, positions in zip(trees, diff):
                leaves, spec_ = flatten(tree)
                if len(positions) < len(leaves):
                    _hand_out(leaves, table, fresh)
                for pos in positions:
                    call.outputs.append(leaves[pos])
                placed.append((leaves, spec_, positions))
            sizes.append(len(trees))
        call.chunks[k].outputs = (lo, len(call.outputs))
    inputs = [call.table.tensors[pid] for pid in call.inputs]
    if not (call.outputs and inputs):
        # Nothing to differentiate through: the results stand as they came.
        call.release()
        call.outputs = []
        results = _results(placed, None)
    else:
        joined = JoinNode.apply(call, *inputs)
        call.outputs = []  # the join's outputs are the results' now (no cycle through the join)
        results = _results(placed, joined)
        if not any(c.owner >= 0 for c in call.chunks) and not remat:
            call.release()  # nothing is kept on the workers (tsum's chunks of losses)
    return sum_results(results, sizes, spans) if summed else results


_FIRST = (0,)


def _bytes(t: Tensor) -> int:
    """The bytes of a dense gradient of ``t``."""
    return t.numel() * t.element_size()


def _per_group(chunks: Iterable[int], group: int) -> Counter[int]:
    """How many of ``chunks`` each group of the sum holds."""
    return Counter(k // group for k in chunks)


def _detached(t: Tensor) -> Tensor:
    """``t.detach()``, of ``t``'s own class: the join's forward runs with subclasses' torch
    functions off, where ``detach`` gives a plain tensor (a result of a tensor subclass came
    back as a plain tensor)."""
    out = t.detach()
    return out if type(out) is type(t) else out.as_subclass(type(t))


def _leaves_handed_out(results: list[Any], table: TensorTable) -> list[Any]:
    """``tmap``'s results without a graph, each [`LeafResult`][] replaced by the caller's
    object (NOTE [leaves that come back from another process] in ``_host``)."""
    fresh: dict[int, Tensor] = {}
    out = []
    for y in results:
        if isinstance(y, Tensor):
            out.append(y)
            continue
        leaves, spec_ = flatten(y)
        if _hand_out(leaves, table, fresh):
            y = unflatten(leaves, spec_)
        out.append(y)
    return out


def _hand_out(leaves: list[Any], table: TensorTable, fresh: dict[int, Tensor]) -> bool:
    """Replace each [`LeafResult`][] among ``leaves`` by the caller's object for it (one per
    marker: ``fresh`` maps each marker already seen in the chunk to its leaf); whether any was."""
    found = False
    for j, leaf in enumerate(leaves):
        if type(leaf) is LeafResult:
            t = fresh.get(id(leaf))
            if t is None:
                t = fresh[id(leaf)] = leaf.caller_object(table)
            leaves[j] = t
            found = True
    return found


def _results(
    placed: list[tuple[list[Any], Any, list[int]] | list[Tensor]],
    joined: Sequence[Tensor] | None,
) -> list[Any]:
    """The results, each placed leaf replaced by the join's output for it (``joined``), in
    turn; without a join, as they came."""
    results: list[Any] = []
    j = 0
    for entry in placed:
        if isinstance(entry, list):  # a chunk of bare tensors
            if joined is None:
                results += entry
            else:
                results += joined[j : j + len(entry)]
            j += len(entry)
            continue
        leaves, spec_, positions = entry
        if joined is not None:
            for pos in positions:
                leaves[pos] = joined[j]
                j += 1
        results.append(unflatten(leaves, spec_))
    return results


def _unpicklable(elements: Sequence[tuple[Any, ...]], start: int, stop: int, api: str) -> str:
    """A note naming the first element whose items do not pickle."""
    for i in range(start, stop):
        try:
            dumps(elements[i], TensorTable())
        except Exception:
            return (
                f"{api}: the items of element {i} (of {len(elements)}) do not pickle; items must "
                "be picklable to reach worker processes"
            )
    return f"{api}: the items of a chunk do not pickle"
