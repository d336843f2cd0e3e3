"""The chunk record: one chunk's results, its boundary, and its pullback.

A record is made by [`run_forward`][] wherever the chunk runs (a pool thread, the caller's thread,
a Ray actor) and stays there until the backward: it holds the chunk's outputs (with their graph,
or detached under ``remat``), its boundary (NOTE [the boundary of a chunk] in ``_graph``), and
knows how to pull the chunk back -- through the stored graph, through a fresh recompute, or not
at all for a chunk whose cotangents are all missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from .._engine import alone
from .._errors import add_note, element_note
from .._items import Singles
from .._tree import Spec, flatten, unflatten
from ._graph import (
    BlockHooks,
    Boundary,
    Known,
    batched,
    find_boundary,
    pulling_back,
    reaches,
    sequence_nr,
)
from ._native import native
from ._random import DRAWS, MapRandom
from ._shared import Watch
from ._swaps import swaps_here

__all__ = [
    "ACCUMULATE",
    "DEFERRED",
    "ChunkRecord",
    "nonzero_stacked",
    "stack_small",
    "pull_back",
    "pull_back_kept",
    "pull_back_sum",
    "run_forward",
]

Tensor = torch.Tensor


_NONE: tuple[int, ...] = ()
_FIRST: tuple[int, ...] = (0,)
_TAKEN: Any = ()  # an element's leaves once handed out


class ElementResult:
    """One element's result: its leaves, and which of them are differentiable outputs.

    A bare tensor (most results) is kept as it is, without a list of one leaf: a map allocates
    as few tracked objects per element as it can, since each one brings the cyclic garbage
    collector's next pass closer (measured: ~10 us per element on ``f(x) = x * 2``).
    """

    __slots__ = ("_leaves", "_tree", "diff", "hi", "index", "lo", "spec")

    def __init__(
        self,
        index: int,
        tree: Any,
        leaves: list[Any] | None,
        spec: Spec,
        diff: Sequence[int],
        lo: int,
        hi: int,
    ) -> None:
        self.index = index
        self._tree = tree  # the result itself when it is a bare tensor
        self._leaves = leaves  # its leaves otherwise
        self.spec = spec
        self.diff = diff  # positions in ``leaves`` of the chunk outputs
        self.lo, self.hi = lo, hi  # their range in the chunk's ``outputs``

    @property
    def leaves(self) -> list[Any]:
        return [self._tree] if self._leaves is None else self._leaves

    @leaves.setter
    def leaves(self, leaves: list[Any]) -> None:
        self._tree, self._leaves = None, leaves

    def take(self) -> list[Any]:
        """The leaves, handed out: the record keeps none afterwards (an empty tuple, not a new
        list per element, which would be one more object for the collector to count)."""
        leaves = [self._tree] if self._leaves is None else self._leaves
        self._tree, self._leaves = None, _TAKEN
        return leaves

    @property
    def outputs(self) -> tuple[int, int]:
        return self.lo, self.hi


class ChunkRecord:
    """What a chunk's forward leaves for its backward.

    NOTE [a chunk of bare tensors]:
        Most maps return one tensor per element. A chunk whose every result is a bare tensor,
        all requiring grad (or, without a graph, none) is kept *compact*: ``results`` is the
        list of those tensors (with a graph, the same list as ``outputs``: element ``e``'s
        output is ``outputs[e]``) and no [`ElementResult`][] is made per element, nor a list of
        leaves: each object kept until the backward brings the cyclic collector's next pass --
        and, over a large map, its next pass over the whole heap -- closer (measured on
        ``f(x) = x * 2``: 4 objects kept per element cost 3 full collections in 5 calls of
        10,000 elements, ~80 ms each). The join and the pullbacks read a compact chunk as it
        is; ``elements`` makes the records on first use for the paths that want them (a
        recompute, naming a failing element, other processes). A result of any other kind
        turns the chunk general: records are made for the elements before it.
    """

    __slots__ = (
        "_elements",
        "boundary",
        "indices",
        "outputs",
        "results",
        "retained",
        "returned",
        "stored",
        "swapped",
        "views",
    )

    def __init__(self) -> None:
        self._elements: list[ElementResult] | None = []
        self.indices: list[int] = []  # the compact chunk's elements
        self.results: list[Tensor] | None = None  # a compact chunk's results; None: general
        self.outputs: list[Tensor] = []
        self.boundary: Boundary = Boundary()
        self.stored = False  # whether ``outputs`` still carry the chunk's graph
        #: ``f`` swapped a module's parameters in this chunk's forward (NOTE [parameters
        #: swapped by functional_call] in ``_swaps``).
        self.swapped = False
        #: The outputs handed out as views: views of tensors made before the chunk, and
        #: outputs that share memory (NOTE [results that view a tensor made before the map]);
        #: ``None``: none.
        self.views: list[int] | None = None
        #: The leaves requiring grad returned as they are (NOTE [leaves returned as they are]),
        #: by (element, position among the result's leaves); ``None``: none.
        self.returned: dict[tuple[int, int], Tensor] | None = None
        #: NOTE [results that retain their gradient] (``_map``) under ``remat``: the outputs
        #: ``f`` called ``retain_grad()`` on (noted before the graph is freed), then their
        #: gradients from the recomputes, by output.
        self.retained: list[int] | dict[int, Tensor | None] | None = None

    def note_retained(self) -> None:
        """Before a ``remat`` forward frees the graph: which outputs retain their gradient."""
        kept = [o for o, t in enumerate(self.outputs) if t.retains_grad]
        if kept:
            self.retained = kept

    def returned_leaf(self, i: int, position: int, leaf: Tensor) -> None:
        if self.returned is None:
            self.returned = {}
        self.returned[i, position] = leaf

    @property
    def elements(self) -> list[ElementResult]:
        """One record per element (made on first use for a compact chunk)."""
        els = self._elements
        if els is None:
            results = self.results
            assert results is not None
            if results is self.outputs:
                els = [
                    ElementResult(i, y, None, None, _FIRST, e, e + 1)
                    for e, (i, y) in enumerate(zip(self.indices, results))
                ]
            else:
                els = [
                    ElementResult(i, y, None, None, _NONE, 0, 0)
                    for i, y in zip(self.indices, results)
                ]
            self._elements = els
        return els

    def count(self) -> int:
        """The number of elements."""
        return len(self.indices) if self.results is not None else len(self.elements)

    def first_index(self) -> int:
        return self.indices[0] if self.results is not None else self.elements[0].index

    def last_index(self) -> int:
        return self.indices[-1] if self.results is not None else self.elements[-1].index

    def plain_results(self) -> list[Any]:
        """Every element's result, as ``f`` returned it (a chunk run without a graph)."""
        if self.results is not None:
            return self.results
        return [unflatten(el.leaves, el.spec) for el in self.elements]

    def drop_graph(self) -> None:
        """Keep the results, free the graph (the outputs and the elements' leaves held it)."""
        if self.stored:
            self.outputs = outputs = [t.detach() for t in self.outputs]
            if self.results is not None:
                self.results = outputs
            for el in self._elements or ():
                if el._leaves is None:
                    if el.hi > el.lo:
                        el._tree = outputs[el.lo]
                elif el._leaves:  # (empty once the join handed the results out)
                    for o, pos in zip(range(el.lo, el.hi), el.diff):
                        el._leaves[pos] = outputs[o]
            self.stored = False


