"""The join layout and the chunk-order sum: framework-free, shared by every adapter.

A map's join node (an ``autograd.Function`` for PyTorch, a ``custom_vjp`` for JAX) takes as inputs
everything any chunk's graph reaches outside itself -- its *boundary*: items, parameters, closure
tensors, tensors computed before the call -- and returns every chunk's differentiable results. A
[`JoinLayout`][] says where each chunk's boundary sits among the join's inputs and where its results
sit among the join's outputs; [`sum_in_chunk_order`][] adds the chunks' gradients for those inputs.

NOTE [chunk-order sum]:
    A tensor several chunks reach (a parameter) gets one gradient per chunk; they are added in a
    fixed order, whatever order the chunks ran in: the chunks of each group (``ChunkPlan.group``
    consecutive chunks) in chunk order, then the groups' sums in group order. Chunks and groups
    depend on the element count only (NOTE [chunk boundaries depend on the element count only]
    in ``_plan``), so the sum is bitwise the same for every executor and worker count. A worker
    process that runs a whole group adds the group's gradients itself, in the same order
    (``fold_pairs``), and sends one gradient per tensor for the group: the same bits, a
    ``group``-th of the bytes (measured, message passing on molecules, 117k parameters, 64
    chunks: the gradients a worker sent per call went from 16 MB to 4 MB).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import repeat
from operator import is_
from typing import Generic, TypeVar

__all__ = [
    "BACKWARD_TWICE",
    "JoinLayout",
    "OrderedSum",
    "Spent",
    "fold_pairs",
    "groups_of",
    "sum_by_position",
    "sum_in_chunk_order",
]

T = TypeVar("T")
G = TypeVar("G")


class JoinLayout(Generic[T]):
    """Where each chunk's boundary and results sit among the join's inputs and outputs.

    Arguments:
        boundaries: for each chunk, the objects its graph reaches, in the chunk's own order.
        keys: for each chunk, a hashable key per boundary object; equal keys are one join input.
        output_counts: for each chunk, how many differentiable results it has.

    Attributes:
        inputs: the join's inputs, each once, in order of first appearance over the chunks.
        positions: for each chunk, the index in ``inputs`` of each of its boundary objects.
        output_bounds: for each chunk, its ``(start, stop)`` among the join's outputs.
    """

    def __init__(
        self,
        boundaries: Sequence[Sequence[T]],
        keys: Sequence[Sequence[Hashable]],
        output_counts: Sequence[int],
    ) -> None:
        self.inputs: list[T] = []
        self.positions: list[list[int]] = []
        index: dict[Hashable, int] = {}
        for objects, chunk_keys in zip(boundaries, keys):
            where = []
            for obj, key in zip(objects, chunk_keys):
                p = index.get(key)
                if p is None:
                    p = index[key] = len(self.inputs)
                    self.inputs.append(obj)
                where.append(p)
            self.positions.append(where)
        #: Each key's place among ``inputs``.
        self.index = index
        self.output_bounds: list[tuple[int, int]] = []
        lo = 0
        for count in output_counts:
            self.output_bounds.append((lo, lo + count))
            lo += count
        self.output_count = lo


def sum_in_chunk_order(
    layout: JoinLayout[T],
    per_chunk: Sequence[Sequence[G | None] | None],
    add: Callable[[G, G], G],
    group: int = 1,
) -> list[G | None]:
    """The gradient of each join input: the chunks' gradients added in the fixed order of NOTE
    [chunk-order sum].

    Arguments:
        layout: the map's layout.
        per_chunk: for each chunk, a gradient (or ``None``) per boundary object, or ``None`` for a
            chunk that did no backward work.
        add: adds two gradients.
        group: chunks per group (``ChunkPlan.group``).

    Returns:
        One gradient per join input, ``None`` where no chunk sent one.
    """
    groups = groups_of(range(len(per_chunk)), group)
    return sum_by_position(len(layout.inputs), layout.positions, per_chunk, add, groups)


def groups_of(chunks: Iterable[int], group: int) -> list[int] | None:
    """Each of ``chunks``' group of the sum (``group`` chunks each), for [`sum_by_position`][];
    ``None`` where every chunk is a group of its own."""
    return None if group == 1 else [k // group for k in chunks]


def sum_by_position(
    width: int,
    positions: Sequence[Sequence[int]],
    per_chunk: Sequence[Sequence[G | None] | None],
    add: Callable[[G, G], G],
    groups: Sequence[int] | None = None,
) -> list[G | None]:
    """[`sum_in_chunk_order`][] given each chunk's positions among ``width`` inputs directly
    (a host that learns them from its workers, as Ray's driver does), and each chunk's group
    (``None``: every chunk a group of its own); the chunks come in chunk order."""
    total: list[G | None] = [None] * width
    if groups is None:  # (the loop below with a group per chunk, in half the time)
        for where, grads in zip(positions, per_chunk):
            if grads is None:
                continue
            for p, g in zip(where, grads):
                if g is not None:
                    current = total[p]
                    total[p] = g if current is None else add(current, g)
        return total
    partial: list[G | None] = [None] * width
    touched: list[int] = []
    last = None

    def close_group() -> None:
        for p in touched:
            current, g = total[p], partial[p]
            assert g is not None
            total[p] = g if current is None else add(current, g)
            partial[p] = None
        touched.clear()

    for where, grads, group in zip(positions, per_chunk, groups):
        if group != last:
            close_group()
            last = group
        if grads is None:
            continue
        for p, g in zip(where, grads):
            if g is not None:
                current = partial[p]
                if current is None:
                    partial[p] = g
                    touched.append(p)
                else:
                    partial[p] = add(current, g)
    close_group()
    return total


K = TypeVar("K", bound=Hashable)


class OrderedSum(Generic[K, G]):
    """The chunk-order sum of NOTE [chunk-order sum], taken as the chunks' gradients come, in any
    order and from any thread.

    NOTE [gradients added as they come]:
        The sum adds each key's gradients chunk by chunk in chunk order (a group's in a partial
        sum, closed into the total when the next group starts), as ``sum_by_position`` does
        over a list of every chunk's: the same additions in the same order, so the same bits.
        But a chunk's gradients are added as soon as every chunk before it has been, and only
        the chunks that came ahead of their turn wait: a map whose chunks each give a dense
        gradient of a large tensor (an ``nn.Embedding`` table of 51 MB, read by every element)
        held one such gradient per chunk until the last came (about 3.3 GB for 64 elements,
        where the loop adds into one ``.grad``); here a few, about one per thread. The thread
        whose chunk is next adds, outside the lock, the waiting chunks that follow it.

        A sum this object made itself is its own, and the next gradient is added into it where
        ``add_into`` can (dense tensors of one shape and dtype, no graph): a new 51 MB sum per
        chunk made the adding thread fall behind the pullbacks (20 chunks waiting, 1.3 GB),
        where adding in place, which is the same addition, keeps up. The gradients given are
        never changed (a pullback may hand back a tensor someone else holds: a cotangent).

    Arguments:
        count: how many chunks there are (chunk ``k`` put once, ``0 <= k < count``).
        add: adds two gradients (a new one: the ones given are not changed).
        group: chunks per group (``ChunkPlan.group``).
        add_into: adds the second gradient into the first, a sum of this object's, and returns
            it (or returns a new sum where it cannot); ``None``: ``add`` throughout.
    """

    def __init__(
        self,
        count: int,
        add: Callable[[G, G], G],
        group: int = 1,
        add_into: Callable[[G, G], G] | None = None,
    ) -> None:
        self._count = count
        self._add = add
        self._add_into = add_into or add
        self._group = group
        self._lock = threading.Lock()
        self._waiting: dict[int, Iterable[tuple[K, G | None]] | None] = {}
        self._next = 0
        self._adding = False
        self._total: dict[K, G] = {}
        self._partial: dict[K, G] = {}
        self._own: set[tuple[bool, K]] = set()  # (partial?, key) of the sums made here

    def put(self, k: int, pairs: Iterable[tuple[K, G | None]] | None) -> None:
        """Chunk ``k``'s ``(key, gradient)`` pairs (``None`` gradients and chunks skipped)."""
        with self._lock:
            self._waiting[k] = pairs
            if self._adding:
                return  # the thread adding takes it in its turn
            self._adding = True
        try:
            while True:
                with self._lock:
                    k = self._next
                    if k not in self._waiting:
                        self._adding = False
                        return
                    pairs = self._waiting.pop(k)
                    self._next = k + 1
                self._take(k, pairs)
        except BaseException:
            with self._lock:
                self._adding = False
            raise

    def _take(self, k: int, pairs: Iterable[tuple[K, G | None]] | None) -> None:
        grouped = self._group > 1
        if grouped and k % self._group == 0:
            self._close_group()
        into = self._partial if grouped else self._total
        for key, g in pairs or ():
            if g is not None:
                self._add_to(into, grouped, key, g)

    def _add_to(self, into: dict[K, G], partial: bool, key: K, g: G) -> None:
        current = into.get(key)
        if current is None:
            into[key] = g
        elif (partial, key) in self._own:
            into[key] = self._add_into(current, g)
        else:
            into[key] = self._add(current, g)
            self._own.add((partial, key))

    def _close_group(self) -> None:
        for key, g in self._partial.items():
            self._add_to(self._total, False, key, g)
        self._partial = {}
        self._own = {own for own in self._own if not own[0]}

    def clear(self) -> None:
        """Forget every gradient (a pass that failed: the traceback's frames, which a cycle may
        keep alive for a while, hold this object, not the gradients)."""
        with self._lock:
            self._waiting, self._total, self._partial = {}, {}, {}

    def result(self) -> dict[K, G]:
        """Each key's sum, once every chunk is in."""
        with self._lock:
            assert self._next == self._count and not self._adding, "a chunk was not put"
            if self._partial:
                self._close_group()
            return self._total


