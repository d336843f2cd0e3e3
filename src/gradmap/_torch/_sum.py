"""The sum: ``tsum`` on threads -- chunks of losses pulled back during the forward (NOTE [tsum
pulls back during the forward]), the sum in element and chunk order, and the sum's join node.
"""

from __future__ import annotations

from typing import Any

import torch

from .._engine import ChunkRun
from .._join import JoinLayout, Spent
from .._request import MapRequest
from .._tree import flatten, unflatten
from ._call import MapCall
from ._chunk import ChunkRecord, pull_back
from ._early import EarlyGradients, forward_pulled_back, unscaled
from ._graph import Known, batched, caller_only, keep_graph
from ._map import MapGraph, map_torch
from ._node import JoinNode, layout_of

__all__ = ["sum_results", "sum_torch"]

Tensor = torch.Tensor


def sum_torch(request: MapRequest) -> Any:
    """``sum(f(*args) for args in elements)``, leaf by leaf, differentiable as the loop is.

    NOTE [tsum pulls back during the forward]:
        When every element's result is one 0-d tensor (a loss), the cotangent of each element
        is the sum's own, whatever it turns out to be; so each chunk is pulled back with
        cotangent one as soon as its forward ends, on the pool, while the next chunks' forwards
        run, and its graph is freed at once (about one chunk's graph per worker is alive). The
        sum's backward multiplies the chunk gradients, added up in the order of NOTE [chunk-order
        sum] (``_join``), by its cotangent (NOTE [early gradients scaled once]).
        Chunks with other results keep their graph (or nothing, under ``remat``) and are pulled
        back in the sum's backward, with the sum's cotangent for every element; a
        ``create_graph=True`` backward recomputes every chunk (NOTE [double backward
        recomputes]).
    """
    if caller_only() is not None:  # NOTE [state only the caller's thread has]
        return sum_results(map_torch(request))
    call = MapCall(request)
    if not (torch.is_grad_enabled() and not call.state.inference):
        records = call.forward(False)
        results = [y for r in records for y in r.plain_results()]
        return sum_results(results, [r.count() for r in records])
    call.known = Known(request.f, request.elements, eager=True)
    return _sum_join(call, *forward_pulled_back(call))


def sum_results(
    results: list[Any],
    chunks: list[int] | None = None,
    spans: list[tuple[int, int]] | None = None,
) -> Any:
    """The leaf-by-leaf sum of the elements' results: within each chunk in element order, then
    the chunks' sums in chunk order (the order of the differentiable path, so that a sum under
    ``no_grad`` is bitwise the one under grad mode). ``chunks``: results per chunk; ``None``
    for one chunk. ``spans``: the first and last element each result stands for (a chunk's
    sum, made elsewhere, stands for several), for the errors; ``None``: one element each."""
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
            lo, hi = spans[i] if spans is not None else (i, i)
            first = spans[start][0] if spans is not None else start
            more, other = flatten(y)
            if other != spec or len(more) != len(leaves):
                which = f"element {lo}" if lo == hi else f"one of elements {lo}..{hi}"
                raise ValueError(
                    f"gradmap.tsum: {which} returned a result of another structure than "
                    "element 0's; every element must return the same structure (a tensor, or a "
                    "pytree of tensors) to be summed"
                )
            if partial is None:
                partial = _started(more)
            else:
                partial = _add(partial, more, (lo, hi), (first, lo - 1))
            i += 1
        assert partial is not None
        lo = spans[start][0] if spans is not None else start
        hi = spans[i - 1][1] if spans is not None else i - 1
        total = partial if total is None else _add(total, partial, (lo, hi), (0, lo - 1))
    assert total is not None
    return unflatten(total, spec)


def _sum_join(call: MapCall, records: list[ChunkRecord], early: EarlyGradients) -> Any:
    """The sum of every element's result, one join node for its differentiable leaves."""
    first = records[0]
    if first.results is not None:
        spec, width = None, 1
    else:
        spec, width = first.elements[0].spec, len(first.elements[0].leaves)
    differentiable: set[int] = set()  # leaves that require grad in some element's result
    partial: list[Any] = []
    for r in records:
        totals: list[Any] | None = None
        if r.results is not None and spec is None:  # NOTE [a chunk of bare tensors]
            if r.results is r.outputs:
                differentiable.add(0)
            with torch.no_grad():  # the sum's own graph is the join
                for i, y in zip(r.indices, r.results):
                    if totals is not None:
                        totals = _add(totals, [y], (i, i), (r.indices[0], i - 1))
                    else:
                        totals = _started([y.detach()])
            partial.append(totals)
            continue
        for el in r.elements:
            if el.spec != spec or len(el.leaves) != width:
                raise ValueError(
                    f"gradmap.tsum: element {el.index} returned a result of another structure "
                    "than element 0's; every element must return the same structure (a tensor, "
                    "or a pytree of tensors) to be summed"
                )
            differentiable.update(el.diff)
            values = el.take()  # the record gives its leaves up
            for o, j in zip(range(*el.outputs), el.diff):
                values[j] = r.outputs[o].detach()
            if totals is not None:
                before = (r.elements[0].index, el.index - 1)
                totals = _add(totals, values, (el.index, el.index), before)
            else:
                totals = _started(values)
        partial.append(totals)
    sums = partial[0]
    for r, more in zip(records[1:], partial[1:]):
        lo, hi = r.first_index(), r.last_index()
        sums = _add(sums, more, (lo, hi), (0, lo - 1))
    diff = sorted(differentiable)
    layout = layout_of(records)
    if diff and layout.inputs:
        graph = _SumGraph(call, records, early, layout, [sums[j] for j in diff], diff)
        joined = _SumJoin.apply(graph, *layout.inputs)
        for j, t in zip(diff, joined):
            sums[j] = t
    else:
        call.free()
    return unflatten(sums, spec)


