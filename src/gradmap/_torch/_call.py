"""The call: one call of ``tmap`` or ``tsum`` on threads, and what every pass over its chunks
needs -- the caller's state, the map's random numbers, where the forward runs (NOTE [forward
placement]), a pass with its progress bar, a chunk's recompute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from .. import _executors
from .._engine import ChunkRun, run_chunks
from .._executors import Executor, FuturesExecutor, SerialExecutor, ThreadExecutor
from .._items import Singles
from .._placement import Placement, key_of, placement_for, tell_of_processes
from .._progress import open_progress
from .._request import MapRequest
from ._chunk import ChunkRecord, run_forward
from ._cuda import pass_streams
from ._graph import Known, check_versions, leaves_before, modules_of, versions_used
from ._native import native
from ._random import MapRandom, guard_rng_forks, moved_by
from ._shared import Watch, warn_shared
from ._state import ThreadState
from ._swaps import guard_parameter_swaps, one_swapper

__all__ = ["CALLER", "MapCall"]

#: The caller's own thread, as an executor.
CALLER = SerialExecutor()


class MapCall:
    """One call of ``tmap``/``tsum``: what every pass needs."""

    def __init__(self, request: MapRequest, early: bool = False) -> None:
        f, elements, executor = request.f, request.elements, request.executor
        self.f: Callable[..., Any] | None = f
        self.elements: Sequence[tuple[Any, ...]] | None = elements
        self.executor = executor
        self.plan = request.plan
        self.remat = remat = request.remat
        #: NOTE [a recompute reads what the forward read] (``_graph``): after a remat forward.
        self.versions: list[tuple[torch.Tensor, int]] | None = None
        self.changed: torch.Tensor | None = None  # one the remat forward changed in place
        #: The ``.grad`` of the leaves ``f`` uses before a remat forward, and one it changed.
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []
        self.grad_written: torch.Tensor | None = None
        #: NOTE [items that view one tensor, changed in place]: such items, with their versions.
        self.views: list[tuple[torch.Tensor, int]] = []
        self.progress = request.progress
        self.api = api = request.api
        self.n = len(elements)
        self.state = ThreadState()
        if remat and self.state.autocast and self.state.autocast_cache:
            self.state.own_casts = True  # NOTE [autocast's weight cache] (``_state``)
        self.random = MapRandom()
        self.placement: Placement = placement_for(
            f,
            forced_many=request.placement == "many",
            forced_one=request.placement == "one",
            # maps of one f over counts within a factor of two share a history
            # (``early``: a tmap whose forward pulls back too, NOTE [tmap's losses pulled back
            # early] in ``_remote/_map``, is timed apart)
            kind=(api, remat, torch.is_grad_enabled(), len(elements).bit_length(), early),
        )
        # NOTE [telling of processes]: the cores looked up only where it may tell (a syscall)
        if self.placement.held_by_gil:
            tell_of_processes(f, self.placement, api, _executors.available_cores())
        #: Watches the first forward for process-wide state (NOTE [process-wide state f writes]).
        self.watch = Watch() if self.placement.first and executor.workers > 1 else None
        self.known: Known | None = None
        self._before: tuple[list[torch.Tensor], set[int]] | None = None  # ``made_before``'s
        self._before_lock = threading.Lock()
        self.owner = object()  # what this map's blocking hooks answer to
        if executor.workers > 1:
            guard_parameter_swaps()  # NOTE [parameters swapped by functional_call]
            guard_rng_forks()  # NOTE [random numbers of recomputes]

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
        last_wins: bool | None = None,
    ) -> list[Any]:
        """One pass over the chunks, with the caller's state and an optional progress bar
        (``last_wins``: as ``run_chunks`` takes it, for a backward pass)."""
        plan = self.plan
        bar = open_progress(self.progress, phase, plan.n, self.api)
        on_done = None if bar is None else (lambda k: bar.update(len(range(*plan.bounds(k)))))
        context = context or self.state.enter
        cuda = pass_streams()  # NOTE [CUDA streams on the pool's threads]
        if cuda is not None:
            run_chunk, context = cuda.chunk(run_chunk), cuda.context(context)
        try:
            return run_chunks(
                executor or self.executor,
                plan.count,
                run_chunk,
                reverse=reverse,
                context=context,
                on_done=on_done,
                last_wins=last_wins,
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
        self.versions_before(with_graph)
        self.random.each = placement.seeds_each or self.remat  # a recompute replays each

        def forward_chunk(k: int, run: ChunkRun[ChunkRecord]) -> ChunkRecord:
            record = run_forward(
                f,
                elements,
                range(*plan.bounds(k)),
                known=known,
                random=seeded,
                stop=lambda: run.stopped(k),
                api=self.api,
                leaf_results=self.api == "gradmap.tmap",  # NOTE [leaves returned as they are]
                watch=None if placement.many else self.watch,
            )
            if self.remat:
                if record.boundary.user or not self.gated:
                    record.note_retained()  # NOTE [results that retain their gradient]
                record.drop_graph()  # its boundary is read: free it before the next chunk
            return record

        def one_thread() -> list[ChunkRecord]:
            with self.random.seeding():
                return self.run_pass("forward", forward_chunk, executor=self.one_thread())

        records = self.placed(lambda: self.run_pass("forward", forward_chunk), one_thread)
        self.note_versions(with_graph)
        return records

    def placed(
        self, on_the_pool: Callable[[], list[ChunkRecord]], in_one_thread: Callable[[], Any]
    ) -> Any:
        """A forward pass where placement put it, timed, and what it taught about ``f``: whether
        it draws random numbers (and did unseeded), and whether it swaps a module's parameters.
        """
        placement = self.placement
        if placement.many:
            self.random.draw_base()  # NOTE [the generator after a map] in ``_random``
            records, drew = moved_by(lambda: placement.timed(on_the_pool, self.n))
            placement.learned_random(drew)
            self.random.unseeded = drew
        else:
            records = placement.timed(in_one_thread, self.n)
        self.random.learned(placement)
        self.learn_swaps(records)
        found = None if self.watch is None else self.watch.found
        if found is not None:
            placement.learned_shared(found)
            warn_shared(key_of(self.f), self.api, found)
        return records

    @property
    def swaps(self) -> bool:
        """Whether ``f`` swaps a module's parameters: recomputes one at a time."""
        return self.placement.swaps

    @property
    def shared(self) -> bool:
        """Whether ``f`` writes process-wide state (NOTE [process-wide state f writes]): its
        recomputes run one at a time, and its chunks are pulled back after the forward."""
        return self.placement.shared is not None or (
            self.watch is not None and self.watch.found is not None
        )

    def learn_swaps(self, records: list[ChunkRecord]) -> None:
        """After a forward: whether ``f`` swapped a module's parameters (NOTE [parameters swapped
        by functional_call] in ``_swaps``); raises where it did on several threads at once."""
        if not any(r.swapped for r in records):
            return
        self.placement.learned_swaps()
        if self.placement.many and self.executor.workers > 1:
            raise RuntimeError(
                f"{self.api}: f swapped a module's parameters (torch.func.functional_call) "
                "while elements ran on several threads at once, and an element that reads the "
                "module outside its own call (named_parameters(), an attribute) may have read "
                "another element's parameters: the results may not be the loop's. gradmap has "
                "learnt that f swaps: from its next map on, f's forwards run in one thread. Run "
                "this map again, or use executor='processes' (a module per worker)."
            )

    def versions_before(self, with_graph: bool) -> None:
        """Before a forward with a graph: under ``remat``, the versions of what it reads, to
        tell what it changes; and the ``.grad`` of the leaves ``f`` uses (a recompute, under
        ``remat`` or ``create_graph``, must not run an ``f`` that writes them)."""
        if with_graph and self.f is not None and self.elements is not None:
            if self.remat:
                self.versions = versions_used(self.f, self.elements)
            self.grads = _grads(self.f, self.versions or [])
            if self.executor.workers > 1:  # NOTE [items that view one tensor, changed in place]
                self.views = _item_views(self.elements)

    def note_versions(self, with_graph: bool) -> None:
        """After a forward with a graph: under ``remat``, the versions of what a recompute
        reads again (NOTE [a recompute reads what the forward read] in ``_graph``), and whether
        the forward itself changed any of it; whether it wrote the ``.grad`` of a leaf."""
        if with_graph and self.f is not None and self.elements is not None:
            if self.remat:
                before = self.versions or []
                self.changed = next((t for t, v in before if t._version != v), None)
                self.versions = versions_used(self.f, self.elements)
            self.grad_written = next(
                (
                    t
                    for t, g, v in self.grads
                    if t.grad is not g or (g is not None and g._version != v)
                ),
                None,
            )
            self.grads = []
            views, self.views = self.views, []
            if any(t._version != v for t, v in views):
                raise RuntimeError(
                    f"{self.api}: f changed in place an item that is a view of a tensor that "
                    "requires grad (items cut from one tensor: big.unbind(), big[i]). Their "
                    "changes are recorded on the tensor they view, which several threads then "
                    "change at once, and PyTorch's autograd does not take that from several "
                    "threads: the gradients would be wrong. Let f change a copy (x = x.clone()), "
                    "or use executor='serial' (the loop's order, one thread)."
                )

    def check_versions(self, recomputes: bool = True) -> None:
        """Before a ``remat`` backward's recomputes: raise where what they read changed, or
        where the forward changed what it was given (the recompute would change it again)."""
        if self.changed is not None:
            raise RuntimeError(
                f"{self.api}: with remat=True f runs again in the backward, and its forward "
                f"changed in place a tensor it was given (shape {tuple(self.changed.shape)}): "
                "the recompute would change it a second time, where the loop changes it once. "
                "Let f change a copy (x = x.clone()), or use remat=False."
            )
        if self.grad_written is not None and recomputes:
            raise RuntimeError(
                f"{self.api}: f runs again in this backward (remat=True, or a backward with "
                "create_graph=True), and its forward changed the .grad of a tensor it uses "
                f"(shape {tuple(self.grad_written.shape)}): f calls backward() (or writes "
                ".grad) itself, and running it again would add to .grad a second time, where "
                "the loop adds once. Take the gradient inside f with torch.autograd.grad (it "
                "writes no .grad), or use remat=False and no create_graph."
            )
        if self.versions:
            check_versions(self.versions, self.api)

    def one_thread(self) -> Executor:
        """Where a forward in one thread runs: the caller's thread for the serial reference (as
        its loop would), one thread of a user's executor (NOTE [a user's executor runs every
        chunk]), else one of gradmap's pool threads, which compute as the pool's other threads do
        (one intra-op thread: NOTE [forward placement])."""
        if isinstance(self.executor, ThreadExecutor):
            return ThreadExecutor(1)
        if isinstance(self.executor, FuturesExecutor):
            return self.executor.one_thread()
        return CALLER

    def recompute(self, indices: list[int], seeded: bool = False) -> ChunkRecord:
        """A fresh forward of some elements, with a graph (in a backward pass's thread); with
        ``seeded``, replaying each element's random numbers even if ``f`` was not seen to draw."""
        assert self.f is not None and self.elements is not None and self.known is not None
        if seeded and self.random.unseeded:
            self.random.cannot_replay(self.api)
        self.known.complete()
        replay = self.random.replaying(seeded)
        # NOTE [parameters swapped by functional_call], NOTE [process-wide state f writes]
        swaps = one_swapper() if self.swaps or self.shared else nullcontext()
        with torch.enable_grad(), self.state.autocast_context(), swaps, replay as seeded_by:
            return run_forward(
                self.f,
                self.elements,
                indices,
                known=self.known,
                random=seeded_by,
                api=self.api,
                leaf_results=self.api == "gradmap.tmap",
            )

    def made_before(self, t: torch.Tensor) -> bool:
        """Whether the leaf ``t`` existed before the call, for all the map can tell: one of the
        items' tensors, of what ``f`` refers to, or a parameter of its modules (not a leaf ``f``
        made for itself). Found once per call, when a recompute first asks (a rare case)."""
        with self._before_lock:
            if self._before is None:
                assert self.f is not None and self.elements is not None
                leaves = leaves_before(self.f, self.elements)
                self._before = (leaves, {id(x) for x in leaves})  # (kept alive: ids stay theirs)
        return id(t) in self._before[1]

    def free(self) -> None:
        self._before = None
        self.f = self.elements = None
        self.known = None
        self.versions = None
        self.changed = None


