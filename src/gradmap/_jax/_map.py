"""``gradmap.jax.tmap`` and ``gradmap.jax.tsum``: argument checks, the zip, and the choice
between eager, rule and loop.

NOTE [threads on XLA:CPU, measured]:
    Whether a thread pool can speed up a JAX map depends on whether XLA's CPU client runs
    executions that several Python threads dispatch at the same time, or serialises them per
    device (in which case each worker would need a device of its own,
    ``--xla_force_host_platform_device_count``). Measured with jax/jaxlib 0.10.2 on 2 cores
    (``python -m gradmap.bench.jax_bags --concurrency``: each configuration in a fresh
    interpreter, ``XLA_FLAGS`` set before JAX is imported; best of 3):

    - a jitted 20 ms host sleep (``pure_callback``; no CPU contention, so immune to other load),
      40 calls: 1 thread 838-846 ms; 2 threads 419-425 ms; 4 threads 211-218 ms -- on 1 device
      and on 2 alike, and alike whether each thread waits for every call or only at its end.
      Executions are not serialised per device.
    - a jitted chain of 3000 small elementwise steps (too small for XLA to split), 200 calls:
      1 thread 3.8-4.0 ms per call at 1.00 cores busy; 2 threads on 1 device 2.4-2.5 ms at
      1.90-1.98 cores; 2 threads on 2 devices 2.1-2.4 ms at 1.85-1.92 cores.

    So one device serves all workers: gradmap keeps JAX's default single CPU device and needs no
    ``XLA_FLAGS``; each worker bounds the elements it has in flight (NOTE [a worker waits for
    each element] in ``_chunks``). Dispatch holds the GIL: an
    eager ``f`` made of many small operations runs on the workers but its Python does not
    overlap; a jitted ``f`` (or one of few large operations) spends its time in XLA, with the
    GIL released, and overlaps. Hence the docs' advice to map a jitted function.

NOTE [under jit, the traced loop]:
    Inside ``jax.jit`` the map is the plain loop, traced into the caller's program (``LOOP`` in
    NOTE [three ways to run the map]). The alternative, a ``pure_callback`` from the program back
    to the thread pool (wrapped in a ``custom_vjp`` that recomputes in its backward), was
    rejected: the compiled program has no Python and no GIL left to parallelise; a callback
    would cost a host round trip and a compilation per element shape, would need its own
    ``vmap`` rule, and would cut forward mode and second order. Measured: within one program
    XLA:CPU runs independent element subgraphs one after another (8 independent loop chains:
    1.00 cores busy), but splits large operations over its intra-op threads (32 independent MLP
    elements: 1.93 cores busy on 2). A map that must run in parallel is called outside ``jit``,
    on a jitted ``f``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from .._errors import add_note, element_note
from .._executors import Executor, SerialExecutor, ThreadExecutor
from .._plan import plan_chunks
from .._request import MapRequest
from .._resolve import Names, resolve_executor
from ._chunks import TMAP, TSUM
from ._items import zip_jax_items
from ._mode import Mode, VjpTrace, current_mode
from ._rule import forward_chunks, map_vjp
from ._sum import Totals, check_structures, structure_error, sum_vjp

__all__ = ["tmap", "tsum"]

T = TypeVar("T")


def tmap(
    f: Callable[..., Any],
    *iterables: Iterable[Any],
    executor: str | Executor | Any | None = None,
    workers: int | None = None,
    chunksize: int | None = None,
    strict: bool = False,
) -> list[Any]:
    """Apply ``f`` to every element on a thread pool; differentiable, with the plain loop's
    gradients.

    The semantics of the builtin ``map``, returned as a list: ``f`` is applied to the i-th items of
    every iterable, stopping at the shortest. Called eagerly, ``f`` runs on a pool of threads, in
    chunks of elements. Under ``jax.grad``, ``jax.vjp`` or ``jax.value_and_grad`` (reverse mode
    over concrete values), each element is traced, run on the pool under ``jax.vjp``, and the
    backward runs each chunk's pullbacks on the pool too; the gradients are those of
    ``[f(*args) for args in zip(*iterables)]`` -- to arrays inside the items and to every array
    ``f`` closes over -- up to the order of floating-point sums. Under any other transformation
    (``jax.jit``, ``vmap``, ``jvp``, ``jax.hessian``, grad of grad) the map is that plain loop, in
    the caller's thread, and composes as the loop does.

    Arrays spend their time in XLA, which releases the GIL, so the pool pays off for an ``f``
    whose work is in few, large operations or in a ``jax.jit``-compiled function. Best of all,
    ``f`` is one call of a jitted function, as in ``tmap(lambda x: loss_jit(params, x), xs)``:
    under differentiation each element then runs as one compiled forward and one compiled
    pullback (which recomputes the forward), cached per shape across calls.

    ``f`` must be pure across elements: it may not rely on the order in which elements run, nor on
    state one element leaves for the next. Under differentiation it is traced, as under
    ``jax.jit`` -- once per distinct shape and per value of its non-array items, not per element,
    and not again on the next call of the same code over arrays of the same shapes (the arrays
    ``f`` closes over are inputs of the trace; see ``gradmap/_jax/_closure.py`` for what the
    reuse assumes): an ``f`` that branches on a computed array's value runs as the plain loop,
    with a warning.
    JAX's thread-local settings (``jax.enable_x64``, ``jax.default_matmul_precision``, meshes,
    ...) are carried into the workers.

    Arguments:
        f: the function to map; it is called as ``f(*items)``.
        *iterables: lists, tuples, ``range``, generators (consumed once), or JAX arrays (iterated
            over their first dimension; the gradient flows back to the whole array). Items and
            results may be any pytree (``jax.tree_util``) of arrays and other objects, and their
            shapes may differ from element to element.
        executor: ``None`` or ``"threads"`` for gradmap's shared thread pool; ``"serial"`` for the
            reference, in the caller's thread (its backward runs chunks in reverse order); or any
            ``concurrent.futures.Executor`` (used as given, never shut down by gradmap).
        workers: threads that run chunks at once, the caller's included. Default: the cores
            available to the process (the shared pool), or the executor's ``max_workers`` plus
            the caller.
        chunksize: elements per chunk. Default: about 64 chunks. Chunks depend on the number of
            elements only, so gradients are bitwise the same for any ``workers``.
        strict: raise ``ValueError`` if the iterables have different lengths.

    Returns:
        A list with ``f``'s result for each element, in order.

    Raises:
        TypeError: ``f`` is not callable, an iterable is not iterable, or is a 0-d array.
        ValueError: there are no elements (the sum of nothing has no shape; as
            ``gradmap.tsum``); with ``strict=True``, the iterables differ in length; a bad
            ``workers``, ``chunksize`` or executor name.
        Exception: whatever ``f`` raised, for the lowest failing element, with a note naming the
            element; the rest of the map is cancelled first. Errors in an element's pullback
            name the element too where the backward runs on the pool; under the other
            transformations they are JAX's own, as in the loop.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import gradmap.jax as gmj
        >>> w = jnp.array(2.0)
        >>> bags = [jnp.ones(n) for n in (1, 2, 3)]
        >>> def total(w):
        ...     return sum(gmj.tmap(lambda bag: (w * bag).sum(), bags))
        >>> float(jax.grad(total)(w))
        6.0
    """
    call = _start(f, iterables, executor, workers, chunksize, strict, TMAP)
    if not call.elements:
        return []
    return _run(call, _map_eager, map_vjp, _loop)  # type: ignore[no-any-return]


def tsum(
    f: Callable[..., Any],
    *iterables: Iterable[Any],
    executor: str | Executor | Any | None = None,
    workers: int | None = None,
    chunksize: int | None = None,
    strict: bool = False,
) -> Any:
    """The sum of ``f`` over the elements, on a thread pool; differentiable, with the plain
    loop's gradients, and made for a loss: each element runs as one compiled call.

    ``tsum(f, *iterables)`` is ``sum(tmap(f, *iterables))``: ``f``'s results (any pytree of one
    structure) added leaf by leaf, in element order within a chunk and in chunk order across
    chunks. Under ``jax.grad``, ``jax.value_and_grad`` or ``jax.vjp`` (reverse mode over concrete
    values), each element whose differentiable result is one real 0-d array (a loss) runs as one
    compiled ``jax.value_and_grad`` step -- compiled once per input shape and reused across calls
    -- on the pool, adding its value and gradient to its chunk's totals; the backward pass only
    adds the chunks' gradients in chunk order and scales them by the sum's cotangent. That is the
    loop of jitted ``value_and_grad`` calls a JAX user writes by hand for ragged data, spread over
    the pool. Other results take a compiled forward and a compiled pullback, as ``tmap``'s
    elements do. The gradients are those of ``sum(f(*args) for args in zip(*iterables))`` -- to
    arrays inside the items and to every array ``f`` closes over -- up to the order of
    floating-point sums, and bitwise the same for any ``workers``. Called eagerly, ``f`` runs on
    the pool as in ``tmap``; under any other transformation (``jax.jit``, ``vmap``, ``jvp``,
    ``jax.hessian``, grad of grad) the sum is the plain loop, in the caller's thread.

    ``f`` must be pure across elements and, under differentiation, traceable, as for ``tmap``;
    it is compiled whole (a jitted ``f`` need not be). An ``f`` that branches on a computed
    array's value runs as the plain loop, with a warning.

    Arguments:
        f: the function to sum; it is called as ``f(*items)``.
        *iterables: as for ``tmap``: lists, tuples, ``range``, generators, or JAX arrays
            (iterated over their first dimension).
        executor: as for ``tmap``.
        workers: as for ``tmap``.
        chunksize: as for ``tmap``.
        strict: raise ``ValueError`` if the iterables have different lengths.

    Returns:
        The sum of ``f``'s results, of the structure of each.

    Raises:
        TypeError: ``f`` is not callable, an iterable is not iterable or is a 0-d array, or the
            results differ in structure.
        ValueError: with ``strict=True``, the iterables differ in length; a bad ``workers``,
            ``chunksize`` or executor name.
        Exception: whatever ``f`` raised, for the lowest failing element, with a note naming the
            element and ``gradmap.jax.tsum``; the rest of the sum is cancelled first.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import gradmap.jax as gmj
        >>> w = jnp.array(2.0)
        >>> bags = [jnp.ones(n) for n in (1, 2, 3)]
        >>> float(jax.grad(lambda w: gmj.tsum(lambda bag: (w * bag).sum(), bags))(w))
        6.0
    """
    call = _start(f, iterables, executor, workers, chunksize, strict, TSUM)
    if not call.elements:
        # as gradmap.tsum: the builtin sum's 0 would fail later, in jax.grad or in the user's
        # code, with nothing naming this call
        raise ValueError(
            f"{TSUM}: there are no elements to sum; the sum of nothing has no shape. Check "
            "the iterables, or handle an empty batch before the call"
        )
    return _run(call, _sum_eager, sum_vjp, _sum_loop)


def _run(
    call: MapRequest,
    eager: Callable[[MapRequest], Any],
    vjp: Callable[[MapRequest, VjpTrace, Callable[[], Any]], Any],
    loop: Callable[[Callable[..., Any], Sequence[tuple[Any, ...]]], Any],
) -> Any:
    """The map or sum as the caller's mode asks (NOTE [three ways to run the map]): ``f`` itself
    on the workers, the rule under reverse mode (falling back to the loop), or the plain loop."""
    mode, trace = current_mode()
    if mode is Mode.EAGER:
        return eager(call)
    if mode is Mode.VJP:
        assert trace is not None
        return vjp(call, trace, lambda: loop(call.f, call.elements))
    return loop(call.f, call.elements)


def _start(
    f: Callable[..., Any],
    iterables: tuple[Iterable[Any], ...],
    executor: Any,
    workers: int | None,
    chunksize: int | None,
    strict: bool,
    api: str,
) -> MapRequest:
    """Check the arguments (before any item is read), zip the iterables, plan the chunks."""
    if not callable(f):
        raise TypeError(f"{api}: f must be callable, got {type(f).__name__}")
    resolved = _resolve(executor, workers, api)
    plan_chunks(0, chunksize, api)  # checks chunksize before any item is read
    elements = zip_jax_items(iterables, strict, api)
    return MapRequest(f, elements, resolved, plan_chunks(len(elements), chunksize, api), api)


def _resolve(executor: Any, workers: int | None, api: str) -> Executor:
    """``resolve_executor`` with JAX's names, its errors naming ``api``; executors that share
    memory only."""
    resolved = resolve_executor(executor, workers, _names(api), api)
    if not resolved.shares_memory:
        raise _not_threads(resolved.name, api)
    return resolved


def _names(api: str) -> Names:
    """The executor names a JAX map accepts: the thread pool and the serial reference; the
    names of the executors that run chunks in other processes say so."""

    def refuse(name: str) -> Any:
        def make(workers: int | None) -> Executor:
            raise _not_threads(name, api)

        return make

    return {
        "threads": ThreadExecutor,
        "serial": SerialExecutor,
        "processes": refuse("processes"),
        "ray": refuse("ray"),
    }


def _not_threads(name: str, api: str) -> TypeError:
    return TypeError(
        f"{api}: the {name!r} executor runs chunks in other processes; a JAX map "
        "runs on threads: pass executor=None, 'threads', 'serial' or a ThreadPoolExecutor"
    )


def _loop(f: Callable[..., Any], elements: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The plain loop, in the caller's thread and trace, with errors naming the element."""
    n = len(elements)
    results = []
    for i, args in enumerate(elements):
        try:
            results.append(f(*args))
        except BaseException as exc:
            add_note(exc, element_note(i, n, "forward", TMAP))
            raise
    return results


