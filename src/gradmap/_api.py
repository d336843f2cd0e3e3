"""``gradmap.tmap`` and ``gradmap.tsum``: argument checks, the zip of the iterables, the choice of
executor and of the forward's placement."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ._executors import Executor, SerialExecutor
from ._items import zip_items
from ._plan import check_chunksize, plan_chunks
from ._request import MapRequest
from ._resolve import EXECUTORS, resolve_executor
from ._torch._graph import warn_caller_only
from ._torch._map import map_torch
from ._torch._sum import sum_torch

__all__ = ["tmap", "tsum", "zip_items"]

TMAP = "gradmap.tmap"
TSUM = "gradmap.tsum"


def tmap(
    f: Callable[..., Any],
    *iterables: Iterable[Any],
    executor: str | Executor | Any | None = None,
    workers: int | None = None,
    chunksize: int | None = None,
    strict: bool = False,
    remat: bool = False,
    progress: Any = False,
) -> list[Any]:
    """Apply ``f`` to every element in parallel; differentiable, with the plain loop's gradients.

    The semantics of the builtin ``map``, returned as a list: ``f`` is applied to the i-th items of
    every iterable, stopping at the shortest. ``f`` runs on a pool of threads, in chunks of
    elements; when the results are differentiated (``.backward()``, ``torch.autograd.grad``), each
    chunk's backward runs on the pool too. The gradients are those of
    ``[f(*args) for args in zip(*iterables)]`` -- to tensors inside the items and to every tensor
    ``f`` uses that requires grad (module parameters, closure and global tensors, attributes,
    tensors computed before the call) -- up to the order of floating-point sums.

    ``f`` must be pure across elements: it may not rely on the order in which elements run, nor on
    state one element leaves for the next. Tensors a worker sees are the caller's; grad mode,
    inference mode and autocast are carried into the workers.

    Arguments:
        f: the function to map; it is called as ``f(*items)``.
        *iterables: lists, tuples, ``range``, generators (consumed once), or tensors (iterated over
            their first dimension; the gradient flows back to the whole tensor). Items may be any
            pytree (tuple, list, dict, namedtuple) of tensors and other objects.
        executor: ``None`` or ``"threads"`` for gradmap's shared thread pool; ``"processes"``
            (or a ``gradmap.ProcessExecutor``) for worker processes on this machine, past the
            GIL (``f`` and the items must pickle); ``"ray"`` (or a ``gradmap.RayExecutor``) for
            Ray actors; ``"serial"`` for the reference, in the caller's thread (its backward
            runs elements in reverse order); or any ``concurrent.futures.Executor`` (used as
            given, never shut down by gradmap). ``gradmap.compare`` times them on your ``f``.
        workers: threads (or worker processes) that run chunks at once, each with one PyTorch
            intra-op thread. Default: the cores available to the process (the shared pool, whose
            threads do the work while the caller waits), or a user executor's ``max_workers``
            plus the caller (which then works on chunks too).
        chunksize: elements per chunk. Default: about 64 chunks. Chunks depend on the number of
            elements only, so results are bitwise the same for any ``workers``.
        strict: raise ``ValueError`` if the iterables have different lengths.
        remat: recompute instead of storing: the forward runs ``f`` without recording a graph
            and keeps only the items and results; the backward runs each chunk's forward again,
            under grad mode, pulls it back and frees it. Same gradients, a fraction of the memory,
            at the price of a second forward. ``f`` must be deterministic apart from its random
            numbers, which are replayed.
        progress: ``True`` for a progress bar of the forward and of the backward, counting
            elements (needs ``tqdm``: ``pip install 'gradmap[progress]'``); or a tqdm instance
            to update; or a callable making a bar, such as ``tqdm.tqdm``. Updated once per chunk.

    Returns:
        A list with ``f``'s result for each element, in order.

    Raises:
        TypeError: ``f`` is not callable, or an iterable is not iterable.
        ValueError: with ``strict=True``, the iterables differ in length; a bad ``workers``,
            ``chunksize`` or executor name.
        Exception: whatever ``f`` raised, for the lowest failing element, with a note naming the
            element; the rest of the map is cancelled first.

    Example:
        >>> import torch, gradmap
        >>> w = torch.tensor(2.0, requires_grad=True)
        >>> bags = [torch.ones(n) for n in (1, 2, 3)]
        >>> losses = gradmap.tmap(lambda bag: (w * bag).sum(), bags)
        >>> torch.stack(losses).sum().backward()
        >>> w.grad
        tensor(6.)
    """
    call = _prepare(f, iterables, executor, workers, chunksize, strict, remat, progress, TMAP)
    if not call.elements:
        return []
    return _run(call, map_torch)  # type: ignore[no-any-return]


def tsum(
    f: Callable[..., Any],
    *iterables: Iterable[Any],
    executor: str | Executor | Any | None = None,
    workers: int | None = None,
    chunksize: int | None = None,
    strict: bool = False,
    remat: bool = False,
    progress: Any = False,
) -> Any:
    """The sum of ``f`` over the elements: ``sum(f(*args) for args in zip(*iterables))``, in
    parallel, with the plain loop's gradients up to the order of floating-point sums.

    The shape of most losses: ``loss = gradmap.tsum(bag_loss, bags) / len(bags)``. ``f`` returns
    a tensor, or a pytree of tensors summed leaf by leaf; every element must return the same
    structure. When each element returns one 0-d tensor, each chunk's backward runs as soon as its
    forward ends, overlapping the forwards still to run, and its graph is freed at once: faster
    than ``tmap`` followed by a sum, with about one chunk's graph per worker alive instead of
    every element's. Other results, ``create_graph=True`` and ``remat`` work too, on the general
    path. Under ``torch.no_grad()`` it is a parallel sum.

    Arguments:
        f, *iterables, executor, workers, chunksize, strict, remat, progress: as for
            [`tmap`][gradmap.tmap].

    Returns:
        The sum (a tensor, or a pytree of tensors).

    Raises:
        ValueError: no elements, or elements whose results differ in structure; and everything
            ``tmap`` raises.

    Example:
        >>> import torch, gradmap
        >>> w = torch.tensor(2.0, requires_grad=True)
        >>> bags = [torch.ones(n) for n in (1, 2, 3)]
        >>> loss = gradmap.tsum(lambda bag: (w * bag).sum(), bags)
        >>> loss.backward()
        >>> w.grad
        tensor(6.)
    """
    call = _prepare(f, iterables, executor, workers, chunksize, strict, remat, progress, TSUM)
    if not call.elements:
        raise ValueError(
            "gradmap.tsum: there are no elements to sum, and the sum of nothing has no shape; "
            "check the iterables (or use sum(gradmap.tmap(...), start) with a start value)"
        )
    return _run(call, sum_torch)


def _prepare(
    f: Any,
    iterables: tuple[Iterable[Any], ...],
    executor: Any,
    workers: int | None,
    chunksize: int | None,
    strict: bool,
    remat: bool,
    progress: Any,
    api: str,
) -> MapRequest:
    """What ``tmap`` and ``tsum`` check and prepare alike: ``f``, the executor, the chunk size
    (before any item is read), the elements, the plan and the forward's placement."""
    if not callable(f):
        raise TypeError(f"{api}: f must be callable, got {type(f).__name__}")
    resolved = resolve_executor(executor, workers, EXECUTORS, api)
    if chunksize is not None:
        check_chunksize(chunksize, api)
    elements = zip_items(iterables, strict, api=api)
    plan = plan_chunks(len(elements), chunksize, api)
    placement = _placement(executor, workers, resolved)
    return MapRequest(f, elements, resolved, plan, api, remat, progress, placement)


def _run(call: MapRequest, on_threads: Callable[[MapRequest], Any]) -> Any:
    """The call on threads (the executor shares the caller's memory), or in other processes."""
    warn_caller_only(call.api, stacklevel=3)  # (the user's line: _run, tmap or tsum, the user)
    if call.executor.shares_memory:
        return on_threads(call)
    from ._remote._map import map_remote  # lazy: cloudpickle, and the workers' transport

    return map_remote(call)  # chunks in other processes: Ray, worker processes


def _placement(executor: object, workers: int | None, resolved: Executor) -> str:
    """``"one"``, ``"many"`` or ``"auto"``: where the forward runs (NOTE [forward placement])."""
    if resolved.workers == 1 or isinstance(resolved, SerialExecutor):
        return "one"
    if (executor is None or executor == "threads") and workers is None:
        return "auto"
    return "many"