def fold_pairs(
    chunks: Sequence[Sequence[tuple[K, G]]], add: Callable[[G, G], G]
) -> list[tuple[K, G]]:
    """One group's gradients as a worker adds them (NOTE [chunk-order sum]): each chunk's
    ``(key, gradient)`` pairs, chunks in chunk order, added per key in that order; the keys in
    order of first sight."""
    total: dict[K, G] = {}
    for pairs in chunks:
        for key, g in pairs:
            current = total.get(key)
            total[key] = g if current is None else add(current, g)
    return list(total.items())


#: PyTorch's message for a backward through a graph that an earlier backward freed.
BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). Saved intermediate values of the graph are freed when you "
    "call .backward() or autograd.grad(). Specify retain_graph=True if you need to backward "
    "through the graph a second time or if you need to access saved tensors after calling "
    "backward."
)


class Spent:
    """Which of a join's outputs a backward that frees the graph has gone through.

    NOTE [a backward of some results]:
        In the loop each element has a graph of its own, so ``for y in ys: y.backward()`` works:
        each backward frees only the graph behind its own result. A map's results all come out of
        one join node, so the join does not let the engine's freeing decide (it saves nothing
        that a backward would free); it keeps this account instead. A backward that frees the
        graph marks the outputs it brought a cotangent to; any backward (one that keeps the graph
        too) that brings a cotangent to an output marked before fails with PyTorch's error, as
        the loop's backward through an element's freed graph does. A chunk's graph is freed once
        all its outputs are marked, the whole map's state once every output is.

    Arguments:
        n: the join's output count.
    """

    __slots__ = ("_flags", "left")

    def __init__(self, n: int) -> None:
        self._flags: bytearray | None = None  # made at the first backward that leaves some
        #: outputs not gone through yet.
        self.left = n

    def spend(self, cotangents: Sequence[object], *, free: bool = True) -> None:
        """Raise PyTorch's error (``RuntimeError``) if an output marked before has a cotangent
        (not ``None``); else, for a backward that frees the graph (``free``), mark the outputs
        that have one. A backward that keeps the graph marks nothing."""
        flags = self._flags
        if self.left == 0:
            if any(c is not None for c in cotangents):
                raise RuntimeError(BACKWARD_TWICE)
            return
        if flags is None:
            if not free:
                return  # nothing marked yet
            if not any(map(is_, cotangents, repeat(None))):  # every output: the common case
                self.left = 0
                return
            flags = self._flags = bytearray(len(cotangents))
        live = [i for i, c in enumerate(cotangents) if c is not None]
        if any(flags[i] for i in live):
            raise RuntimeError(BACKWARD_TWICE)
        if free:
            for i in live:
                flags[i] = 1
            self.left -= len(live)

    def spent(self, lo: int, hi: int) -> bool:
        """Whether outputs ``lo..hi-1`` have all been gone through."""
        flags = self._flags
        return self.left == 0 or (flags is not None and all(flags[lo:hi]))