def run_forward(
    f: Callable[..., Any],
    elements: Sequence[tuple[Any, ...]],
    indices: Sequence[int],
    *,
    known: Known | None,
    random: MapRandom | None,
    stop: Callable[[], bool] | None = None,
    api: str = "gradmap.tmap",
    leaf_results: bool = False,
    watch: Watch | None = None,
) -> ChunkRecord:
    """Run ``f`` on ``elements[i] for i in indices``, untouched; read the chunk's boundary off its
    graph when grad mode is on (``known`` given).

    Arguments:
        f: the function.
        elements: every element's arguments.
        indices: the elements of this chunk, in order.
        known: the tensors made before the call that the map sees; ``None`` without a graph.
        random: seed the global generator per element (a forward in one thread), or ``None``.
        stop: returns true when the chunk should stop before its next element.
        api: the name errors give.
        leaf_results: leaves are returned as they are (``tmap`` on threads).
        watch: watches each element for writes to process-wide state (NOTE [process-wide state
            f writes] in ``_shared``), or ``None``.

    NOTE [leaves returned as they are]:
        A result of ``tmap`` that is a leaf requiring grad -- ``f`` returned its item, a
        parameter, or a tensor it made with ``requires_grad=True`` -- is handed out as it is,
        the same object as in the loop, not as an output of the join: it has no graph to pull
        back, and its ``.grad`` is the user's to read (through the join, the user held an alias
        that is no leaf, and the gradient went to a tensor no one could reach). ``tsum`` adds
        its results, so a leaf among them reaches the sum's graph as any other result.
    """
    if random is not None:  # the forward in one thread: NOTE [random numbers of recomputes]
        with DRAWS, alone():
            return _run_forward(f, elements, indices, known, random, stop, api, leaf_results, watch)
    return _run_forward(f, elements, indices, known, random, stop, api, leaf_results, watch)


def _run_forward(
    f: Callable[..., Any],
    elements: Sequence[tuple[Any, ...]],
    indices: Sequence[int],
    known: Known | None,
    random: MapRandom | None,
    stop: Callable[[], bool] | None,
    api: str,
    leaf_results: bool,
    watch: Watch | None,
) -> ChunkRecord:
    record = ChunkRecord()
    swaps = swaps_here()
    grad_mode = torch.is_grad_enabled()
    outputs = record.outputs
    # NOTE [a chunk of bare tensors]: compact while every result is a tensor that requires grad
    # as the first one did; ``elements`` is ``None`` meanwhile.
    compact: list[Tensor] | None = None
    elements_out = record._elements
    n = len(elements)
    # A map over one iterable: f takes its items as they are (no tuple per element).
    singles = elements.items if type(elements) is Singles else None
    lo = sequence_nr()
    last = None
    for i in indices:
        if stop is not None and stop():
            break
        if random is not None and random.each:
            random.element(i)  # NOTE [random numbers per element]
            last = i
        try:
            if watch is None:
                y = f(*elements[i]) if singles is None else f(singles[i])
            else:
                with watch.watching():
                    y = f(*elements[i]) if singles is None else f(singles[i])
        except BaseException as exc:
            add_note(exc, element_note(i, n, "forward", api))
            raise
        if _grad_enabled() is not grad_mode:
            _left_grad_mode(grad_mode, i, n, api)
        if compact is not None:
            if isinstance(y, Tensor) and (y.requires_grad and not (leaf_results and y.is_leaf)) is (
                compact is outputs
            ):
                compact.append(y)
                record.indices.append(i)
                if compact is not outputs and y.requires_grad:  # a leaf, returned as it is
                    record.returned_leaf(i, 0, y)
                continue
            elements_out = record.elements  # records for the elements before this one
            record.results = compact = None
        elif not elements_out and isinstance(y, Tensor):  # the first element: a bare tensor
            diff_y = y.requires_grad and not (leaf_results and y.is_leaf)
            compact = outputs if diff_y else []
            compact.append(y)
            record.indices.append(i)
            record.results = compact
            record._elements = elements_out = None
            if not diff_y and y.requires_grad:
                record.returned_leaf(i, 0, y)
            continue
        assert elements_out is not None
        start = len(outputs)
        if isinstance(y, Tensor):
            if y.requires_grad and not (leaf_results and y.is_leaf):
                outputs.append(y)
                elements_out.append(ElementResult(i, y, None, None, _FIRST, start, start + 1))
            else:
                elements_out.append(ElementResult(i, y, None, None, _NONE, start, start))
                if y.requires_grad:
                    record.returned_leaf(i, 0, y)
            continue
        leaves, spec = flatten(y)
        diff = []
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                if leaf_results and leaf.is_leaf:
                    record.returned_leaf(i, j, leaf)
                else:
                    outputs.append(leaf)
                    diff.append(j)
        elements_out.append(ElementResult(i, None, leaves, spec, diff, start, len(outputs)))
    if random is not None and last is not None:
        random.check_chunk(last)
    record.swapped = swaps_here() != swaps
    if known is not None and outputs:
        hi = sequence_nr()
        record.boundary = find_boundary(outputs, lo, hi, known)
        record.views = _handed_out_as_views(outputs, lo, hi)
        record.stored = True
    return record