def _sum_loop(f: Callable[..., Any], elements: Sequence[tuple[Any, ...]]) -> Any:
    """The plain loop's sum, in the caller's thread and trace, with errors naming the element."""
    import jax

    n = len(elements)
    totals = Totals(TSUM)
    for i, args in enumerate(elements):
        try:
            leaves, tree = jax.tree_util.tree_flatten(f(*args))
            if not totals.check(i, tree):
                raise structure_error(TSUM, i, tree, 0, totals.tree)
        except BaseException as exc:
            add_note(exc, element_note(i, n, "forward", TSUM))
            raise
        totals.add_leaves(leaves)
    return jax.tree_util.tree_unflatten(
        totals.tree, [totals.leaf(t) for t in range(len(totals.arrays))]
    )


def _map_eager(call: MapRequest) -> list[Any]:
    """No transformation: ``f`` itself runs on the workers, chunk by chunk."""

    def add(out: list[Any], i: int, result: Any) -> Any:
        out.append(result)
        return result

    chunks = _eager_chunks(call, list, add)
    return [y for chunk in chunks for y in chunk]


def _sum_eager(call: MapRequest) -> Any:
    """No transformation: ``f`` itself runs on the workers, each chunk summing its results;
    the chunks' sums are added in chunk order."""
    import jax

    def add(totals: Totals, i: int, result: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(result)
        if totals.check(i, tree):
            totals.add_leaves(leaves)
        return list(totals.arrays)

    chunks = _eager_chunks(call, lambda: Totals(TSUM), add)
    check_structures(chunks, call.plan.n)
    total = chunks[0]
    for chunk in chunks[1:]:
        total.merge(chunk)
    return jax.tree_util.tree_unflatten(
        total.tree, [total.leaf(t) for t in range(len(total.arrays))]
    )


def _eager_chunks(
    call: MapRequest, new_chunk: Callable[[], T], add: Callable[[T, int, Any], Any]
) -> list[T]:
    """Every chunk on the workers: ``new_chunk()``, then ``add(chunk, i, f(*items))`` for each
    element in order, returning the arrays to wait for."""
    f, elements = call.f, call.elements
    return forward_chunks(
        call.executor,
        call.plan,
        call.api,
        new_chunk,
        lambda i, chunk: add(chunk, i, f(*elements[i])),
        traced=False,
    )
