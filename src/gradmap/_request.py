"""One call of ``tmap`` or ``tsum`` as a rule receives it: what the API checked and prepared."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._executors import Executor
from ._plan import ChunkPlan

__all__ = ["MapRequest"]


@dataclass(frozen=True)
class MapRequest:
    """``f``, the elements (one argument tuple each), the executor, the chunk plan for
    ``len(elements)``, and the call's options; ``api`` names the call in errors and notes."""

    f: Callable[..., Any]
    elements: Sequence[tuple[Any, ...]]
    executor: Executor
    plan: ChunkPlan
    api: str
    remat: bool = False  # keep no graph; recompute each chunk in the backward
    progress: Any = False  # the API's ``progress`` argument
    placement: str = "auto"  # "one", "many" or "auto" (NOTE [forward placement])