_grad_enabled = torch.is_grad_enabled


def _left_grad_mode(mode: bool, i: int, n: int, api: str) -> NoReturn:
    """Raise for an ``f`` that left grad mode changed (``torch.set_grad_enabled(False)``
    without setting it back), after setting it back in this thread.

    NOTE [grad mode left changed by f]:
        In the loop such an ``f`` turns the mode off for every element after it and for the
        caller, whose ``backward()`` then raises (its loss has no graph). On threads it stayed
        in the chunk's thread only: the rest of that chunk ran without a graph, the caller's
        mode stayed on, and ``tsum(...).backward()`` gave the gradient of the chunks' first
        elements alone, with no error (a helper's case); on a user's pool the mode stayed in
        its threads after the map. The mode is read after every element (one call into C,
        which does not let the GIL go)."""
    torch.set_grad_enabled(mode)
    raise RuntimeError(
        f"{api}: f left grad mode {'off' if mode else 'on'} (torch.set_grad_enabled("
        f"{not mode}) without setting it back) in element {i} (of {n}): in the loop that "
        "changes it for every element after it and for the caller. Use a block that restores "
        f"it (with torch.{'no_grad' if mode else 'enable_grad'}(): ...) inside f."
    )


def _handed_out_as_views(outputs: list[Tensor], lo: int, hi: int) -> list[int] | None:
    """The positions of the outputs that are views of a tensor made before the chunk (a leaf,
    or a tensor whose node is numbered outside the chunk's range ``lo..hi-1``), and of the
    outputs that share memory as views of one tensor (or as a tensor and its view).

    NOTE [results that view a tensor made before the map]:
        ``f`` may return a view of its item or of a tensor it reads (``x[0]``, ``y.view(-1)``).
        The join hands out a detached alias of each result, which shares its storage and
        version counter; were it a plain tensor, an in-place change to it (or to the viewed
        tensor) after the map would regenerate the chunk result's node from the viewed
        tensor's, past the boundary the chunk is pulled back to, and the gradient would be lost
        without a word (the loop's gradient; or, for a view of a leaf, the leaf's values
        changed where the loop raises). Such results are handed out as views, which PyTorch
        forbids to change in place as the outputs of a custom Function: an error at the change,
        naming it. Views of the chunk's own tensors stay plain aliases: their regenerated node
        stays inside the chunk. (A node made in another thread can be numbered inside the range:
        then the result is taken for the chunk's own, as before.)

        Except where two results share memory: ``f`` returns ``y[:2], y[1:]`` (or ``y`` and
        ``y[0]``). In the loop they are views of one tensor, and an in-place change to one
        reaches the other's graph; the join's aliases share the memory but not the view, so
        the other result's values changed while its gradient did not (silently wrong). They
        are handed out as views too: the change raises, and ``clone()`` is the fix.
    """
    if not any(map(Tensor._is_view, outputs)):
        return None  # (the common case, in one pass without a Python frame per output)
    flagged: set[int] = set()
    by_base: dict[int, list[int]] = {}
    for i, t in enumerate(outputs):
        if t._is_view():
            base = t._base
            node = None if base is None else base.grad_fn
            if node is None or not lo <= node._sequence_nr() < hi:
                flagged.add(i)
            else:
                by_base.setdefault(id(base), []).append(i)
    if by_base:
        position = {id(t): i for i, t in enumerate(outputs)}
        for key, group in by_base.items():
            if len(group) > 1 or key in position:
                flagged.update(group)
                if key in position:
                    flagged.add(position[key])
    return sorted(flagged) or None


#: What ``pull_back`` returns for a chunk that can only be pulled back as a plain ``backward()``
#: (NOTE [reentrant checkpoint] in ``_map``).
ACCUMULATE: Any = "gradmap.accumulate"
#: What ``pull_back_sum`` returns for a chunk whose early pullback failed.
DEFERRED: Any = "gradmap.deferred"
_REENTRANT_CHECKPOINT = "use_reentrant=True, torch.utils.checkpoint is incompatible"
#: What a backward compiled by ``torch.compile`` raises when it runs with ``retain_graph=True``
#: and frees its saved tensors as it goes (AOTAutograd's donated buffers).
_DONATED_BUFFERS = "donated buffer"


def _nonzero(g: Tensor) -> bool:
    if g.requires_grad or g.layout != torch.strided or g.is_meta:
        # A zero cotangent that requires grad still carries a second-order term; a meta
        # tensor has no values to look at (pulled back as the loop does, shapes only).
        return True
    return bool(g.any())


#: The largest cotangent (in elements) that ``_nonzero_all`` checks in one stack with the others.
_STACKED_MAX = 256


