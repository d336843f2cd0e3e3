"""The chunk plan: which elements travel together.

NOTE [chunk boundaries depend on the element count only]:
    Parameter gradients are summed inside a chunk by the autograd engine and across chunks by
    gradmap, in chunk order. For the sum to be bitwise the same for every worker count and every
    run, the chunks must be too: their boundaries are a function of ``n`` (and of an explicit
    ``chunksize``) and of nothing else -- not the worker count, not the cores, not timing.

    The automatic size aims at about ``TARGET_CHUNKS`` chunks: enough that workers rarely idle at
    the end of a ragged map on many cores, few enough that the per-chunk costs (one
    ``autograd.grad`` call and a graph walk, one addition per parameter in the reduction) stay
    small next to the work.

    Consecutive chunks also form *groups* (``ChunkPlan.group`` chunks each, from the plan alone)
    that the sum adds up first (NOTE [chunk-order sum] in ``_join``): a worker process that ran a
    whole group sends the group's gradients once, not once per chunk.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

__all__ = ["GROUPS", "MAX_GROUP", "TARGET_CHUNKS", "ChunkPlan", "check_chunksize", "plan_chunks"]

TARGET_CHUNKS = 64
#: Groups of the sum (NOTE [chunk-order sum] in ``_join``), and the most chunks in one.
GROUPS, MAX_GROUP = 16, 8


@dataclass(frozen=True)
class ChunkPlan:
    """Elements ``0..n-1`` cut into consecutive chunks of ``size`` (the last may be shorter)."""

    n: int
    size: int

    @property
    def count(self) -> int:
        return -(-self.n // self.size) if self.n else 0

    @property
    def group(self) -> int:
        """Chunks per group of the sum: about ``GROUPS`` groups, at most ``MAX_GROUP`` chunks
        each (one for fewer than ``2 * GROUPS`` chunks)."""
        return max(1, min(MAX_GROUP, self.count // GROUPS))

    def bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.size
        return start, min(start + self.size, self.n)


def plan_chunks(n: int, chunksize: int | None = None, api: str = "gradmap.tmap") -> ChunkPlan:
    """Cut ``n`` elements into chunks.

    Arguments:
        n: the number of elements.
        chunksize: elements per chunk; ``None`` for about ``TARGET_CHUNKS`` chunks.
        api: the function named in error messages.

    Returns:
        The plan.
    """
    if chunksize is None:
        return ChunkPlan(n, max(1, -(-n // TARGET_CHUNKS)))
    return ChunkPlan(n, check_chunksize(chunksize, api))


def check_chunksize(chunksize: object, api: str = "gradmap.tmap") -> int:
    """``chunksize`` as an int, or a clear error."""
    if isinstance(chunksize, bool):
        raise TypeError(f"{api}: chunksize must be an int or None, got {chunksize!r}")
    try:
        size = operator.index(chunksize)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{api}: chunksize must be an int or None, got {chunksize!r}") from None
    if size < 1:
        raise ValueError(
            f"{api}: chunksize must be at least 1, got {size}; "
            "pass chunksize=None to let gradmap choose"
        )
    return size
