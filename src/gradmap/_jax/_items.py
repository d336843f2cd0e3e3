"""The zip of ``tmap``'s iterables, with JAX arrays split over their first dimension.

``gradmap._api.zip_items`` does the zip, ``strict`` and its errors; this module only turns each
JAX array (concrete or a tracer) into the list of its rows first, as the torch adapter unbinds
tensors. Under differentiation the split is part of the caller's trace, so the gradient of the
rows flows back to the whole array.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from .._api import zip_items

__all__ = ["zip_jax_items"]


def _rows(arg: Any, position: int) -> Any:
    if not isinstance(arg, jax.Array):
        return arg
    if arg.ndim == 0:
        raise TypeError(
            f"gradmap.jax.tmap: iterable {position} is a 0-d array, which has no first dimension "
            "to map over; pass an array with at least one dimension (e.g. x.reshape(1)) or a list"
        )
    return list(arg)


def zip_jax_items(iterables: tuple[Iterable[Any], ...], strict: bool) -> list[tuple[Any, ...]]:
    """The argument tuples of every element: ``list(zip(*iterables, strict=strict))``, with JAX
    arrays iterated over their first dimension.

    Arguments:
        iterables: ``tmap``'s iterables.
        strict: require equal lengths.

    Returns:
        One tuple of items per element.
    """
    return zip_items(tuple(_rows(arg, i) for i, arg in enumerate(iterables)), strict)