def stack_small(cotangents: Sequence[Tensor | None]) -> Tensor | None:
    """The common case of a map's cotangents -- small ones of one shape, dtype and device (a
    map's losses, a stacked result's rows) -- in one stack, read without each one's attributes;
    ``None`` for any other. (Large ones are not copied into one buffer: each one's own check is
    cheap beside it.) A stack that requires grad (a ``create_graph`` backward differentiates
    through its cotangents) is ``None`` too."""
    first = cotangents[0] if cotangents else None
    if len(cotangents) >= 4 and first is not None and first.numel() <= _STACKED_MAX:
        try:
            stacked = torch.stack(cotangents)  # type: ignore[arg-type]
        except (TypeError, RuntimeError):
            return None  # a None, or shapes, devices or layouts that differ
        if (
            stacked.layout == torch.strided
            and stacked.device.type == "cpu"
            and not stacked.requires_grad
        ):
            return stacked
    return None


def nonzero_stacked(
    cotangents: Sequence[Tensor | None], stacked: Tensor | None = None
) -> list[bool] | None:
    """Whether each cotangent is nonzero, from their ``stack_small`` (``stacked``, if taken
    already); ``None`` where they do not stack."""
    if stacked is None:
        stacked = stack_small(cotangents)
    if stacked is None:
        return None
    flags: list[bool] = stacked.reshape(len(cotangents), -1).ne(0).any(1).tolist()
    return flags


def _nonzero_all(cotangents: Sequence[Tensor | None]) -> list[bool]:
    """Whether each cotangent is nonzero: small ones of one shape, dtype and device in one
    stack, else the 0-d ones (the losses of a map) in one stack and the rest one by one;
    batched cotangents (a backward under vmap) all count as nonzero."""
    if batched(cotangents):
        return [g is not None for g in cotangents]
    flags = nonzero_stacked(cotangents)
    if flags is not None:
        return flags
    scalar = [
        g is not None
        and g.dim() == 0
        and not g.requires_grad
        and g.layout == torch.strided
        and g.device.type == "cpu"
        for g in cotangents
    ]
    scalars = [g for g, s in zip(cotangents, scalar) if s]
    if len(scalars) < 4 or len({g.dtype for g in scalars}) > 1:  # type: ignore[union-attr]
        return [g is not None and _nonzero(g) for g in cotangents]
    scalar_flags = iter(torch.stack(scalars).ne(0).tolist())  # type: ignore[arg-type]
    return [
        next(scalar_flags) if s else (g is not None and _nonzero(g))
        for g, s in zip(cotangents, scalar)
    ]


def pull_back(
    record: ChunkRecord,
    cotangents: Sequence[Tensor | None],
    *,
    n: int,
    owner: object,
    recompute: Callable[[list[int], bool], ChunkRecord] | None = None,
    create_graph: bool = False,
    free_graph: bool = False,
    rerun: Callable[[list[int], bool], ChunkRecord] | None = None,
    wanted: Sequence[bool] | None = None,
    nonzero: Sequence[bool] | None = None,
    api: str = "gradmap.tmap",
    made_before: Callable[[Tensor], bool] | None = None,
) -> list[Tensor | None] | None:
    """The chunk's gradients for its boundary entries, given a cotangent per output.

    ``free_graph``: the stored graph is not needed again. The pullback keeps it all the same,
    for whoever drops the record to free (NOTE [pullbacks keep their graph]); only a backward
    compiled by ``torch.compile`` that donates its saved tensors, which refuses to run with the
    graph kept, is pulled back again freeing it as it goes (not when the pullback reaches past
    the boundary: the Python walk's non-leaf boundary nodes, whose graph the caller's backward
    still runs). A failing pullback that freed its graph names its element by recomputing the
    elements one by one with ``rerun``.

    NOTE [pullbacks keep their graph]:
        Freeing a graph takes the GIL for every saved tensor that has a Python object (the
        intermediate results ``f``'s Python code held), so two pool threads freeing their
        chunks' graphs as they pull back trade the GIL at every such tensor while the engine
        runs. Kept, the graphs are freed by the caller once the map's backward is done (the
        join drops its records), in one thread. Measured (ragged bags, 256 elements in 64
        chunks, 2 pool threads, 2 cores; medians of 10, load 0.3-0.6): the backward 54.6 ->
        41.9 ms with the graphs kept, against 58-66 ms for the 1-thread loop's; the same
        pullbacks without gradmap, 57.0 ms freeing, 41.3 ms keeping (+2.4 ms to drop the graphs
        after). The peak memory stays: the whole graph exists when a backward starts, and the
        pullbacks add only the chunks' gradients (``gradmap bench --memory``, ragged bags of
        1,024 elements: 107.9 MiB freeing, 107.5 MiB keeping; the loop 103-104 MiB).

    Elements whose cotangents are all missing do no work; outputs whose cotangents are zero do no
    work either, and the boundary entries they reach get zeros where nothing else reaches them,
    as the loop would give. ``recompute`` (for ``remat`` and ``create_graph``) runs the live
    elements' forward again and pulls back through that fresh graph instead of the stored one;
    there zero cotangents are pulled back as any other (no stored graph tells what they reach).
    ``wanted``: which boundary entries the running backward needs (``None``: all); the others
    get ``None``, and an element that reaches none of them does no work. ``nonzero``: whether
    each cotangent is nonzero, where the caller found it for every chunk at once
    (``nonzero_stacked``); ``None``: the pullback looks. ``made_before``: whether a leaf that a
    recompute reaches and the forward did not existed before the call (``_made_anew``).

    Returns:
        One gradient (or ``None``) per boundary entry; ``None`` if no cotangent reached the chunk.
    """
    entries = len(record.boundary.keys)
    if wanted is not None and (all(wanted) or len(wanted) != entries):
        wanted = None
    if wanted is not None and not any(wanted):
        return None
    live: list[int] = []  # positions in record.elements
    zeros: list[Tensor] = []  # outputs reached by zero cotangents, not pulled back
    outs: list[Tensor] = []
    grads: list[Tensor] = []
    if recompute is not None or record.boundary.user:
        # (NOTE [chunks whose backward is user code] in ``_graph``: zeros pulled back too)
        nonzero = [True] * len(cotangents)
    elif nonzero is None:
        nonzero = _nonzero_all(cotangents)
    if record.results is not None:  # NOTE [a chunk of bare tensors]: output e is element e's
        for e, (t, g) in enumerate(zip(record.outputs, cotangents)):
            if g is not None:
                if nonzero[e]:
                    live.append(e)
                    outs.append(t)
                    grads.append(g if type(g) is Tensor else _tied(g, t))
                else:
                    zeros.append(t)
    else:
        for e, el in enumerate(record.elements):
            had = False
            for o in range(*el.outputs):
                g = cotangents[o]
                if g is not None:
                    if nonzero[o]:
                        had = True
                        t = record.outputs[o]
                        outs.append(t)
                        grads.append(g if type(g) is Tensor else _tied(g, t))
                    else:
                        zeros.append(record.outputs[o])
            if had:
                live.append(e)
    if not live and not zeros:
        return None
    result: list[Tensor | None]
    if not live:
        result = [None] * entries
    elif recompute is not None:
        result = _pull_back_fresh(
            record, cotangents, live, recompute, n, create_graph, api, owner, wanted, made_before
        )
    else:
        inputs = _wanted(record.boundary.inputs, wanted)
        one: Callable[[int], object] | None = lambda e: _pull_back_one(  # noqa: E731
            record, e, cotangents, inputs, owner
        )
        retain = True  # NOTE [pullbacks keep their graph]
        try:
            try:
                got = _grad(outs, inputs, grads, create_graph=False, owner=owner)
            except RuntimeError as exc:
                if not (free_graph and _DONATED_BUFFERS in str(exc)) or record.boundary.nodes:
                    raise
                retain = False  # a compiled backward that donates its saved tensors
                one = (
                    None
                    if rerun is None
                    else lambda e: _pull_back_fresh(
                        record, cotangents, [e], rerun, n, False, api, owner, wanted, made_before
                    )
                )
                got = _grad(outs, inputs, grads, create_graph=False, owner=owner, retain=False)
        except Exception as exc:
            if isinstance(exc, RuntimeError) and _REENTRANT_CHECKPOINT in str(exc):
                if not retain:
                    record.drop_graph()  # partly freed
                return ACCUMULATE
            _name_failing_element(exc, record, live, n, api, one)
            raise
        result = _unwanted(got, wanted)
    if zeros and any(g is None for g in result):
        for k, hit in enumerate(reaches(zeros, record.boundary)):
            if hit and result[k] is None and (wanted is None or wanted[k]):
                result[k] = torch.zeros_like(record.boundary.tensors[k])
    return result