def _item_views(elements: Sequence[tuple[Any, ...]]) -> list[tuple[torch.Tensor, int]]:
    """The items that are views of a tensor with a graph, with their versions now.

    NOTE [items that view one tensor, changed in place]:
        Items cut from one tensor that requires grad (``big.unbind()``, ``big[i]``) are views
        of it, and a change ``f`` makes in place to its item is recorded on that tensor: its
        ``grad_fn`` becomes a ``CopySlices`` node over the one before, and the view's is made
        again from it. The loop makes those changes one after another; threads make them at
        once, and PyTorch's autograd does not guard a tensor's history against that (two bare
        threads, no gradmap: wrong gradients in 5 runs of 12). So a map on more than one thread
        notes such items' versions before its forward (a view shares its version with the
        tensor it views), and stops after it if one changed, telling how to go on. Only tensor
        items are looked at, one attribute each (``grad_fn``, ``None`` for the common leaf or
        constant item; ``_is_view()`` and ``_version`` for the others, none of which lets go
        of the GIL)."""
    found = []
    items = elements.items if type(elements) is Singles else (a for args in elements for a in args)
    for t in items:
        if type(t) is torch.Tensor and t.grad_fn is not None and t._is_view():
            found.append((t, t._version))
    return found


def _grads(
    f: Any, used: list[tuple[torch.Tensor, int]]
) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
    """The leaves requiring grad that ``f`` uses (its modules' parameters, the other tensors it
    and the items hold), each with its ``.grad`` and that gradient's version now: what a
    forward that writes ``.grad`` itself changes."""
    leaves: list[torch.Tensor] = [p for m in modules_of(f) for p in m.parameters()]
    leaves += [t for t, _ in used if t.is_leaf and t.requires_grad]
    out = []
    for t in leaves:
        g = t.grad
        out.append((t, g, -1 if g is None else g._version))
    return out
