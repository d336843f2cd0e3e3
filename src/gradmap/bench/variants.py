"""The variants the bench compares: ways of computing a workload's total loss.

Every variant returns the total loss as a 0-d tensor; the bench then calls ``backward()`` on it, so
each variant's gradient can be checked against the plain loop's.

- ``loop1``: ``[f(x) for x in items]`` with ``torch.set_num_threads(1)``.
- ``loop``: the same loop with torch's default intra-op threads.
- ``tmap``: ``gradmap.tmap(f, items)`` on the shared thread pool.
- ``tsum``: ``gradmap.tsum(f, items)``: the sum of the losses, each chunk pulled back as soon as its
  forward ends.
- ``tmap-proc``: ``gradmap.tmap(f, items, executor="processes")``: worker processes, and the
  caller running chunks too (``workers - 1`` processes).
- ``tsum-proc``: ``gradmap.tsum(f, items, executor="processes")``: each chunk's forward and
  backward in one call, in a worker process or the caller.
- ``raw``: no gradmap: a hand-written chunked loop on ``W`` plain threads (the available cores),
  each claiming chunks of elements, running their forward and ``torch.autograd.grad`` of their
  summed loss to the parameters, the threads' gradients added at the end; one intra-op thread.
  What the interpreter allows a map of ``f`` on threads: how close ``tmap``/``tsum`` come to it.
- ``serial``: ``gradmap.tmap(f, items, executor="serial")`` (the map's machinery, no threads),
  with ``torch.set_num_threads(1)`` as ``loop1``: against ``loop1`` it is gradmap's own work,
  whatever two intra-op threads do to the element (a GRU's forward is slower on two, ragged
  bags' faster).
- ``remat``: ``gradmap.tmap(f, items, remat=True)``: no graph kept; the backward recomputes.
- ``vmap``: ``torch.func.vmap`` over a padded and masked batch (bags only).
- ``tmap:W`` and ``tmap-proc:W``: ``tmap`` with ``workers=W`` on threads and on processes (the
  workers sweep behind ``--plot``; on processes ``W`` counts the caller, so ``W=1`` is one
  process and ``W=2`` one process and the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradmap.bench.workloads import Workload

__all__ = ["BASELINES", "VARIANT_NAMES", "Variant", "build_variants", "loop_loss"]

VARIANT_NAMES = (
    "loop1",
    "loop",
    "tmap",
    "tsum",
    "tmap-proc",
    "tsum-proc",
    "raw",
    "serial",
    "remat",
    "vmap",
)
"""Variants selectable with ``--variants``, in the order they are run."""

BASELINES = ("loop1", "loop")
"""Variants the baseline is chosen from: the faster of the two plain loops."""

TotalLoss = Callable[[Workload[Any]], Tensor]


@dataclass(frozen=True)
class Variant:
    """One way of computing the total loss.

    Attributes:
        name: Short identifier shown in the table.
        total_loss: Computes the total loss of a workload (forward only).
        intra_op_threads: ``torch.set_num_threads`` value while the variant runs; ``None`` keeps
            the default.
        needs_batched: Whether the variant needs ``Workload.batched_loss``.
        workers: The ``workers`` argument given to ``tmap``, for the workers sweep.
        settle: Untimed calls before the warm-up: a map on threads measures its forward's
            placement on its first five calls (NOTE [forward placement]), and the bench times
            the steady state.
    """

    name: str
    total_loss: TotalLoss
    intra_op_threads: int | None = None
    needs_batched: bool = False
    workers: int | None = None
    settle: int = 0

    def applies_to(self, workload: Workload[Any]) -> bool:
        """Return whether the variant can run ``workload``."""
        return workload.has_batched or not self.needs_batched

    @contextmanager
    def settings(self) -> Iterator[None]:
        """Apply the variant's torch settings for the duration of the block, then restore them."""
        if self.intra_op_threads is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(self.intra_op_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)


def loop_loss(workload: Workload[Any]) -> Tensor:
    """Total loss with a plain Python loop: what users write without gradmap."""
    return torch.stack([workload.f(item) for item in workload.items]).sum()


def batched_loss(workload: Workload[Any]) -> Tensor:
    """Total loss with the workload's padded ``torch.func.vmap`` formulation."""
    return workload.batched_loss(workload.items)


def _import_tmap() -> Callable[..., list[Any]]:
    """Return ``gradmap.tmap``, with a clear error while it is missing."""
    try:
        from gradmap import tmap
    except ImportError as error:
        raise RuntimeError(
            "gradmap.tmap cannot be imported; to run without it, pick variants with "
            "--variants loop1,loop,vmap"
        ) from error
    return tmap  # type: ignore[no-any-return]


def _tmap_loss(
    tmap: Callable[..., list[Any]], executor: str | None, workers: int | None, remat: bool = False
) -> TotalLoss:
    """Build a total-loss function mapping ``f`` with ``tmap`` on the given executor."""

    def total_loss(workload: Workload[Any]) -> Tensor:
        losses = tmap(workload.f, workload.items, executor=executor, workers=workers, remat=remat)
        return torch.stack(losses).sum()

    return total_loss


