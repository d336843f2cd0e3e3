"""The host: a worker process (a Ray actor, or one of gradmap's worker processes) that runs chunks
of calls, keeps their graphs, and pulls them back. Ray and the local processes differ only in how
calls reach it (the transport); what it does is here, once.

It hosts the same chunk record as the thread executor (``_torch/_chunk.py``): a chunk's forward is
``run_forward`` -- ``f`` untouched, random numbers seeded per element, the boundary read off the
chunk's graph, notes naming a failing element -- and its pullback is ``pull_back``, with its
handling of missing and zero cotangents. The leaves that arrived for the caller's tensors
(``_pickling``) are where each chunk's graph ends, so each chunk's gradient for them is its own
sum, whatever else ran on this actor.

Methods (the work methods take a batch of consecutive chunks and answer per chunk):
    ``forward``: run chunks; keep their graphs (unless ``remat`` or grad mode is off); return
        their results, detached.
    ``backward``: pull kept chunks back; :data:`LOST` for a chunk this actor does not hold (it
        was restarted, or the state was released).
    ``recompute``: the stateless pullback: run a chunk's forward again from its items and pull
        it back at once (``remat=True``, and chunks whose actor was lost).
    ``forward_sum``: ``tsum``'s chunk: its forward and, for a chunk of losses, its pullback with
        cotangent one at once; nothing is kept.
    ``release``: forget a call.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import torch

from .._engine import on_a_chunk
from .._errors import mark_place
from .._join import fold_pairs
from .._torch._chunk import (
    ACCUMULATE,
    DEFERRED,
    ChunkRecord,
    pull_back,
    pull_back_kept,
    pull_back_sum,
    run_forward,
)
from .._torch._graph import Boundary, Known, modules_of, tensors_in, tensors_of
from .._torch._random import SEEDING, MapRandom
from .._torch._state import ThreadState
from .._tree import flatten, unflatten
from ._filters import caller_filters, take_filters
from ._kept import KeptItems, KeptOnHost
from ._pickling import AsIs, LeafResult, LeafTable, dumps_results, loads
from ._settings import Setting, check_settings
from ._where import pyro_param_name, where_held

__all__ = ["LOST", "CallSpec", "ForeignTensorError", "Host", "draw_base", "in_worker"]

Tensor = torch.Tensor

#: A chunk's items as they travel: pickled, or kept (NOTE [items kept from call to call]).
Items = bytes | KeptItems

#: What ``backward`` returns for a chunk this actor does not hold.
LOST = "gradmap.lost"

_in_worker = False
_local = threading.local()


def in_worker() -> bool:
    """Whether this process is one of gradmap's workers (a Ray actor or a worker process), or
    this thread is running a chunk for one (``LocalHost``)."""
    return _in_worker or getattr(_local, "active", False)


@contextmanager
def hosting() -> Iterator[None]:
    """Within it, the calling thread runs a chunk as a worker would (``in_worker``)."""
    was = getattr(_local, "active", False)
    _local.active = True
    try:
        yield
    finally:
        _local.active = was


class ShippedSeed(MapRandom):
    """The map's seed base, drawn by the driver.

    The thread executor draws the base from the global generator on the first random call of a
    map (NOTE [random numbers per element]). The driver makes that draw before the map starts
    and sets its generator back ([`draw_base`][]); a worker seeds each element from the base,
    and reports whether the elements drew; if any did, the driver makes the same draw again, to
    leave its generator where the threads would have left it.
    """

    def __init__(self, base: int) -> None:
        super().__init__()
        self.base = base

    @property
    def drawn(self) -> bool:
        return self.drew


def draw_base() -> int:
    """The seed base the thread executor would draw now; the global generator is left as it was
    (about 4 us)."""
    generator = torch.default_generator
    # No other map seeds the generator meanwhile; nested in a chunk of a map on threads, the
    # outer map holds the lock already (waiting for this chunk: taking it again deadlocked).
    with nullcontext() if on_a_chunk() else SEEDING:
        state = generator.get_state()
        try:
            return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        finally:
            generator.set_state(state)


@dataclass
class CallSpec:
    """What every chunk of a call shares, shipped once per call with ``f``.

    Attributes:
        n: the number of elements of the map.
        seed_base: the map's seed base ([`draw_base`][]).
        forward_state: the caller's grad mode, inference mode and autocast.
        default_dtype: the caller's ``torch.get_default_dtype()`` (process-wide: it does not
            travel by itself).
        anomaly: the caller's anomaly mode, ``(enabled, check_nan)`` (process-wide too).
        deterministic: the caller's ``torch.use_deterministic_algorithms`` setting,
            ``(mode, warn_only)`` (process-wide too).
        graph: record graphs (grad mode on, not inference).
        remat: keep no graph in the forward.
        api: ``"gradmap.tmap"`` or ``"gradmap.tsum"``, for errors.
        settings: the module settings ``f`` reads, as the caller sees them (NOTE [settings a
            worker imports anew]).
        warnings: the caller's warnings filters, ``(digest, payload)`` (NOTE [the caller's
            warnings filters] in ``_filters``).
    """

    n: int
    seed_base: int
    forward_state: ThreadState
    default_dtype: torch.dtype
    graph: bool
    remat: bool
    api: str = "gradmap.tmap"
    settings: tuple[Setting, ...] = ()
    anomaly: tuple[bool, bool] | None = None  # (None: off, PyTorch's default)
    deterministic: tuple[bool, bool] | None = None  # (None: off)
    warnings: tuple[bytes, bytes] | None = None  # (None: no filter pickles)


def process_wide() -> dict[str, Any]:
    """The caller's process-wide settings that a worker process takes for a call: the default
    dtype, anomaly mode, deterministic algorithms, warnings filters (``CallSpec``'s fields)."""
    anomaly, deterministic = _anomaly(), _deterministic()
    return {  # (the defaults as None: a call's every message carries them)
        "default_dtype": torch.get_default_dtype(),
        "anomaly": None if anomaly == _ANOMALY_OFF else anomaly,
        "deterministic": None if deterministic == _DETERMINISTIC_OFF else deterministic,
        "warnings": caller_filters(),
    }


_ANOMALY_OFF = (False, True)
_DETERMINISTIC_OFF = (False, False)


def _anomaly() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def _deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _process_wide(spec: CallSpec) -> AbstractContextManager[None]:
    """Within it, the process runs with ``spec``'s process-wide settings (the caller's: in the
    caller's own process, they are already). A worker process takes the caller's warnings
    filters, and keeps them (NOTE [the caller's warnings filters])."""
    if _in_worker:
        take_filters(spec.warnings)
    anomaly = spec.anomaly or _ANOMALY_OFF
    deterministic = spec.deterministic or _DETERMINISTIC_OFF
    if (
        torch.get_default_dtype() == spec.default_dtype
        and _anomaly() == anomaly
        and _deterministic() == deterministic
    ):
        return nullcontext()
    return _set_process_wide(spec.default_dtype, anomaly, deterministic)


@contextmanager
def _set_process_wide(
    dtype: torch.dtype, anomaly: tuple[bool, bool], deterministic: tuple[bool, bool]
) -> Iterator[None]:
    was = torch.get_default_dtype(), _anomaly(), _deterministic()
    # Only where it changes: ``use_deterministic_algorithms`` imports ``torch._inductor.config``
    # on its first call, 0.95 s here, which a worker's first map paid inside its ``timeout``
    # (a helper's ``ProcessExecutor(timeout=1.0)`` timed out every map of a trivial ``f``).
    determinism = deterministic != was[2]
    torch.set_default_dtype(dtype)
    torch.set_anomaly_enabled(*anomaly)
    if determinism:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    try:
        yield
    finally:
        dtype, anomaly, deterministic = was
        torch.set_default_dtype(dtype)
        torch.set_anomaly_enabled(*anomaly)
        if determinism:
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


class _Window(Sequence[Any]):
    """The elements of one chunk, indexed by their place in the whole map (``run_forward``
    indexes elements globally: the element notes and random seeds use the global index)."""

    def __init__(self, items: list[tuple[Any, ...]], start: int, n: int) -> None:
        self._items = items
        self._start = start
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        return self._items[i - self._start]


@dataclass
class _Kept:
    chunk: ChunkRecord
    pids: list[int]  # the pid of each boundary tensor of the chunk


@dataclass
class _CallState:
    f: Any
    spec: CallSpec
    leaves: LeafTable
    seed: ShippedSeed
    known: Known
    api: str
    chunks: dict[int, _Kept] = field(default_factory=dict)
    #: The leaves of the caller's tensors that ``f`` itself holds (parameters, closure tensors).
    own: list[Tensor] = field(default_factory=list)
    #: The storages of the tensors ``f`` reaches, once a leaf not from the caller shows up
    #: (NOTE [leaves f makes for itself on a worker]).
    reached: set[int] | None = None


class KeptFunctions:
    """A host's functions, by the digest of their payload: each payload kept from when it
    arrives, and unpickled (then dropped) when its function is first loaded; the last ``kept``
    digests used, least recently used out first. A transport whose caller keeps an account of
    what each worker holds (``_process``) mirrors it by touching every digest a call names, in
    the caller's order."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        # digest -> [payload (until unpickled), (f, leaves) (once unpickled)]
        self._entries: OrderedDict[bytes, list[Any]] = OrderedDict()

    def touch(self, digest: bytes, payload: bytes | None = None) -> list[Any]:
        """The entry of ``digest``, now the most recently used: made from ``payload`` if one
        comes (a ``KeyError`` if none comes for a digest not kept)."""
        entries = self._entries
        if payload is not None:
            entry = entries[digest] = [payload, None]
            while len(entries) > self._kept:
                entries.popitem(last=False)
        else:
            entry = entries[digest]
        entries.move_to_end(digest)
        return entry

    def load(
        self,
        digest: bytes,
        payload: Callable[[], bytes],
        loads: Callable[[bytes, LeafTable], Any],
    ) -> tuple[Any, LeafTable]:
        """``f`` unpickled (with ``loads``) from its payload -- ``payload()`` the first time
        ``digest`` comes -- and a copy of its leaf table for the call."""
        entry = self._entries.get(digest)
        entry = self.touch(digest, payload() if entry is None else None)
        if entry[1] is None:
            leaves = LeafTable()
            entry[1] = (loads(entry[0], leaves), leaves)
            entry[0] = None
        f, leaves = entry[1]
        return f, leaves.copy()


class ForeignTensorError(RuntimeError):
    """``f`` used a tensor that requires grad and did not travel from the caller."""


class Host:
    """What a worker process runs: the chunks of maps, by call.

    A transport subclasses it to say how ``f``'s payload arrives (``load_f``): Ray's actors get it
    from the object store, gradmap's worker processes in the call that first needs it; both
    keep the functions unpickled from recent payloads, by digest.
    """

    #: The executor's name, for errors (``executor='ray'``).
    executor = "ray"
    #: How many functions (by their payload's digest) the host keeps.
    functions_kept = 4

    def __init__(self, threads: int, *, process: bool = True) -> None:
        """``process``: this process is the worker (the intra-op threads are set once, and maps
        inside ``f`` run here, serially); otherwise a thread of the caller runs chunks (see
        ``LocalHost``)."""
        if process:
            global _in_worker
            _in_worker = True
            torch.set_num_threads(threads)
        self._process = process
        self._threads = threads
        self._calls: dict[str, _CallState] = {}
        self._functions = KeptFunctions(self.functions_kept)
        self._items = KeptOnHost()  # NOTE [items kept from call to call]

    def load_f(self, box: Any) -> tuple[Any, LeafTable]:
        """``f`` unpickled from the payload ``box`` stands for, and the leaves it holds."""
        raise NotImplementedError

    def _kept_function(self, digest: bytes, payload: Callable[[], bytes]) -> tuple[Any, LeafTable]:
        """``f`` unpickled from ``payload()`` the first time ``digest`` comes, and kept while it
        is among the last ``functions_kept`` digests; a copy of its leaf table for the call."""
        return self._functions.load(digest, payload, self.loads_payload)

    def loads_payload(self, payload: bytes, leaves: LeafTable) -> Any:
        """``f`` unpickled from its payload."""
        return loads(payload, leaves)

    # -- small methods ---------------------------------------------------------------------

    def pid(self) -> int:
        return os.getpid()

    def stored(self) -> int:
        """How many calls this actor holds state for (graphs, ``f``)."""
        return len(self._calls)

    def release(self, call_id: str) -> None:
        self._calls.pop(call_id, None)

    # -- the work ----------------------------------------------------------------------------

    def _call(self, call_id: str, box: Any, spec: CallSpec) -> _CallState:
        state = self._calls.get(call_id)
        if state is None:
            f, leaves = self.load_f(box)
            known = Known(f, (), eager=False)
            api = f"{spec.api}(executor={self.executor!r})"
            if self._process:  # the caller's own host shares the caller's modules
                check_settings(spec.settings, api)
            state = _CallState(f, spec, leaves, ShippedSeed(spec.seed_base), known, api)
            state.own = list(leaves.leaves.values())  # before any item's leaves join them
            self._calls[call_id] = state
        self._check_threads()
        return state

    def forward(
        self, call_id: str, box: Any, spec: CallSpec, chunks: list[tuple[int, int, Items]]
    ) -> list:
        """Run chunks, each given as ``(chunk, start, items)``; keep their graphs if there are.

        Returns:
            For each chunk, the pickled ``(results, diff, used, drawn)``: each element's result
            with its join outputs detached; the positions of the join outputs in each result's
            leaves; the pids of the caller's tensors the chunk used; whether this actor has drawn
            the map's seed.
        """
        return self._each_chunk(call_id, box, spec, chunks, self._forward)

    def _each_chunk(
        self,
        call_id: str,
        box: Any,
        spec: CallSpec,
        chunks: list[tuple[int, int, Items]],
        run: Callable[[_CallState, int, int, Items], Any],
    ) -> list:
        """``run(state, chunk, start, items)`` for each chunk of a call; the call's state is
        forgotten afterwards if it keeps no chunk."""
        state = self._call(call_id, box, spec)
        try:
            out = []
            for place, (k, start, items) in enumerate(chunks):
                try:
                    out.append(run(state, k, start, items))
                    if state.own:
                        _no_grads_written(state, start)
                except BaseException as exc:
                    mark_place(exc, place)  # NOTE [the error of the loop's element]
                    raise
            return out
        finally:
            self._drop_if_empty(call_id, state)

    def _forward(self, state: _CallState, k: int, start: int, items: Items) -> bytes:
        spec = state.spec
        with self._loading():
            local = cast(list, self._items.load(items, state.leaves))
        if not spec.graph:  # seeded per element as with a graph: the same draws either way
            with spec.forward_state.enter(False), _process_wide(spec):
                plain = _run(state, start, local, graph=False)
            results = list(plain.plain_results())
            if spec.api == "gradmap.tmap":  # a sum made with grad mode off has no graph either
                for j, y in enumerate(results):
                    results[j] = _plain_leaf_results(y, state, start + j)
                _no_graph_results(results, start, state)
            if not self._process:  # as pickling would: no leaf of this host reaches the caller
                results = [_detached_all(y) for y in results]
            return self._out((self._handed_out(results), None, [], state.seed.drawn))
        with spec.forward_state.enter(False), _process_wide(spec):
            record = _run(state, start, local)
        if spec.remat:
            record.drop_graph()
        pids = _pids(state, record)
        if not spec.remat:
            state.chunks[k] = _Kept(record, pids)
        results, diff = _detached_results(record, state, start)
        return self._out((self._handed_out(results), diff, sorted(set(pids)), state.seed.drawn))

    def backward(
        self,
        call_id: str,
        chunks: list[tuple[int, bytes, bool]],
        backward_state: ThreadState,
        folds: list[list[int]] | None = None,
        wanted: list[int] | None = None,
    ) -> list:
        """Pull back kept chunks, each given as ``(chunk, cotangents, keep)`` (one cotangent per
        join output of the chunk); forget each chunk once pulled back unless ``keep``
        (``retain_graph``, or results of the chunk that no backward has gone through yet).
        ``folds``: the positions (among ``chunks``) of each group of the sum the call holds
        whole, whose gradients are sent added up (NOTE [chunk-order sum] in ``_join``).
        ``wanted``: the pids the running backward needs (``None``: all); an element that reaches
        none of them is not pulled back (``MapGraph.wanted`` in ``_torch/_map``).

        Returns:
            For each chunk, its pickled gradients, ``[(pid, gradient), ...]`` summed per pid
            within the chunk (a folded group's sum with its first chunk, nothing with the
            others); or :data:`LOST` if this actor does not hold the chunk.
        """
        state = self._calls.get(call_id)
        out: list[Any] = []
        try:
            for place, (k, cotangents, keep) in enumerate(chunks):
                kept = None if state is None else state.chunks.get(k)
                if state is None or kept is None:
                    out.append(LOST)
                    continue
                self._check_threads()
                try:
                    cots = tuple(_cotangents(cotangents, state.leaves))
                    with backward_state.enter(False), _process_wide(state.spec):
                        grads = _pull_back(kept.chunk, cots, state, _mask(kept.pids, wanted))
                except BaseException as exc:
                    mark_place(exc, place)  # NOTE [the error of the loop's element]
                    raise
                if not keep:
                    del state.chunks[k]
                out.append(_by_pid(kept.pids, grads))
        finally:
            if state is not None:
                self._drop_if_empty(call_id, state)
        for fold in folds or ():
            if all(out[i] is not LOST for i in fold):  # (a chunk lost: sent one by one)
                out[fold[0]] = fold_pairs([out[i] for i in fold], torch.add)
                for i in fold[1:]:
                    out[i] = []
        return [value if value is LOST else self._out(value) for value in out]

    def forward_sum(
        self,
        call_id: str,
        box: Any,
        spec: CallSpec,
        chunks: list[tuple[int, int, Items]],
        folds: list[list[int]] | None = None,
    ) -> list:
        """``tsum``'s chunks, each given as ``(chunk, start, items)``: the forward, and for a
        chunk whose results are all 0-d (losses), its pullback with cotangent one at once
        (NOTE [tsum pulls back during the forward] in ``_torch/_sum``); such a chunk keeps
        nothing. Any other chunk is kept as ``forward`` keeps it, and so is a chunk of losses
        whose pullback failed (run again: the backward raises, where it needs the chunk).
        ``folds``: the positions (among ``chunks``) of each group of the sum the call holds
        whole: the gradients of its chunks of losses are sent added up (NOTE [chunk-order sum]
        in ``_join``).

        Returns:
            For each chunk, the pickled ``("sum", total, [(pid, gradient), ...], drawn)`` of a
            chunk of losses (its detached sum, and the gradients of that sum; a folded group's
            with its first chunk of losses, none with the others), or what ``forward`` returns
            for it.
        """
        out = self._each_chunk(call_id, box, spec, chunks, self._forward_sum)
        for fold in folds or ():
            sums = [i for i in fold if type(out[i]) in (_Sum, _Early)]
            if len(sums) > 1:
                first = out[sums[0]]
                first.grads = fold_pairs([out[i].grads for i in sums], torch.add)
                for i in sums[1:]:
                    out[i].grads = []
        return [self._out(v.value()) if type(v) in (_Sum, _Early) else v for v in out]

    def _forward_sum(self, state: _CallState, k: int, start: int, items: Items) -> Any:
        spec = state.spec
        if not spec.graph or spec.remat:
            return self._forward(state, k, start, items)
        with self._loading():
            local = cast(list, self._items.load(items, state.leaves))
        with spec.forward_state.enter(False), _process_wide(spec):
            record = _run(state, start, local)
            # NOTE [chunks whose backward is user code], [gradients of reduced precision]
            # (``_graph``)
            if record.boundary.user or record.boundary.reduced:
                losses = False
            elif record.results is not None:  # NOTE [a chunk of bare tensors]
                # (``dtype.is_complex``: NOTE [tensor methods that let go of the GIL] in
                # ``_torch/_early``)
                losses = record.results is record.outputs and all(
                    y.dim() == 0 and not y.dtype.is_complex for y in record.outputs
                )
            else:
                # (bare tensors only: the sum of a chunk of ``(loss,)`` would lose its
                # structure, which the driver checks against the other chunks')
                losses = bool(record.outputs) and all(
                    el.spec is None
                    and len(el.diff) == 1
                    and el.leaves[0].dim() == 0
                    and not el.leaves[0].dtype.is_complex
                    for el in record.elements
                )
            grads = None
            if losses and spec.api == "gradmap.tmap":  # NOTE [tmap's losses pulled back early]
                return self._forward_early(state, k, start, record)
            if losses:
                pids = _pids(state, record)
                grads = pull_back_sum(record, n=spec.n, owner=state, api=state.api)
                if grads is ACCUMULATE:
                    _reentrant(state)
                if grads is DEFERRED:
                    # It failed (and freed part of its graph): run again and kept, for the
                    # backward to pull back, as on threads: the error is raised there, as in
                    # the loop, and not where that backward does not need the chunk.
                    record = _run(state, start, local)
                    losses = False
        if not losses:
            state.chunks[k] = _Kept(record, _pids(state, record))
            pids = sorted(set(state.chunks[k].pids))
            results, diff = _detached_results(record, state, start)
            return self._out((self._handed_out(results), diff, pids, state.seed.drawn))
        # Added one by one, in element order, as the thread executor adds a chunk's results.
        values = [t.detach() for t in record.outputs]
        total = values[0]
        for value in values[1:]:
            total = total + value
        if type(total) is not torch.Tensor:  # (a tensor subclass of the user's script)
            total = self._handed_out([total])[0]
        return _Sum(total, _by_pid(pids, grads), state.seed.drawn)

    def _forward_early(self, state: _CallState, k: int, start: int, record: ChunkRecord) -> Any:
        """A ``tmap`` chunk of losses run by ``forward_sum``: kept as ``forward`` keeps it, and
        pulled back with cotangent one now, its graph kept for a backward with other
        cotangents (NOTE [tmap's losses pulled back early] in ``_torch/_early``)."""
        kept = state.chunks[k] = _Kept(record, _pids(state, record))
        pids = sorted(set(kept.pids))
        results, diff = _detached_results(record, state, start)
        results = self._handed_out(results)
        # (under the state the driver's backward sends: the same bits as its pullback)
        with _backward_state().enter(False), _process_wide(state.spec):
            grads = pull_back_kept(record, owner=state)
        if grads is None:  # pulled back by the backward, which raises what the loop would
            return self._out((results, diff, pids, state.seed.drawn))
        return _Early(results, diff, pids, _by_pid(kept.pids, grads), state.seed.drawn)

    def recompute(
        self,
        call_id: str,
        box: Any,
        spec: CallSpec,
        chunks: list[tuple[int, Items, list[list[int]], bytes]],
        backward_state: ThreadState,
        wanted: list[int] | None = None,
    ) -> list:
        """The stateless pullback of chunks, each given as ``(start, items, diff, cotangents)``:
        the chunk's forward again, then its backward.

        ``diff`` gives, per element, the result leaves the cotangents belong to (as the forward
        reported them). The fresh forward keeps a graph whatever ``remat`` says, and is pulled
        back by the same code as a kept chunk, so the gradients are those a kept chunk would
        have given (``f`` must be deterministic apart from its random numbers, which are
        replayed).

        ``wanted``: as ``backward`` takes it.

        Returns:
            For each chunk, its pickled gradients, as ``backward`` returns them.
        """
        state = self._call(call_id, box, spec)
        try:
            out = []
            for place, (start, items, diff, cotangents) in enumerate(chunks):
                try:
                    answer = self._recompute(
                        state, start, items, diff, cotangents, backward_state, wanted
                    )
                except BaseException as exc:
                    mark_place(exc, place)  # NOTE [the error of the loop's element]
                    raise
                out.append(answer)
            return out
        finally:
            self._drop_if_empty(call_id, state)

    def _recompute(
        self,
        state: _CallState,
        start: int,
        items: Items,
        diff: list[list[int]],
        cotangents: bytes,
        backward_state: ThreadState,
        wanted: list[int] | None = None,
    ) -> bytes:
        spec = state.spec
        with self._loading():
            local = cast(list, self._items.load(items, state.leaves))
        cots = _cotangents(cotangents, state.leaves)
        with spec.forward_state.enter(False), _process_wide(spec):
            fresh = _run(state, start, local)
        pids = _pids(state, fresh)
        # The cotangent of each fresh join output, found by (element, leaf position).
        given: dict[tuple[int, int], Any] = {}
        o = 0
        for e, positions in enumerate(diff):
            for pos in positions:
                given[e, pos] = cots[o]
                o += 1
        aligned = tuple(
            given.get((e, pos)) for e, el in enumerate(fresh.elements) for pos in el.diff
        )
        with backward_state.enter(False), _process_wide(spec):
            grads = _pull_back(fresh, aligned, state, _mask(pids, wanted))
        return self._out(_by_pid(pids, grads))

    def _loading(self) -> AbstractContextManager[object]:
        """The context a chunk's items are unpickled in."""
        return nullcontext()

    def _handed_out(self, results: list[Any]) -> list[Any]:
        """A chunk's results as the caller gets them."""
        return results

    def _out(self, value: Any) -> Any:
        """What a work method answers for a chunk: pickled in a worker process; as it is in the
        caller's own host (``_process/_local.py``), which the driver reads in place."""
        return dumps_results(value) if self._process else value

    def _drop_if_empty(self, call_id: str, state: _CallState) -> None:
        # A call's state lives only while this actor holds a chunk of it: the driver sends a
        # release only to actors it left chunks on (NOTE [the map in other processes]).
        if not state.chunks:
            self._calls.pop(call_id, None)

    def _check_threads(self) -> None:
        if self._process and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)


class _Sum:
    """A chunk of losses in ``forward_sum``, before its answer is made: its gradients may yet
    be added up with those of the rest of its group."""

    __slots__ = ("drawn", "grads", "total")

    def __init__(self, total: Tensor, grads: list[tuple[int, Tensor]], drawn: bool) -> None:
        self.total, self.grads, self.drawn = total, grads, drawn

    def value(self) -> tuple[str, Tensor, list[tuple[int, Tensor]], bool]:
        return ("sum", self.total, self.grads, self.drawn)


def _backward_state() -> ThreadState:
    """The thread state of a plain backward (the driver's ``backward`` sends its caller's:
    grad mode off, and no autocast or inference mode under a usual ``.backward()``)."""
    state = ThreadState(grad_enabled=False)
    state.inference = False
    state.autocast = []
    return state


class _Early:
    """A ``tmap`` chunk of losses in ``forward_sum``, before its answer is made: its results,
    and its gradients with cotangent one, which may yet be added up with those of the rest of
    its group."""

    __slots__ = ("diff", "drawn", "grads", "pids", "results")

    def __init__(
        self,
        results: list[Any],
        diff: Any,
        pids: list[int],
        grads: list[tuple[int, Tensor]],
        drawn: bool,
    ) -> None:
        self.results = results
        self.diff = diff
        self.pids = pids
        self.grads = grads
        self.drawn = drawn

    def value(self) -> tuple[Any, ...]:
        return ("early", self.results, self.diff, self.pids, self.drawn, self.grads)


def _cotangents(payload: Any, leaves: LeafTable) -> Any:
    """A chunk's cotangents: unpickled, or as they are (``AsIs``: for the caller's own host)."""
    if type(payload) is AsIs:
        return payload.value
    return loads(payload, leaves)


def _run(state: _CallState, start: int, local: list[Any], *, graph: bool = True) -> ChunkRecord:
    """A chunk's forward (the chunk record's), its elements indexed as in the whole map; its
    boundary read only with ``graph``.

    NOTE [autocast's cast cache per chunk]:
        Under autocast, PyTorch caches the low-precision cast of each leaf that requires grad
        (a weight) for as long as the outermost autocast region lasts, in the thread. A worker
        enters the caller's autocast around each chunk, so each chunk casts its weights anew.
        The caller's own chunks run inside the user's region, where a chunk would take the cast
        an earlier chunk made -- a node of that chunk's graph, outside its own, which no join
        input names (``ForeignTensorError``) -- and the user's region would keep the casts of
        the host's leaves. So the cache is cleared around every chunk's forward here (the
        user's own casts are made again on next use: the same values and gradients).
    """
    window = cast(list, _Window(local, start, state.spec.n))
    torch.clear_autocast_cache()
    try:
        return run_forward(
            state.f,
            window,
            range(start, start + len(local)),
            known=state.known if graph else None,
            random=state.seed,
            api=state.api,
            leaf_results=state.spec.api == "gradmap.tmap",  # NOTE [leaves returned as they are]
        )
    finally:
        torch.clear_autocast_cache()


def _pull_back(
    record: ChunkRecord, cots: Any, state: _CallState, wanted: list[bool] | None = None
) -> Any:
    grads = pull_back(record, cots, n=state.spec.n, owner=state, api=state.api, wanted=wanted)
    if grads is ACCUMULATE:
        _reentrant(state)
    return grads


def _reentrant(state: _CallState) -> NoReturn:
    raise RuntimeError(
        f"{state.api}: f uses torch.utils.checkpoint with use_reentrant=True, which can only run "
        "under a plain .backward() in the caller's process. Use use_reentrant=False, or the "
        "thread executor."
    )


def _pids(state: _CallState, record: ChunkRecord) -> list[int]:
    """The pid of each boundary tensor of a chunk's record; a leaf ``f`` made for itself and let
    go (NOTE [leaves f makes for itself on a worker]) leaves the boundary instead."""
    boundary = record.boundary
    tensors = boundary.tensors
    pids: list[int] = []
    own: list[int] = []
    for k in range(len(tensors)):
        pid = state.leaves.pid(tensors[k])
        if pid is None:
            if not _let_go(boundary, k, state):
                raise _foreign(state, tensors[k])
            own.append(k)
        else:
            pids.append(pid)
    if own:
        for attr in ("keys", "tensors", "inputs"):
            entries = getattr(boundary, attr)
            setattr(boundary, attr, [e for k, e in enumerate(entries) if k not in own])
    return pids


def _let_go(boundary: Boundary, k: int, state: _CallState) -> bool:
    """Whether boundary entry ``k``, a tensor that did not come from the caller, is a leaf ``f``
    made for itself during the chunk and let go.

    NOTE [leaves f makes for itself on a worker]:
        A boundary tensor that did not travel from the caller is either the worker's own copy of
        state the caller has (a module global of an importable module, a tensor cached on the
        worker), whose gradient the loop gives to the caller's object and a worker can never
        give (``ForeignTensorError``), or a leaf ``f`` made for itself to take a gradient
        inside (forces: ``pos = x.clone().requires_grad_()``), which the loop's backward
        reaches too and accumulates into a tensor nobody holds any more: nothing to give back.
        Told apart by who holds it once the chunk ran: no Python object but the walk's own
        lists (its reference count is that of such a leaf in a chunk run once per process
        through the same walk, ``_refs_of_a_leaf_let_go``), and no storage shared with a tensor
        ``f`` reaches (its modules' parameters and buffers included, which a scripted module
        holds in C++ only). A leaf held anywhere else -- an item made to require grad in place
        (``x.requires_grad_()``: the loop gives the caller's item a ``.grad``), a result, a
        cache, a module global -- raises. Checked only where such a tensor shows up.
    """
    if sys.getrefcount(boundary.tensors[k]) > _refs_of_a_leaf_let_go(state.known):
        return False
    t = boundary.tensors[k]
    if not t.is_leaf:
        return False
    reached = state.reached
    if reached is None:
        reached = state.reached = _storages(state.f)
    return _storage_of(t) not in reached


def _storages(f: Any) -> set[int]:
    """The storages of the tensors ``f`` reaches, its modules' parameters and buffers included."""
    found = set()
    for t in tensors_of(f):
        found.add(_storage_of(t))
    for module in modules_of(f):
        for t in (*module.parameters(), *module.buffers()):
            found.add(_storage_of(t))
    found.discard(0)
    return found


def _storage_of(t: Tensor) -> int:
    if t.layout != torch.strided:
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # (a tensor subclass without one storage)
        return 0


_LET_GO: dict[bool, int] = {}


def _refs_of_a_leaf_let_go(known: Known) -> int:
    """The reference count ``_let_go`` sees for a leaf ``f`` made and let go: measured once per
    process and walk (native or Python), on a chunk run through ``run_forward`` as the host runs
    its chunks."""
    native = known.native is not None
    refs = _LET_GO.get(native)
    if refs is None:

        def made(x: Tensor) -> Tensor:
            return (x.clone().requires_grad_() * 2.0).sum()

        walk = Known(made, (), eager=False)
        if (walk.native is not None) is not native:  # (not seen: one walk per process)
            return -1  # every such tensor refused, as before this check
        with torch.enable_grad():
            record = run_forward(made, [(torch.ones(2),)], range(1), known=walk, random=None)
        refs = _LET_GO[native] = sys.getrefcount(record.boundary.tensors[0])
    return refs


def _foreign(state: _CallState, t: Tensor) -> ForeignTensorError:
    """The error for a tensor ``f`` used that did not come from the caller, saying where the
    worker holds it where that can be found (NOTE [where a foreign tensor lives])."""
    head = (
        f"{state.api}: f used a tensor that requires grad but did not come from the caller "
        f"(shape {tuple(t.shape)}"
    )
    param = pyro_param_name(t)
    if param is not None:
        return ForeignTensorError(
            f"{head}): pyro's param store's parameter {param!r} (pyro.param). pyro's param "
            "store is one per process: each worker has its own, whose gradients never reach "
            "the caller's. Pass the parameters into f explicitly (as a closure or items), or "
            "hold them as pyro.nn.PyroModule parameters of a module f refers to, or use "
            "executor='serial' (not threads: pyro's param store is one for all of them, and "
            "not safe to share)."
        )
    held = where_held(t, state.f)
    where = "" if held is None else f", held by the worker at {held}"
    return ForeignTensorError(
        f"{head}{where}): the worker's own copy of a module global, a tensor f cached "
        "on the worker, or a leaf f made and kept (an item made to require grad in place, "
        "x.requires_grad_(), whose .grad the loop fills in your process). Only tensors "
        "reachable from f and the items travel (cloudpickle pickles functions of importable "
        "modules by reference, so their globals are the worker's): pass the tensor as an "
        "attribute, closure or item, or register the module with "
        "cloudpickle.register_pickle_by_value; for a leaf of f's own (forces), make it from a "
        "copy (pos = x.clone().requires_grad_()) and let it go, or use executor='threads'."
    )


def _no_grads_written(state: _CallState, start: int) -> None:
    """Raise where ``f`` wrote the ``.grad`` of a tensor of the caller's that it holds (it ran
    ``.backward()`` itself): in the loop those gradients accumulate in the user's tensors; in
    another process, in the worker's leaves for them, which never reach the caller."""
    written = [t for t in state.own if t.grad is not None]
    if not written:
        return
    for t in written:
        t.grad = None  # (the leaves may serve later calls of a kept f)
    raise RuntimeError(
        f"{state.api}: f wrote .grad of a tensor of yours it uses (shape "
        f"{tuple(written[0].shape)}), in the chunk of elements from {start} (of "
        f"{state.spec.n}): it ran .backward() itself. A worker's .grad is its own and never "
        "reaches your process, so the gradients the loop accumulates would be lost. Return "
        "the loss and take the map's backward (gradmap.tsum(f, xs).backward()), or use "
        "executor='threads'."
    )


def _no_graph_results(results: list[Any], start: int, state: _CallState) -> None:
    """Raise where a map run with grad mode off got a result that requires grad (``f`` turned
    grad mode on itself, or returned a tensor of its own that requires grad): in the loop that
    result carries its graph, but no graph comes back from another process, so the gradients
    the loop gives through it would be lost without a word."""
    for j, y in enumerate(results):
        if type(y) is Tensor:
            if not y.requires_grad:
                continue
        elif not any(isinstance(t, Tensor) and t.requires_grad for t in flatten(y)[0]):
            continue
        raise RuntimeError(
            f"{state.api}: element {start + j} (of {state.spec.n}) returned a tensor that "
            "requires grad while the map ran with grad mode off (torch.no_grad or "
            "inference_mode; f turned grad mode on, or returned a tensor of its own that "
            "requires grad). Results come back from other processes without their graph, so "
            "the gradients the loop gives through it would be lost. Use executor='threads', "
            "or detach the results in f."
        )


def _plain_leaf_results(y: Any, state: _CallState, element: int) -> Any:
    """A result of a map without a graph, each leaf requiring grad made a [`LeafResult`][]
    (NOTE [leaves that come back from another process])."""
    if isinstance(y, Tensor):
        if not y.requires_grad:
            return y
        one = [y]
        leaf_results(one, state, element)
        return one[0]
    leaves, spec = flatten(y)
    _no_hidden_graph(leaves, state, element)
    if not any(isinstance(t, Tensor) and t.requires_grad for t in leaves):
        return y
    leaf_results(leaves, state, element)
    return unflatten(leaves, spec)


_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _no_hidden_graph(leaves: list[Any], state: _CallState, element: int) -> None:
    """Raise where a result's leaf is an object (no pytree gradmap reads: a class of the user's,
    a dataclass) holding a tensor that requires grad: in the loop the gradient flows through
    it; from another process it comes back without its graph, the gradient lost without a
    word."""
    for leaf in leaves:
        if isinstance(leaf, Tensor) or type(leaf) in _PLAIN:
            continue
        for t in tensors_in(leaf):
            if t.requires_grad:
                raise RuntimeError(
                    f"{state.api}: element {element} (of {state.spec.n}) returned an object of "
                    f"class {type(leaf).__name__} that holds a tensor requiring grad (shape "
                    f"{tuple(t.shape)}); gradmap reads no tensor inside such an object, and from "
                    "another process it comes back without its graph, so the gradient the loop "
                    "gives through it would be lost. Return the tensors in a tuple, list, dict "
                    "or namedtuple, or use executor='threads'."
                )


def _detached_all(tree: Any) -> Any:
    """``tree`` with every tensor that requires grad detached."""
    leaves, spec = flatten(tree)
    if not any(isinstance(t, Tensor) and t.requires_grad for t in leaves):
        return tree
    return unflatten(
        [t.detach() if isinstance(t, Tensor) and t.requires_grad else t for t in leaves], spec
    )


def _detached_results(record: Any, state: _CallState, start: int) -> tuple[list[Any], list[Any]]:
    """A chunk's results with their differentiable leaves detached, and those leaves' places;
    leaves that require grad, returned as they are, become [`LeafResult`][]s."""
    if record.results is not None:  # NOTE [a chunk of bare tensors]: no record per element
        if record.results is record.outputs:
            return [t.detach() for t in record.outputs], [_FIRST] * len(record.outputs)
        results = list(record.results)
        if any(t.requires_grad for t in results):
            leaf_results(results, state, start, each=True)
        return results, [()] * len(results)
    trees = []
    for e, el in enumerate(record.elements):
        leaves = list(el.leaves)
        for pos in el.diff:
            leaves[pos] = leaves[pos].detach()
        if len(el.diff) < len(leaves):
            _no_hidden_graph(leaves, state, start + e)
            leaf_results(leaves, state, start + e)
        trees.append(unflatten(leaves, el.spec))
    return trees, [el.diff for el in record.elements]


_FIRST = (0,)


def leaf_results(values: list[Any], state: _CallState, element: int, each: bool = False) -> None:
    """Replace, in place, each tensor among ``values`` (element ``element``'s result leaves; or,
    ``each``, a chunk of bare results from element ``element`` on) that is a leaf requiring
    grad by a [`LeafResult`][]:
    ``tmap`` hands it out as it is (NOTE [leaves returned as they are] in ``_torch/_chunk``),
    one of the caller's tensors as the caller's own object, a leaf ``f`` made as a fresh leaf
    in the caller's process.

    NOTE [leaves that come back from another process]:
        A leaf ``f`` returns is no join output: it has no graph to pull back. One of the
        caller's tensors (an item, a parameter) comes back as its pid and the caller hands out
        its original, as the loop returns that very object; a leaf ``f`` made comes back as its
        value and becomes a leaf of the caller's, whose ``.grad`` the user's backward fills (if
        another result of the element's graph reached it, the chunk's boundary holds it, and
        ``_pids`` refuses it: its gradient would stay in the worker). A tensor of the caller's
        that ``f`` changed in place (under ``no_grad``) is refused: the change stays in the
        worker's copy, where the loop changes the user's tensor.
    """
    seen: dict[int, LeafResult] = {}  # one object returned twice comes back as one
    for j, t in enumerate(values):
        if not (isinstance(t, Tensor) and t.requires_grad and t.is_leaf):
            continue
        marker = seen.get(id(t))
        if marker is None:
            pid = state.leaves.pid(t)
            if pid is not None and state.leaves.changed(pid):
                i = element + j if each else element
                raise RuntimeError(
                    f"{state.api}: f changed in place a tensor of yours that requires grad "
                    f"(shape {tuple(t.shape)}) and returned it, element {i} (of "
                    f"{state.spec.n}). In another process the change stays in the worker's "
                    "copy, where the loop changes your tensor. Return a new tensor (t.clone() "
                    "before changing it), or use executor='threads'."
                )
            marker = seen[id(t)] = LeafResult.of(t, pid)
        values[j] = marker


def _mask(pids: list[int], wanted: list[int] | None) -> list[bool] | None:
    """Which of a chunk's boundary entries (their ``pids``) the running backward needs."""
    if wanted is None:
        return None
    needed = set(wanted)
    return [pid in needed for pid in pids]


def _by_pid(pids: list[int], grads: list[Tensor | None] | None) -> list[tuple[int, Tensor]]:
    """The chunk's gradients summed per pid, in the order of first sight (deterministic)."""
    if grads is None:
        return []
    total: dict[int, Tensor] = {}
    for pid, g in zip(pids, grads):
        if g is None:
            continue
        previous = total.get(pid)
        total[pid] = g if previous is None else previous + g
    return list(total.items())