def _wanted(inputs: list[Any], wanted: Sequence[bool] | None) -> list[Any]:
    return inputs if wanted is None else [t for t, w in zip(inputs, wanted) if w]


def _unwanted(got: list[Tensor | None], wanted: Sequence[bool] | None) -> list[Tensor | None]:
    """Gradients for the wanted entries, spread back over every entry (``None`` elsewhere)."""
    if wanted is None:
        return got
    each = iter(got)
    return [next(each) if w else None for w in wanted]


def pull_back_sum(
    record: ChunkRecord,
    *,
    n: int,
    owner: object,
    api: str = "gradmap.tmap",
) -> list[Tensor | None] | None:
    """The gradients of the sum of a chunk whose outputs are 0-d (its losses), with cotangent
    one, through the stored graph, which it keeps (whoever drops the record frees it: NOTE [a
    tensor one chunk made and another read]): one root (the stacked sum) instead of one per
    element, which costs the engine less and holds the GIL for less Python.

    NOTE [a tensor one chunk made and another read]:
        ``f`` may fill a cache as it runs: the first element to need ``W = w @ w`` (or a
        weight under ``torch.nn.utils.parametrize.cached()``) computes and keeps it, and the
        elements after read it. In the loop, ``W``'s node then runs once in the backward, with
        every element's share. Here ``W``'s node belongs to the chunk that made it, and a chunk
        that read it on another thread (or later in the same one) has it past its boundary, a
        gated edge (NOTE [the native walk]): the share of that chunk reaches ``W``'s node
        through the join, in the caller's backward, after the maker's pullback ran the node
        with its own share. So a pullback that frees its graph as it goes freed ``W``'s saved
        tensors before the other share came, and the backward failed ("Trying to backward
        through the graph a second time"; ``tsum`` on threads, whose chunks were pulled back
        during the forward). A pullback keeps its graph instead; dropping the chunk's record
        then frees the nodes no other chunk's graph holds, and ``W``'s node lives on with what
        it saved until the other shares are through it. The gradients are the loop's, summed in
        another order.

    Returns:
        The gradients; or ``DEFERRED`` if the pullback failed: the graph is dropped, and the
        backward recomputes the chunk, raising there (as the loop would) with a note naming the
        element; or ``ACCUMULATE`` (NOTE [reentrant checkpoint]).
    """
    outs = record.outputs
    if len(outs) > 1 and len({(t.dtype, t.device) for t in outs}) == 1:
        with torch.enable_grad():
            roots = [torch.stack(outs).sum()]
    else:
        roots = outs
    # The Python walk's non-leaf boundary nodes are blocked here too (the map's own hooks come
    # only with its join, after the forward): NOTE [nothing past the boundary].
    hooks = BlockHooks(record.boundary.nodes, owner) if record.boundary.nodes else None
    ones = [torch.ones_like(t) for t in roots]
    try:
        try:
            return _grad(roots, record.boundary.inputs, ones, create_graph=False, owner=owner)
        except RuntimeError as exc:
            if _DONATED_BUFFERS not in str(exc) or record.boundary.nodes:
                raise
            # A compiled backward that donates its saved tensors (NOTE [pullbacks keep their
            # graph]): the graph is still whole; pulled back again, freeing it.
            return _grad(
                roots, record.boundary.inputs, ones, create_graph=False, owner=owner, retain=False
            )
    except Exception as exc:
        record.drop_graph()  # partly freed
        if isinstance(exc, RuntimeError) and _REENTRANT_CHECKPOINT in str(exc):
            return ACCUMULATE  # type: ignore[no-any-return]
        return DEFERRED  # type: ignore[no-any-return]
    finally:
        if hooks is not None:
            hooks.remove()


