"""Pytrees of items and results: tuples, lists, dicts, namedtuples, with any leaves.

A thin layer over PyTorch's pytrees -- ``torch.utils._cxx_pytree`` (optree, in C++: about 1 us
for a small namedtuple) when optree is installed, else ``torch.utils._pytree`` (about 4 us); both
know the same node types. A bare tensor (by far the most common item and result) skips the
generic flatten altogether.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

try:
    import torch.utils._cxx_pytree as pytree
except ImportError:  # pragma: no cover - optree missing
    import torch.utils._pytree as pytree  # type: ignore[no-redef]

__all__ = ["Spec", "fill_leaves", "flatten", "unflatten"]

#: ``None`` for a bare tensor, else the pytree spec.
Spec = Any


def flatten(tree: Any) -> tuple[list[Any], Spec]:
    """Leaves of ``tree`` and how to rebuild it."""
    if isinstance(tree, torch.Tensor):
        return [tree], None
    leaves, spec = pytree.tree_flatten(tree)
    return leaves, spec


def unflatten(leaves: list[Any], spec: Spec) -> Any:
    """The tree that [`flatten`][] took apart, with ``leaves`` in place of its leaves."""
    if spec is None:
        return leaves[0]
    return pytree.tree_unflatten(leaves, spec)


def fill_leaves(
    trees: Iterable[tuple[list[Any], Spec, Sequence[int]]], values: Sequence[Any]
) -> list[Any]:
    """Each tree, given as its leaves, its spec and the positions of some of its leaves, rebuilt
    with those leaves replaced by ``values``, taken in order (a join node's outputs put back in
    the results they stand for). The lists of leaves are filled in place."""
    results = []
    j = 0
    for leaves, spec, positions in trees:
        for pos in positions:
            leaves[pos] = values[j]
            j += 1
        results.append(unflatten(leaves, spec))
    return results
