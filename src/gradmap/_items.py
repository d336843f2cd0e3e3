"""The zip of a map's iterables: framework-free, shared by every adapter.

Arrays (PyTorch tensors, JAX arrays) are iterated over their first dimension. Each adapter says
which objects are its arrays with an [`ArrayKind`][]; the default one recognises PyTorch tensors
without importing PyTorch (an object can only be a tensor if ``torch`` is already imported), so
``gradmap.jax`` never pulls PyTorch in.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from ._errors import add_note

__all__ = ["TORCH_TENSORS", "ArrayKind", "Singles", "zip_items"]


@dataclass(frozen=True)
class ArrayKind:
    """The arrays of one framework, as a map's iterables.

    Attributes:
        noun: what the error messages call them ("tensor", "array").
        recognises: whether an iterable is such an array.
        length: its first dimension.
        rows: its slices along the first dimension (the gradient flows back to the whole array).
        example: how to make a 0-d array 1-d, for the error message.
    """

    noun: str
    recognises: Callable[[Any], bool]
    length: Callable[[Any], int]
    rows: Callable[[Any], Sequence[Any]]
    example: str


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # not imported: x cannot be a tensor
    return torch is not None and isinstance(x, torch.Tensor)


TORCH_TENSORS = ArrayKind(
    noun="tensor",
    recognises=_is_torch_tensor,
    length=lambda t: int(t.shape[0]),
    rows=lambda t: t.unbind(0),
    example="t.reshape(1)",
)


class Singles(Sequence[tuple[Any, ...]]):
    """The argument tuples of a map over one iterable, kept as the list of its items.

    A tuple per element would be one more object kept for the length of the map, which the
    cyclic collector counts (NOTE [a chunk of bare tensors] in ``_torch/_chunk``); a rule's
    hot loop calls ``f(items[i])`` on ``items`` directly, and anything else sees the tuples,
    made as they are read.
    """

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, i: int) -> tuple[Any, ...]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[Any, ...]]: ...

    def __getitem__(self, i: int | slice) -> tuple[Any, ...] | list[tuple[Any, ...]]:
        if isinstance(i, slice):
            return [(x,) for x in self.items[i]]
        return (self.items[i],)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return ((x,) for x in self.items)


def zip_items(
    iterables: tuple[Iterable[Any], ...],
    strict: bool,
    *,
    api: str = "gradmap.tmap",
    arrays: ArrayKind = TORCH_TENSORS,
) -> Sequence[tuple[Any, ...]]:
    """The argument tuples of every element: ``list(zip(*iterables, strict=strict))`` with
    arrays iterated over their first dimension and clearer errors.

    Arguments:
        iterables: the map's iterables.
        strict: require equal lengths.
        api: the function named in error messages.
        arrays: the arrays that are split over their first dimension.

    Returns:
        One tuple of items per element.
    """
    if not iterables:
        raise TypeError(f"{api}: expected at least one iterable after f")
    sources = [_as_iterable(a, i, api, arrays) for i, a in enumerate(iterables)]
    lengths = [_length(a, arrays) for a in iterables]
    if strict and None not in lengths and len(set(lengths)) > 1:
        raise ValueError(
            f"{api}(strict=True): the iterables have different lengths: {_describe(lengths)}"
        )
    if len(sources) == 1:
        return Singles(_read(iter(sources[0]), api))
    elements: list[tuple[Any, ...]] = []
    iterator = iter(zip(*sources, strict=strict))
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
                    f"{api}(strict=True): the iterables have different lengths: "
                    f"{_describe(counts)} ({exc})"
                ) from None
            _note_reading(exc, len(elements), api)
            raise
        except Exception as exc:
            _note_reading(exc, len(elements), api)
            raise
        elements.append(element)
    return elements


def _read(iterator: Iterator[Any], api: str) -> list[Any]:
    """The items of one iterable, an error while reading one noted with its position."""
    if isinstance(iterator, (type(iter([])), type(iter(())))):
        return list(iterator)  # a list's or a tuple's: reading cannot fail
    items: list[Any] = []
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return items
        except Exception as exc:
            _note_reading(exc, len(items), api)
            raise
        items.append(item)


def _as_iterable(arg: Any, position: int, api: str, arrays: ArrayKind) -> Iterable[Any]:
    if arrays.recognises(arg):
        if arg.ndim == 0:
            raise TypeError(
                f"{api}: iterable {position} is a 0-d {arrays.noun}, which has no first "
                f"dimension to map over; pass a {arrays.noun} with at least one dimension "
                f"(e.g. {arrays.example}) or a list"
            )
        return arrays.rows(arg)
    try:
        iter(arg)
    except TypeError:
        raise TypeError(
            f"{api}: iterable {position} is not iterable (got {type(arg).__name__})"
        ) from None
    return arg


def _length(arg: Any, arrays: ArrayKind) -> int | None:
    if arrays.recognises(arg):
        return arrays.length(arg)
    try:
        return len(arg)
    except TypeError:
        return None


def _note_reading(exc: BaseException, index: int, api: str) -> None:
    add_note(exc, f"{api}: raised while reading the items of element {index}; nothing ran")


def _describe(lengths: list[Any]) -> str:
    return ", ".join(f"iterable {i} has {n}" for i, n in enumerate(lengths))
