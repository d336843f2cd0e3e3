"""Random numbers in a map: each element draws from a generator of its own.

NOTE [random numbers per element]:
    PyTorch's default CPU generator is one object shared by every thread: elements running at
    once draw from it in an order that depends on timing, so a random ``f`` would give different
    results run to run and worker count to worker count -- and a recompute (``remat=True``, or a
    ``create_graph=True`` backward) could not replay an element's draws the way
    ``torch.utils.checkpoint`` does by saving and restoring the global state, since other threads
    move that state in between.

    So inside a map, an element's random calls on the CPU draw from a ``torch.Generator`` of its
    own, seeded with ``base + i`` where ``base`` is drawn once per map from the global generator
    (on first need, so a map without random calls leaves the global generator untouched). The
    capture mode sees every call: calls that take ``generator=`` get the element's generator
    unless they pass one; dropout, which takes none, is computed as ``x * mask / (1 - p)`` with a
    mask drawn from it (the same function and gradient as ``F.dropout``). Results are then the
    same for every executor, worker count and run, and a recompute replays them exactly. The
    draws are not those of the plain loop. Calls on CUDA tensors keep PyTorch's own generators.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ElementRandom", "MapSeed"]


def _present(owner: Any, names: str) -> list[Any]:
    return [getattr(owner, n) for n in names.split() if hasattr(owner, n)]


_WITH_GENERATOR = frozenset(
    _present(
        torch,
        "rand randn randint randperm rand_like randn_like randint_like normal bernoulli "
        "multinomial poisson",
    )
    + _present(
        torch.Tensor,
        "uniform_ normal_ bernoulli_ random_ exponential_ cauchy_ log_normal_ geometric_ "
        "bernoulli multinomial",
    )
)
_DROPOUT = frozenset([F.dropout, torch.dropout])

RANDOM_CALLS = _WITH_GENERATOR | _DROPOUT


class MapSeed:
    """The seed base of one map: drawn from the global generator on first need, then fixed."""

    def __init__(self) -> None:
        self._base: int | None = None
        self._lock = threading.Lock()

    def base(self) -> int:
        if self._base is None:
            with self._lock:
                if self._base is None:
                    self._base = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        return self._base


class ElementRandom:
    """The generator of one element, made on its first random call."""

    def __init__(self, seed: MapSeed, index: int) -> None:
        self._seed = seed
        self._index = index
        self._generator: torch.Generator | None = None

    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self._seed.base() + self._index)
        return self._generator

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, drawing from this element's generator."""
        if func in _DROPOUT:
            return self._dropout(func, args, kwargs)
        if kwargs.get("generator") is not None or not _on_cpu(args, kwargs):
            return func(*args, **kwargs)
        return func(*args, **{**kwargs, "generator": self.generator()})

    def _dropout(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = ("input", "p", "training", "inplace")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        x = bound["input"]
        p = float(bound.get("p", 0.5))
        training = bool(bound.get("training", func is not torch.dropout))
        if x.device.type != "cpu" or not training or p == 0.0:
            return func(*args, **kwargs)
        if p == 1.0:
            y = x * 0.0
        else:
            mask = torch.empty_like(x).bernoulli_(1.0 - p, generator=self.generator())
            y = x * mask / (1.0 - p)
        if bound.get("inplace", False):
            return x.copy_(y)
        return y


def _on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type == "cpu"
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
    return torch.get_default_device().type == "cpu"
