"""The zip of the iterables, with JAX arrays split over their first dimension.

``gradmap._items.zip_items`` does the zip, ``strict`` and its errors; this module only says what
a JAX array is (concrete or a tracer) and how it splits into rows, as the torch adapter unbinds
tensors. Under differentiation the split is part of the caller's trace, so the gradient of the
rows flows back to the whole array.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from .._items import ArrayKind, zip_items

__all__ = ["zip_jax_items"]

JAX_ARRAYS = ArrayKind(
    noun="array",
    recognises=lambda x: isinstance(x, jax.Array),
    length=lambda x: int(x.shape[0]),
    rows=list,
    example="x.reshape(1)",
)


def zip_jax_items(
    iterables: tuple[Iterable[Any], ...], strict: bool, api: str
) -> list[tuple[Any, ...]]:
    """The argument tuples of every element: ``list(zip(*iterables, strict=strict))``, with
    JAX arrays iterated over their first dimension.

    Arguments:
        iterables: the map's iterables.
        strict: require equal lengths.
        api: the function named in error messages (``gradmap.jax.tmap``, ``gradmap.jax.tsum``).

    Returns:
        One tuple of items per element.
    """
    return list(zip_items(iterables, strict, api=api, arrays=JAX_ARRAYS))
