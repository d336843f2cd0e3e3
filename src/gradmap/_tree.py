"""Pytrees of items and results: tuples, lists, dicts, namedtuples, with any leaves.

A thin layer over ``torch.utils._pytree``: a bare tensor (by far the most common item and result)
skips the generic flatten, which costs a few microseconds per call on the hot path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["Spec", "flatten", "unflatten"]

#: ``None`` for a bare tensor, else the pytree spec.
Spec = pytree.TreeSpec | None


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