def _tsum_loss(executor: str | None, workers: int | None) -> TotalLoss:
    """Build a total-loss function summing ``f`` with ``tsum`` on the given executor."""
    from gradmap import tsum

    def total_loss(workload: Workload[Any]) -> Tensor:
        return tsum(workload.f, workload.items, executor=executor, workers=workers)  # type: ignore[no-any-return]

    return total_loss


class _Precomputed(torch.autograd.Function):
    """A loss whose gradients to ``params`` were computed already: its backward scales them."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, grads: list[Tensor | None], *params: Tensor) -> Tensor:
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx: Any, cotangent: Tensor) -> tuple[Any, ...]:
        return (None, None, *(None if g is None else cotangent * g for g in ctx.grads))


def _raw_threads_loss(workers: int | None) -> TotalLoss:
    """Build the ``raw`` variant: a chunked loop on plain threads, without gradmap."""

    def total_loss(workload: Workload[Any]) -> Tensor:
        import os
        import threading

        f, items, params = workload.f, workload.items, workload.params()
        count = workers or max(1, len(os.sched_getaffinity(0)))
        size = max(1, len(items) // (4 * count))  # a few chunks per thread: balance
        starts = iter(range(0, len(items), size))
        claim = threading.Lock()
        parts: list[tuple[Tensor, list[Tensor | None]]] = []
        failures: list[BaseException] = []

        def work() -> None:
            try:
                with torch.enable_grad():
                    while True:
                        with claim:
                            start = next(starts, None)
                        if start is None:
                            return
                        loss = torch.stack([f(x) for x in items[start : start + size]]).sum()
                        grads = torch.autograd.grad(loss, params, allow_unused=True)
                        with claim:
                            parts.append((loss.detach(), list(grads)))
            except BaseException as exc:  # re-raised in the caller
                failures.append(exc)

        threads = [threading.Thread(target=work) for _ in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        value = sum((v for v, _ in parts), torch.zeros(()))
        summed: list[Tensor | None] = [None] * len(params)
        for _, grads in parts:
            for j, g in enumerate(grads):
                if g is not None:
                    summed[j] = g if summed[j] is None else summed[j] + g  # type: ignore[operator]
        return _Precomputed.apply(value, summed, *params)  # type: ignore[no-any-return]

    return total_loss


def build_variants(
    names: Sequence[str],
    workers: int | None = None,
    sweep: Sequence[int] = (),
    executor: str | None = None,
) -> list[Variant]:
    """Build the variants to run.

    Arguments:
        names: Names out of ``VARIANT_NAMES``; run in the order of ``VARIANT_NAMES``.
        workers: ``workers`` for the ``tmap`` variant (``None``: the pool's default).
        sweep: Worker counts for extra ``tmap:W`` variants (for the speed-up plot).
        executor: ``tmap``'s executor for the ``tmap`` and ``remat`` variants (``None``: the
            shared thread pool; ``"ray"``: Ray actors).

    Returns:
        The variants.

    Raises:
        ValueError: Unknown variant name.
        RuntimeError: A ``tmap`` variant was asked for and ``gradmap.tmap`` cannot be imported.
    """
    unknown = sorted(set(names) - set(VARIANT_NAMES))
    if unknown:
        raise ValueError(
            f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANT_NAMES)}"
        )
    uses_tmap = {"tmap", "tmap-proc", "serial", "remat"} & set(names)
    tmap = _import_tmap() if uses_tmap or sweep else None
    variants = []
    for name in VARIANT_NAMES:
        if name not in names:
            continue
        if name == "loop1":
            variants.append(Variant(name, loop_loss, intra_op_threads=1))
        elif name == "loop":
            variants.append(Variant(name, loop_loss))
        elif name == "tmap":
            assert tmap is not None
            variants.append(
                Variant(name, _tmap_loss(tmap, executor, workers), workers=workers, settle=4)
            )
        elif name == "tsum":
            variants.append(Variant(name, _tsum_loss(executor, workers), workers=workers, settle=4))
        elif name == "tmap-proc":
            assert tmap is not None
            variants.append(Variant(name, _tmap_loss(tmap, "processes", workers), workers=workers))
        elif name == "tsum-proc":
            variants.append(Variant(name, _tsum_loss("processes", workers), workers=workers))
        elif name == "raw":
            variants.append(Variant(name, _raw_threads_loss(workers), intra_op_threads=1))
        elif name == "serial":
            assert tmap is not None
            variants.append(Variant(name, _tmap_loss(tmap, "serial", None), intra_op_threads=1))
        elif name == "remat":
            assert tmap is not None
            variants.append(
                Variant(name, _tmap_loss(tmap, executor, workers, remat=True), settle=4)
            )
        elif name == "vmap":
            variants.append(Variant(name, batched_loss, needs_batched=True))
    for count in sweep:
        assert tmap is not None
        variants.append(
            Variant(f"tmap:{count}", _tmap_loss(tmap, None, count), workers=count, settle=4)
        )
    for count in sweep:
        assert tmap is not None
        variants.append(
            Variant(f"tmap-proc:{count}", _tmap_loss(tmap, "processes", count), workers=count)
        )
    return variants