def pull_back_kept(record: ChunkRecord, *, owner: object) -> list[Tensor | None] | None:
    """The gradients of a chunk of losses (0-d outputs) with cotangent one, its graph kept for
    a backward with other cotangents (NOTE [tmap's losses pulled back early] in
    ``_early``); ``None`` where that is not done here: the backward then pulls the chunk
    back as ever, and raises there what the loop's backward would (a failure here leaves the
    retained graph whole).

    One root, the stacked sum of the losses, as ``pull_back_sum`` takes: each loss gets
    cotangent one all the same, and the engine runs the chunk's nodes in the order it would from
    the losses themselves -- the bits of ``pull_back`` with ones, which the tests check -- with
    less work in the engine and less Python under the GIL."""
    outs = record.outputs
    if native() is None or record.boundary.nodes or not outs:
        # The Python walk: it does not see hooks on tensors f made (NOTE [chunks whose backward
        # is user code]), which would run now, with cotangent one; and its non-leaf boundary is
        # blocked only once the join exists.
        return None
    try:
        if len(outs) > 1 and len({(t.dtype, t.device) for t in outs}) == 1:
            with torch.enable_grad():
                roots = [torch.stack(outs).sum()]
        else:
            roots = list(outs)
        ones = [torch.ones_like(t) for t in roots]
        return _grad(roots, record.boundary.inputs, ones, create_graph=False, owner=owner)
    except Exception:
        return None


def _grad(
    outputs: list[Tensor],
    inputs: list[Any],
    grads: list[Tensor],
    *,
    create_graph: bool,
    owner: object,
    retain: bool = True,
) -> list[Tensor | None]:
    if not inputs:
        return []
    with pulling_back(owner):
        if _RUN_BACKWARD is not None and _plain(outputs, grads, inputs):
            # NOTE [the engine called directly]: torch.autograd.grad checks each output and its
            # cotangent in Python (_make_grads: a shape comparison, dtype and layout checks per
            # output), about a microsecond per output, which a map of tiny elements pays per
            # element. Here every output, cotangent and input is a plain tensor (or a
            # GradientEdge), each cotangent came from the engine itself (the join's backward) or
            # was made by gradmap with its output's shape, and the engine validates the roots'
            # cotangents against their edges (shape, dtype, device) as it starts; so the engine
            # is called as autograd.grad calls it. Subclasses and anything else take
            # autograd.grad (its __torch_function__ dispatch).
            return list(
                _RUN_BACKWARD(
                    tuple(outputs),
                    tuple(grads),
                    retain,
                    create_graph,
                    tuple(inputs),
                    True,
                    accumulate_grad=False,
                )
            )
        return list(
            torch.autograd.grad(
                outputs,
                inputs,
                grads,
                retain_graph=retain,
                create_graph=create_graph,
                allow_unused=True,
            )
        )


def _plain(outputs: list[Tensor], grads: list[Tensor], inputs: list[Any]) -> bool:
    """Whether ``autograd.grad`` would do nothing but call the engine (no tensor subclass, no
    ``__torch_function__``, no cotangent it would have to make or check)."""
    if len(outputs) != len(grads):
        return False
    tensor = torch.Tensor
    for t in outputs:
        if type(t) is not tensor:
            return False
    for g in grads:
        if type(g) is not tensor or g.is_nested:
            return False
    kinds = (tensor, torch.nn.Parameter, _GRADIENT_EDGE)
    return all(type(t) in kinds for t in inputs)


_GRADIENT_EDGE: Any = getattr(torch.autograd.graph, "GradientEdge", None)
#: The engine call of ``autograd.grad``; ``None`` (autograd.grad throughout) where torch lacks it.
_RUN_BACKWARD: Any = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _pull_back_one(
    record: ChunkRecord,
    e: int,
    cotangents: Sequence[Tensor | None],
    inputs: list[Any],
    owner: object,
) -> None:
    el = record.elements[e]
    pairs = [(record.outputs[o], cotangents[o]) for o in range(*el.outputs)]
    pairs = [(t, g) for t, g in pairs if g is not None]
    outs = [t for t, _ in pairs]
    grads: list[Tensor] = [_tied(g, t) for t, g in pairs if g is not None]
    _grad(outs, inputs, grads, create_graph=False, owner=owner)