def _started(values: list[Any]) -> list[Any]:
    """The first term of a sum, as the loop's ``sum`` starts it: ``0 + value``, which only
    changes a bool tensor (to the default integer dtype: ``sum`` counts the true values, where
    ``True + True`` is ``True``)."""
    if any(isinstance(v, Tensor) and v.dtype == torch.bool for v in values):
        return [0 + v if isinstance(v, Tensor) and v.dtype == torch.bool else v for v in values]
    return values


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
        except (TypeError, RuntimeError) as exc:
            leaf = "" if len(totals) == 1 else f" (leaf {j} of the result's pytree)"
            if isinstance(exc, TypeError):  # (None, strings with numbers, ...)
                raise TypeError(
                    f"gradmap.tsum: the result of {_elements(added)}{leaf}, a "
                    f"{type(b).__name__}, does not add to the sum of {_elements(before)}, a "
                    f"{type(a).__name__} ({exc}). tsum adds the results with +, as the loop's "
                    "sum does: return tensors or numbers (or pytrees of them) from every element."
                ) from exc
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


class _SumJoin(JoinNode):
    """The sum's join (named apart from the map's in ``grad_fn``)."""


class _SumGraph(MapGraph):
    def __init__(
        self,
        call: MapCall,
        records: list[ChunkRecord],
        early: EarlyGradients,
        layout: JoinLayout[Tensor],
        sums: list[Tensor],
        diff: list[int],
    ) -> None:
        super().__init__(call, records, layout)
        self.early = early
        self.outputs = sums
        self.spent = Spent(len(sums))  # (a sum of pytrees: a sum per leaf)
        self.place = {j: i for i, j in enumerate(diff)}  # a result leaf's place among the sums

    def join_outputs(self) -> tuple[Tensor, ...]:
        outputs, self.outputs = self.outputs, []
        return tuple(outputs)

    def chunk_spent(self, k: int) -> bool:
        return self.spent.left == 0  # every chunk adds to every sum

    def join_backward(self, ctx: Any, cotangents: tuple[Tensor | None, ...]) -> list[Any]:
        free_graph = not keep_graph()
        self.spent.spend(cotangents, free=free_graph)  # raises for sums gone through before
        call, records = self.call, self.records
        assert records is not None
        create_graph = torch.is_grad_enabled()

        place = self.place

        def chunk_cotangents(k: int) -> list[Tensor | None]:
            # The sum's cotangent for each element's leaves that require grad.
            r = records[k]
            if r.results is not None:
                return [cotangents[place[0]]] * len(r.outputs)
            return [cotangents[place[j]] for el in r.elements for j in el.diff]

        def recomputed(k: int) -> bool:
            # Early chunks' graphs are gone; others are kept unless remat dropped them.
            return create_graph or self.early.pulled[k] or not records[k].stored

        if call.remat or create_graph:  # NOTE [a recompute reads what the forward read]
            runs_f = create_graph or any(
                not self.early.pulled[k] and not r.stored for k, r in enumerate(records)
            )
            call.check_versions(runs_f)
        wanted = self.wanted(ctx)
        c = cotangents[0]
        if c is not None and c.dim() > 0 and any(self.early.pulled):
            # The early chunks' losses are 0-d; a sum that other elements' larger results
            # broadcast them into hands each loss its cotangent summed (the loop's broadcasting
            # add does this in its backward), and multiplying by the whole cotangent would
            # broadcast their gradients instead (wrong values, or a shape error).
            c = c.sum()
        # NOTE [early gradients scaled once]: the early chunks' gradients are added up first
        # (in the order of NOTE [chunk-order sum]) and the sum is multiplied by the cotangent,
        # once per tensor, not once per chunk; worker processes send a group's gradients
        # added up, and the same order gives the same bits there (``_remote/_map``).
        scale = None if c is None or unscaled(c, not free_graph) else c
        pulled = self.early.pulled
        first = (
            None if create_graph or c is None or not any(pulled) else self.early.added(self.layout)
        )

        def backward_chunk(k: int, run: ChunkRun[Any]) -> Any:
            if pulled[k] and not create_graph:
                return None  # (in ``first``, or no cotangent)
            return pull_back(
                records[k],
                chunk_cotangents(k),
                n=call.n,
                owner=call.owner,
                recompute=call.recompute if recomputed(k) else None,
                create_graph=create_graph,
                free_graph=free_graph and self.chunk_spent(k),
                rerun=call.recompute,
                wanted=wanted(k),
                api=call.api,
                made_before=call.made_before,
            )

        return self.backward(
            backward_chunk,
            chunk_cotangents,
            create_graph=create_graph,
            recomputes=create_graph or any(not r.stored for r in records),
            batched=batched(cotangents),
            first=first,
            scale=scale,
        )
