"""gradmap: a differentiable parallel map -- the chain rule for a multi-threaded map.

The public names are imported on first use (PEP 562), so that ``import gradmap.jax`` does not
import PyTorch: ``gradmap.tmap`` and ``gradmap.tsum`` are PyTorch's, the executors are
framework-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "tmap",
    "tsum",
    "compare",
    "Comparison",
    "Executor",
    "SerialExecutor",
    "ThreadExecutor",
    "FuturesExecutor",
    "ProcessExecutor",
    "RayExecutor",
    "WorkerViewError",
    "ForeignTensorError",
]

#: Public name -> the module that defines it.
_LAZY = {
    "tmap": "._api",
    "tsum": "._api",
    "compare": "._compare",
    "Comparison": "._compare",
    "Executor": "._executors",
    "SerialExecutor": "._executors",
    "ThreadExecutor": "._executors",
    "FuturesExecutor": "._executors",
    "ProcessExecutor": "._process",
    "RayExecutor": "._ray",
    "WorkerViewError": "._remote._settings",
    "ForeignTensorError": "._remote._host",
}

if TYPE_CHECKING:
    from ._api import tmap as tmap
    from ._api import tsum as tsum
    from ._compare import Comparison as Comparison
    from ._compare import compare as compare
    from ._executors import Executor as Executor
    from ._executors import FuturesExecutor as FuturesExecutor
    from ._executors import SerialExecutor as SerialExecutor
    from ._executors import ThreadExecutor as ThreadExecutor
    from ._process import ProcessExecutor as ProcessExecutor
    from ._ray import RayExecutor as RayExecutor
    from ._remote._host import ForeignTensorError as ForeignTensorError
    from ._remote._settings import WorkerViewError as WorkerViewError


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradmap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