def _pull_back_fresh(
    record: ChunkRecord,
    cotangents: Sequence[Tensor | None],
    live: list[int],
    recompute: Callable[[list[int], bool], ChunkRecord],
    n: int,
    create_graph: bool,
    api: str,
    owner: object,
    wanted: Sequence[bool] | None = None,
    made_before: Callable[[Tensor], bool] | None = None,
) -> list[Tensor | None]:
    """Recompute the live elements (with a graph) and pull back through the fresh graph, mapping
    its boundary onto the stored record's (``wanted`` entries only)."""

    def differs(fresh: ChunkRecord, which: list[int]) -> str | None:
        """``None`` if the recompute gave the forward's results; else where it did not."""
        if len(fresh.elements) != len(which):
            return f" Here it gave {len(fresh.elements)} elements for {len(which)}."
        for e, new in zip(which, fresh.elements):
            el = record.elements[e]
            if new.outputs[1] - new.outputs[0] != el.outputs[1] - el.outputs[0]:
                return (
                    f" Here element {el.index} (of {n}) gave {new.outputs[1] - new.outputs[0]} "
                    f"differentiable result leaves, against {el.outputs[1] - el.outputs[0]} in "
                    "its forward."
                )
            for o, o_new in zip(range(*el.outputs), range(*new.outputs)):
                a, b = fresh.outputs[o_new], record.outputs[o]
                if a._version != b._version:
                    continue  # the user changed the result in place since: not comparable
                if not _equal_values(a.detach(), b.detach()):
                    leaf = el.diff[o - el.outputs[0]]
                    where = _difference(a.detach(), b.detach())
                    return f" Here element {el.index} (of {n}), its result's leaf {leaf}: {where}"
        return None

    def run(which: list[int]) -> list[Tensor | None]:
        indices = [record.elements[e].index for e in which]
        fresh = recompute(indices, False)
        if differs(fresh, which) is not None:
            fresh = recompute(indices, True)  # f drew random numbers after all: replay them
            detail = differs(fresh, which)
            if detail is not None:
                _not_deterministic(api, detail + _OTHER_VALUES)
        outs: list[Tensor] = []
        grads: list[Tensor] = []
        for e, new in zip(which, fresh.elements):
            el = record.elements[e]
            for o, o_new in zip(range(*el.outputs), range(*new.outputs)):
                g = cotangents[o]
                if g is not None:
                    t = fresh.outputs[o_new]
                    outs.append(t)
                    grads.append(_tied(g, t))
        where = {key: k for k, key in enumerate(record.boundary.keys)}
        result: list[Tensor | None] = [None] * len(record.boundary.keys)
        places: list[int | None] = []
        for key, t in zip(fresh.boundary.keys, fresh.boundary.tensors):
            k = where.get(key)
            if k is None:
                k = _made_anew(t, fresh, record, api, made_before)
            places.append(k)
        mask: list[bool] | None = None
        if wanted is not None or None in places:
            mask = [k is not None and (wanted is None or wanted[k]) for k in places]
            if not any(mask):
                return result
        # The fresh graph is freed as it goes, unless a graph is being made or the pullback
        # reaches past the boundary (the Python walk's non-leaf boundary nodes).
        got = _grad(
            outs,
            _wanted(fresh.boundary.inputs, mask),
            grads,
            create_graph=create_graph,
            owner=owner,
            retain=create_graph or bool(fresh.boundary.nodes),
        )
        if record.retained is not None:  # NOTE [results that retain their gradient] (``_map``)
            _retained_grads(record, fresh, which)
        for k, g in zip(_wanted(places, mask), got):
            assert k is not None
            result[k] = g
        return result

    try:
        return run(live)
    except RuntimeError as exc:
        if _REENTRANT_CHECKPOINT in str(exc) and not create_graph:
            return ACCUMULATE  # type: ignore[no-any-return]
        _name_failing_element(exc, record, live, n, api, lambda e: run([e]))
        raise
    except Exception as exc:
        _name_failing_element(exc, record, live, n, api, lambda e: run([e]))
        raise


def _retained_grads(record: ChunkRecord, fresh: ChunkRecord, which: list[int]) -> None:
    """Add the gradients of the recomputed outputs that retain theirs to ``record.retained``."""
    places = record.retained
    noted = places if isinstance(places, dict) else dict.fromkeys(places or ())
    for e, new in zip(which, fresh.elements):
        el = record.elements[e]
        for o, o_new in zip(range(*el.outputs), range(*new.outputs)):
            g = fresh.outputs[o_new].grad if o in noted else None
            if g is not None:
                before = noted[o]
                noted[o] = g.detach() if before is None else before + g.detach()
    record.retained = noted


def _made_anew(
    t: Tensor,
    fresh: ChunkRecord,
    record: ChunkRecord,
    api: str,
    made_before: Callable[[Tensor], bool] | None,
) -> int | None:
    """Where the stored record's boundary has the leaf ``t`` that a recompute (``fresh``) made
    anew, one of ``f``'s own (``p = x.clone().requires_grad_()`` for forces): the stored one
    ``f`` returned at the same place, if it did (the user holds it, and its ``.grad`` must be
    the loop's); ``None`` if ``f`` kept it to itself (its gradient reaches no one: not pulled
    back to). Any other tensor the recompute reaches and the forward did not: an error -- a
    leaf that existed before the call (``made_before``) among them: the forward reached it
    through a tensor computed from it, which is gone or other now, and its gradient would be
    lost."""
    if not (t.is_leaf and t.requires_grad):
        _not_deterministic(
            api,
            f" Here the recompute reached a tensor its forward did not (shape {tuple(t.shape)}): "
            "one made by ops f runs on threads of its own (a pool inside f; their nodes are not "
            "the element's, and a recompute makes new ones) -- run those in f's own thread, or "
            "use remat=False and no create_graph -- or one f reads that is another now.",
        )
    for place, leaf in (fresh.returned or {}).items():
        if leaf is t:
            before = (record.returned or {}).get(place)
            if before is None:
                _not_deterministic(api)
            for k, b in enumerate(record.boundary.tensors):
                if b is before:
                    return k
            _not_deterministic(api)
    if made_before is not None and made_before(t):
        raise RuntimeError(
            f"{api}: recomputing f (remat=True, or a create_graph=True backward) reached a "
            f"tensor made before the call (shape {tuple(t.shape)}) that its forward reached "
            "only through a tensor computed from it, which f no longer reads: a cache (filled "
            "before the map or by f for another element) emptied or changed before the "
            "backward, such as torch.nn.utils.parametrize.cached() or a global set to w * 2. "
            "Its gradient "
            "would be lost. Keep what f reads as it was until the backward is done (run the "
            "backward inside the cache's block), or use remat=False and no create_graph."
        )
    return None


