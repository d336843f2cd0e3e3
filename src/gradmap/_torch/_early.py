"""Chunks of losses pulled back during the forward: ``tsum``'s (NOTE [tsum pulls back during
the forward] in ``_sum``) and a ``tmap``'s whose backward is learnt to give every result one
cotangent; how their gradients are scaled and added up in the backward.

NOTE [tmap's losses pulled back early]:
    ``tsum`` pulls each chunk of losses back as soon as its forward ends: on threads the
    pullbacks overlap the forwards still running (the engine releases the GIL), and on worker
    processes a chunk's forward and backward run in one call, wherever there is room, which
    balances the sides by itself. A ``tmap``'s backward comes later and starts from nothing: on
    threads its pullbacks overlap nothing, and on processes each chunk is pulled back where its
    graph lives, so the side that ran more chunks in the forward (the worker: the caller also
    sends and reads) has more to pull back while the other waits. Yet the usual backward
    through a ``tmap`` of losses, ``sum(ys)`` or ``stack(ys).mean()``, gives every result one
    and the same cotangent. So a map of an ``f`` whose latest backward did (learnt per ``f``:
    ``_placement.uniform_cotangents``; not under ``remat`` or autocast, nor on one thread,
    where it would overlap nothing: the serial executor stays the plain reference) pulls each
    chunk of losses (0-d real results, no user code in its backward: NOTE [chunks whose
    backward is user code]; the native walk only, since the Python walk does not see hooks on
    tensors ``f`` makes) back with cotangent one at once, as ``tsum`` does, and keeps its graph
    (``pull_back_kept``; on processes the host's ``forward_sum`` does it). If every result then
    gets the same nonzero cotangent ``c``, the backward takes those gradients, scaled by ``c``
    once as ``tsum``'s are (NOTE [early gradients scaled once] in ``_sum``), with no pullback;
    otherwise it pulls the kept graphs back as ever (the early work wasted; the next map
    learns). The map that pulls back early takes what was learnt, and its own backward learns it
    again: a map never pulled back (an evaluation with grad mode on) leaves the next one
    without. ``f`` runs once per element either way; with ``c`` one the gradients are the bits
    the backward's pullbacks give (one root, as ``pull_back_sum``'s, gives each loss cotangent
    one all the same: the tests check it). The price: the chunks' gradients, added up as they
    come (NOTE [gradients added as they come] in ``_join``), are kept to the backward (a model
    whose early gradients would pass ``EARLY_BYTES`` learns nothing), and the graphs are freed
    after the backward, not during a pullback. An element whose pullback
    fails is left to the backward, which raises the loop's error naming it.

    Measured (2 cores, early pullback off and on alternated in one process, medians of 7-9):
    on threads, ragged bags 51.5 -> 44.3 ms (``tsum`` 42.2), small bags 118.5 -> 101.4 (92.7),
    trees 186.5 -> 157.8 (154.2), molecules 101.9 -> 90.7 (90.1), a GRU 217.6 -> 197.3
    (159.1), ``x * 2`` over 10,000 elements 201.2 -> 205.2 (134.3); on processes, ragged bags
    56.2 -> 46.0 (42.1), small bags 98.3 -> 91.3, trees 165.4 -> 151.7, a GRU 232.0 -> 227.2,
    molecules 94.6 -> 95.9 (there the backward is then mostly the caller freeing its own
    chunks' graphs, 4.4 ms).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._engine import ChunkRun, ThreadContext, run_pipeline
from .._join import JoinLayout, OrderedSum
from .._progress import open_progress
from ._call import MapCall
from ._chunk import (
    ACCUMULATE,
    DEFERRED,
    ChunkRecord,
    pull_back_kept,
    pull_back_sum,
    run_forward,
)
from ._cuda import pass_streams
from ._graph import batched, hooked
from ._random import MapRandom
from ._state import ThreadState

__all__ = [
    "EarlyGradients",
    "add_into",
    "early_then_rest",
    "forward_pulled_back",
    "loss_like",
    "one_cotangent",
    "scaled_sum",
    "unscaled",
]

Tensor = torch.Tensor


def unscaled(cotangent: Tensor, keep: bool) -> bool:
    """Whether the early gradients of a sum's chunks are handed on as they are for this
    cotangent of the sum: it is one (``loss.backward()``, the most common case; ``g * 1`` is
    ``g``, bit for bit), so no product per chunk and parameter -- unless the graph is kept
    (``keep``) for another backward, which must not see what a user's in-place change to a
    returned gradient did to them."""
    return (
        not keep
        and not batched((cotangent,))
        and cotangent.numel() == 1
        and cotangent.device.type == "cpu"
        and bool(cotangent == 1)
    )


def one_cotangent(
    cotangents: Sequence[Tensor | None], stacked: Tensor | None = None
) -> Tensor | None:
    """The one cotangent every result of a map got, if they all got the same nonzero 0-d one
    on the CPU (``sum(ys)``, ``stack(ys).mean()``); ``None`` otherwise (NOTE [tmap's losses
    pulled back early]). ``stacked``: their ``stack_small``, if taken already (a map of many
    losses then reads no cotangent's attributes one by one)."""
    if not cotangents:
        return None
    if stacked is None:
        if not all(c is not None and c.dim() == 0 and c.device.type == "cpu" for c in cotangents):
            return None
        stacked = torch.stack(cotangents)  # type: ignore[arg-type]
    elif stacked.dim() != 1:  # (not 0-d)
        return None
    first = cotangents[0]
    assert first is not None
    if batched((first,)) or not bool(stacked[0] != 0):
        return None
    if len(cotangents) > 1 and not bool((stacked == stacked[0]).all()):
        return None
    return first


def loss_like(record: ChunkRecord) -> bool:
    """Whether every element returned one real 0-d tensor (requiring grad or not). (A complex
    loss's pullback is not complex-linear in its cotangent, ``conj`` being in the graph: no
    early pullback scaled later.)

    NOTE [tensor methods that let go of the GIL]:
        Some of a tensor's methods go through the dispatcher and drop the GIL while they run,
        however little they do: ``is_complex()``, ``is_floating_point()``, ``is_conj()``,
        ``is_neg()``, ``is_inference()``, ``detach()`` (counted with a probe on CPython's
        ``take_gil``: one per call); its attributes (``dtype``, ``device``, ``requires_grad``,
        ``is_leaf``, ``grad_fn``, ``shape``, ``dim()``, ``numel()``, ``_version``) do not. Each
        drop hands the GIL to a thread waiting for it, and the dropping thread then waits its
        turn to go on. Here, in a pool thread while the forward runs in another, a check per
        loss by ``is_complex()`` dropped the GIL once per element (``x * 2`` over 10,000
        elements: 10,000 drops a forward, each a chance for the two threads to trade it);
        ``dtype.is_complex`` asks the same of the tensor's attribute, and drops none. (No
        change in wall time could be told apart from this machine's noise: a map of ``x * 2``
        and ragged bags, old and new alternated, 5-6 runs each.)"""
    if record.results is not None:
        return all(y.dim() == 0 and not y.dtype.is_complex for y in record.results)
    return all(
        len(el.leaves) == 1 and (not el.diff or _real_scalar(record.outputs[el.outputs[0]]))
        for el in record.elements
    )


def _real_scalar(t: Tensor) -> bool:
    return t.dim() == 0 and not t.dtype.is_complex


def add_into(total: Tensor, g: Tensor) -> Tensor:
    """``total + g``, written into ``total`` (a sum of ``OrderedSum``'s own) where that is the
    same addition: dense tensors of one shape, dtype and device, neither in a graph (a
    ``create_graph`` backward's are); else a new sum."""
    if (
        total.layout == torch.strided
        and g.layout == torch.strided
        and total.shape == g.shape
        and total.dtype == g.dtype
        and total.device == g.device
        and not (total.requires_grad or g.requires_grad)
    ):
        return total.add_(g)
    return total + g


class EarlyGradients:
    """The gradients of the chunks pulled back in the forward, added up in chunk order as they
    come (NOTE [gradients added as they come] in ``_join``), and which chunks they are."""

    def __init__(self, count: int, group: int) -> None:
        self._sum: OrderedSum[Any, Tensor] = OrderedSum(count, torch.add, group, add_into)
        #: Whether each chunk was pulled back in the forward.
        self.pulled = [False] * count

    def put(self, k: int, record: ChunkRecord, grads: list[Tensor | None] | None) -> None:
        """Chunk ``k``'s gradients, one per boundary entry (``None``: not pulled back)."""
        if grads is not None:
            self.pulled[k] = True
        self._sum.put(k, None if grads is None else zip(record.boundary.keys, grads))

    def clear(self) -> None:
        """Forget every gradient (a forward that failed: ``OrderedSum.clear``)."""
        self._sum.clear()

    def added(self, layout: JoinLayout[Tensor]) -> list[Tensor | None]:
        """The early chunks' gradients added up, one per join input."""
        first: list[Tensor | None] = [None] * len(layout.inputs)
        for key, g in self._sum.result().items():
            first[layout.index[key]] = g
        return first


def forward_pulled_back(
    call: MapCall, keep_graphs: bool = False
) -> tuple[list[ChunkRecord], EarlyGradients]:
    """Every chunk's forward, each loss-like chunk pulled back with cotangent one at once, its
    gradients added up as they come. ``keep_graphs`` (a ``tmap``): each chunk keeps its graph
    for a backward with other cotangents, and is pulled back by ``pull_back``, as that backward
    would (NOTE [tmap's losses pulled back early] in ``_map``)."""
    f, elements, plan = call.f, call.elements, call.plan
    assert f is not None and elements is not None
    gradients = EarlyGradients(plan.count, plan.group)
    placement = call.placement
    call.random.each = placement.seeds_each or call.remat  # a recompute replays each
    call.versions_before(True)

    def forward(k: int, stopped: Callable[[], bool], seeded: MapRandom | None) -> ChunkRecord:
        return run_forward(
            f,
            elements,
            range(*plan.bounds(k)),
            known=call.known,
            random=seeded,
            stop=stopped,
            api=call.api,
            leaf_results=keep_graphs,  # NOTE [leaves returned as they are]
            watch=None if call.placement.many else call.watch,
        )

    def early(k: int, record: ChunkRecord, pulled: deque[ChunkRecord] | None = None) -> ChunkRecord:
        gradients.put(k, record, pulled_back(record, pulled))
        return record

    def pulled_back(
        record: ChunkRecord, pulled: deque[ChunkRecord] | None
    ) -> list[Tensor | None] | None:
        # A boundary tensor's own hooks (and retained gradient) are set aside only around the
        # sum's backward (``hooks_quiet``): such chunks are pulled back there.
        hooks = not call.gated and hooked(record.boundary.tensors)
        # NOTE [chunks whose backward is user code] and NOTE [gradients of reduced precision]
        # in ``_graph``: pulled back in the backward
        hooks = hooks or record.boundary.user or record.boundary.reduced
        # NOTE [process-wide state f writes]: pulled back after the forward
        if not record.stored or not loss_like(record) or hooks or call.shared:
            if call.remat:
                record.drop_graph()
            return None
        if keep_graphs:
            return pull_back_kept(record, owner=call.owner)
        grads = pull_back_sum(record, n=call.n, owner=call.owner, api=call.api)
        if grads is ACCUMULATE or grads is DEFERRED:  # pulled back (recomputed) in the backward
            return None
        if pulled is not None:
            pulled.append(record)
        else:
            record.drop_graph()
        return grads

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

        def consume(k: int, record: ChunkRecord) -> ChunkRecord:
            return early(k, record, pulled)

        context: ThreadContext = backward_state.enter
        produce_context: ThreadContext = call.state.enter
        cuda = pass_streams()  # NOTE [CUDA streams on the pool's threads]
        if cuda is not None:
            produce, consume = cuda.chunk(produce), cuda.chunk(consume)
            context, produce_context = cuda.context(context), cuda.context(produce_context)
        try:
            with call.random.seeding():
                return run_pipeline(
                    call.executor,
                    plan.count,
                    produce,
                    consume,
                    context=context,
                    produce_context=produce_context,
                )
        finally:
            drop_pulled()
            if bar is not None:
                bar.close()

    def both(k: int, run: ChunkRun[Any]) -> ChunkRecord:
        return early(k, forward(k, lambda: run.stopped(k), None))

    try:
        out = call.placed(lambda: call.run_pass("forward", both), pipeline)
        call.note_versions(True)
    except BaseException:
        gradients.clear()
        raise
    return out, gradients


def early_then_rest(
    first: list[Tensor | None] | None, scale: Tensor | None, rest: list[Tensor | None]
) -> list[Tensor | None]:
    """A sum's gradients on threads: ``first``, the early chunks' gradients added up
    (``EarlyGradients.added``; ``None`` where none is used), multiplied by ``scale`` (``None``:
    one), then ``rest``, the other chunks' added up, added to that: ``scaled_sum``'s additions,
    in its order (NOTE [early gradients scaled once] in ``_sum``)."""
    if first is None:
        return rest
    if scale is not None:
        first = [None if g is None else g * scale for g in first]
    return [b if a is None else a if b is None else a + b for a, b in zip(first, rest)]


def scaled_sum(
    per_chunk: list[Any],
    early: set[int],
    scale: Tensor | None,
    add_up: Callable[[list[Any]], list[Tensor | None]],
) -> list[Tensor | None]:
    """A sum's gradients: the early chunks' (``early``: their indices) added up and multiplied
    by ``scale`` (``None``: one), then the other chunks' added to that (NOTE [early gradients
    scaled once]). ``add_up``: the fixed-order sum of a list of per-chunk gradients."""
    if not early:
        return add_up(per_chunk)
    first = add_up([g if k in early else None for k, g in enumerate(per_chunk)])
    if len(early) == len(per_chunk):
        return early_then_rest(first, scale, [None] * len(first))
    rest = add_up([None if k in early else g for k, g in enumerate(per_chunk)])
    return early_then_rest(first, scale, rest)
