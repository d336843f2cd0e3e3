"""``gradmap.tmap``: argument checks, the zip of the iterables, the choice of executor."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._errors import add_note
from ._executors import Executor, resolve_executor
from ._plan import check_chunksize, plan_chunks
from ._torch._rule import map_torch

__all__ = ["tmap", "zip_items"]


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
        executor: ``None`` or ``"threads"`` for gradmap's shared thread pool; ``"serial"`` for the
            reference, in the caller's thread (its backward runs elements in reverse order); or
            any ``concurrent.futures.Executor`` (used as given, never shut down by gradmap).
        workers: threads that run chunks at once, each with one PyTorch intra-op thread. Default:
            the cores available to the process (the shared pool, whose threads do the work while
            the caller waits), or a user executor's ``max_workers`` plus the caller (which then
            works on chunks too).
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
    if not callable(f):
        raise TypeError(f"gradmap.tmap: f must be callable, got {type(f).__name__}")
    resolved = resolve_executor(executor, workers)
    if chunksize is not None:
        check_chunksize(chunksize)  # before any item is read
    elements = zip_items(iterables, strict)
    plan = plan_chunks(len(elements), chunksize)
    if not elements:
        return []
    return map_torch(f, elements, resolved, plan, remat=remat, progress=progress)


def _as_iterable(arg: Any, position: int) -> Iterable[Any]:
    if isinstance(arg, torch.Tensor):
        if arg.dim() == 0:
            raise TypeError(
                f"gradmap.tmap: iterable {position} is a 0-d tensor, which has no first dimension "
                "to map over; pass a tensor with at least one dimension (e.g. t.reshape(1)) "
                "or a list"
            )
        return arg.unbind(0)
    try:
        iter(arg)
    except TypeError:
        raise TypeError(
            f"gradmap.tmap: iterable {position} is not iterable (got {type(arg).__name__})"
        ) from None
    return arg


def _length(arg: Any) -> int | None:
    if isinstance(arg, torch.Tensor):
        return arg.shape[0]
    try:
        return len(arg)
    except TypeError:
        return None


def zip_items(iterables: tuple[Iterable[Any], ...], strict: bool) -> list[tuple[Any, ...]]:
    """The argument tuples of every element: ``list(zip(*iterables, strict=strict))`` with
    tensors iterated over their first dimension and clearer errors.

    Arguments:
        iterables: ``tmap``'s iterables.
        strict: require equal lengths.

    Returns:
        One tuple of items per element.
    """
    if not iterables:
        raise TypeError("gradmap.tmap: expected at least one iterable after f")
    sources = [_as_iterable(a, i) for i, a in enumerate(iterables)]
    lengths = [_length(a) for a in iterables]
    if strict and None not in lengths and len(set(lengths)) > 1:
        raise ValueError(
            f"gradmap.tmap(strict=True): the iterables have different lengths: {_describe(lengths)}"
        )
    if len(sources) == 1:
        it: Iterable[tuple[Any, ...]] = ((x,) for x in sources[0])
    else:
        it = zip(*sources, strict=strict)
    elements: list[tuple[Any, ...]] = []
    iterator = iter(it)
    while True:
        try:
            element = next(iterator)
        except StopIteration:
            break
        except ValueError as exc:
            if strict and str(exc).startswith("zip()"):
                # Some iterables are generators: say what is known of each length.
                counts = [n if n is not None else f"{len(elements)} or more" for n in lengths]
                raise ValueError(
                    "gradmap.tmap(strict=True): the iterables have different lengths: "
                    f"{_describe(counts)} ({exc})"
                ) from None
            _note_reading(exc, len(elements))
            raise
        except Exception as exc:
            _note_reading(exc, len(elements))
            raise
        elements.append(element)
    return elements


def _note_reading(exc: BaseException, index: int) -> None:
    add_note(exc, f"gradmap.tmap: raised while reading the items of element {index}; nothing ran")


def _describe(lengths: list[Any]) -> str:
    return ", ".join(f"iterable {i} has {n}" for i, n in enumerate(lengths))