def _tied(g: Tensor, t: Tensor) -> Tensor:
    """Cotangent ``g`` of output ``t``, on ``t``'s ragged structure when both are jagged.

    NOTE [jagged results' nested ints]:
        A jagged nested tensor's ragged size is a nested int (``j1``) bound to its offsets
        tensor object, and the engine refuses a cotangent whose shape names another one. The
        cotangent of a result is shaped like the tensor the user holds, and that is not always
        the tensor pulled back: a recompute (``remat``, ``create_graph``) makes new offsets,
        and on processes the result and its cotangent each cross a pickle, whose offsets are
        new ones. The values are the same (the recompute checks them, offsets included:
        ``_equal_values``), so the cotangent's values are put on ``t``'s offsets; a cotangent
        whose offsets hold other values is left alone (the engine names the mismatch).
    """
    a: Any = g  # (NestedTensor's methods)
    b: Any = t
    if (
        a.layout != torch.jagged
        or b.layout != torch.jagged
        or a.shape == b.shape
        or a.dim() != b.dim()
        or a._ragged_idx != b._ragged_idx
        or a.lengths() is not None
        or b.lengths() is not None
        or not _same_parts(a.offsets(), b.offsets())
    ):
        return g
    return torch.nested.nested_tensor_from_jagged(a.values(), b.offsets(), jagged_dim=b._ragged_idx)


def _equal_values(a: Tensor, b: Tensor) -> bool:
    """Whether two results of one element hold the same values (NaN equal to NaN), whatever
    their layout (sparse results compared dense: ``torch.equal`` takes strided tensors only;
    jagged ones by their offsets and values: their ragged sizes are new nested ints, NOTE
    [jagged results' nested ints])."""
    if a.layout == torch.jagged and b.layout == torch.jagged:
        return _equal_jagged(a, b)
    if a.shape != b.shape or a.layout != b.layout or a.dtype != b.dtype:
        return False
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    return torch.equal(a.nan_to_num(), b.nan_to_num())


def _equal_jagged(a: Any, b: Any) -> bool:
    return (
        a.dtype == b.dtype
        and a.dim() == b.dim()
        and a._ragged_idx == b._ragged_idx
        and (a.lengths() is None) == (b.lengths() is None)
        and _same_parts(a.offsets(), b.offsets())
        and (a.lengths() is None or _same_parts(a.lengths(), b.lengths()))
        and _equal_values(a.values(), b.values())
    )


def _difference(fresh: Tensor, stored: Tensor) -> str:
    """Where a recomputed result differs from its forward's: its largest absolute difference
    and the index of it, or the shapes (dtypes, layouts) that differ."""
    if fresh.layout == torch.jagged and stored.layout == torch.jagged:
        a: Any = fresh
        b: Any = stored
        if not _same_parts(a.offsets(), b.offsets()):
            return "its ragged sizes (offsets) differ."
        return _difference(a.values(), b.values()) + " (of the jagged values)"
    if fresh.shape != stored.shape or fresh.dtype != stored.dtype or fresh.layout != stored.layout:
        return (
            f"shape {tuple(fresh.shape)}, {fresh.dtype}, {fresh.layout}, against "
            f"{tuple(stored.shape)}, {stored.dtype}, {stored.layout} in its forward."
        )
    if fresh.layout != torch.strided:
        fresh, stored = fresh.to_dense(), stored.to_dense()
    wide = torch.complex128 if fresh.is_complex() else torch.float64
    x, y = fresh.to(wide), stored.to(wide)
    gap = (x - y).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    gap[(x == y) | (x.isnan() & y.isnan())] = 0  # (inf == inf; NaN equal to NaN)
    flat = int(gap.argmax()) if gap.numel() else 0
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), gap.shape))
    index = f", at index {list(at)}" if at else ""
    return (
        f"the largest absolute difference is {float(gap.flatten()[flat]):.3g}{index} "
        f"({fresh.flatten()[flat].item()} recomputed, {stored.flatten()[flat].item()} in its "
        "forward)."
    )


_OTHER_VALUES = (
    " So f (or a library it calls) gave other values when run again: what it reads changed "
    "(through .data, or a global set meanwhile), a library call is not bitwise deterministic "
    "run to run (torch.linalg.lstsq's default CPU driver, gelsy, is one), or a library keeps "
    "process-wide state which another thread changed meanwhile (not safe on threads). Fix: "
    "remat=False (and no create_graph=True backward); a deterministic driver or algorithm "
    "(for lstsq, driver='gelsd'; torch.use_deterministic_algorithms(True)); executor='serial' "
    "or executor='processes' for a library that is not thread-safe."
)


def _same_parts(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _not_deterministic(api: str, detail: str = "") -> NoReturn:
    raise RuntimeError(
        f"{api}: recomputing f (remat=True, or a create_graph=True backward) gave other results, "
        "or used other tensors, than its forward did. f must be deterministic apart from its "
        "random numbers, which are replayed; and what it reads must not change between the "
        "forward and the backward (a change through .data counts no version, so it is seen "
        "only here)." + detail
    )


def _has_gradmap_note(exc: BaseException) -> bool:
    return any(str(n).startswith("gradmap") for n in getattr(exc, "__notes__", ()))


def _name_failing_element(
    exc: Exception,
    record: ChunkRecord,
    live: list[int],
    n: int,
    api: str,
    pull_back_one: Callable[[int], object] | None,
) -> None:
    """Name the element whose backward raised ``exc``: the chunk's only live element, or the last
    that raises when pulled back alone (that element's exception is raised instead): the loop's
    backward runs the elements made last first (NOTE [the error of the loop's element] in
    ``_remote/_schedule``)."""
    if len(live) > 1 and pull_back_one is not None:
        for e in reversed(live):
            try:
                pull_back_one(e)
            except Exception as element_exc:
                if not _has_gradmap_note(element_exc):
                    add_note(
                        element_exc, element_note(record.elements[e].index, n, "backward", api)
                    )
                raise element_exc from None
    if _has_gradmap_note(exc):
        return
    first, last = record.elements[live[0]].index, record.elements[live[-1]].index
    if first == last:
        add_note(exc, element_note(first, n, "backward", api))
    else:
        add_note(exc, f"{api}: raised in the backward pass of elements {first}..{last} (of {n})")
