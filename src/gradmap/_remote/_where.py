"""Where a worker holds a tensor that did not come from the caller, for ``ForeignTensorError``.

NOTE [where a foreign tensor lives]:
    A tensor that requires grad and did not travel from the caller is a worker's own: a global
    of a module imported by reference, something a library keeps per process (pyro's param
    store), a cache of ``f``'s. Its shape alone names nothing, so on the error path (only there:
    it reads every module) the worker looks for the very tensor object among what ``f`` names
    (its closure, the globals its code reads, a module sent by value among them) and the globals
    of ``sys.modules``, then one and two levels into them (containers' items, objects' attributes,
    a module's parameters), breadth first, to a bound on the objects looked at. A library known
    to keep such tensors one per process and not safe on threads gets its own advice: for pyro's
    param store not ``executor='threads'``, where every thread would share one store.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections import deque
from typing import Any

import torch

__all__ = ["pyro_param_name", "where_held"]

#: How many objects a search looks at, at most (every module's globals count).
_MAX_OBJECTS = 200_000
#: How deep below a module's globals it looks.
_DEPTH = 2
_SKIP = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
)


def where_held(t: torch.Tensor, f: Any = None) -> str | None:
    """A path to ``t`` from ``f``'s closure or globals or a module's globals
    (``package.module.NAME._params['loc']``), or ``None`` if none within the bounds holds it
    (NOTE [where a foreign tensor lives])."""
    with warnings.catch_warnings():  # (deprecated globals warn when looked at)
        warnings.simplefilter("ignore")
        return _search(t, f)


def _roots(f: Any) -> list[tuple[str, Any]]:
    """Where a search starts: what ``f`` names (its closure's cells, the globals its code
    reads), then every imported module's globals; a module among them (one sent by value is in
    no ``sys.modules``) by its globals."""
    roots: list[tuple[str, Any]] = []
    code = getattr(f, "__code__", None)
    if isinstance(f, types.FunctionType) and code is not None:
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            with contextlib.suppress(ValueError):  # (an empty cell)
                roots.append((name, cell.cell_contents))
        scope = f.__globals__
        roots += [(name, scope[name]) for name in code.co_names if name in scope]
    elif f is not None:
        roots.append(("f", f))
    roots += [(name, module) for name, module in list(sys.modules.items())]
    found: list[tuple[str, Any]] = []
    for name, value in roots:
        if isinstance(value, types.ModuleType):
            try:
                scope = vars(value)
            except TypeError:
                continue
            found += [(f"{name}.{key}", v) for key, v in list(scope.items())]
        else:
            found.append((name, value))
    return found


def _search(t: torch.Tensor, f: Any) -> str | None:
    queue: deque[tuple[Any, str, int]] = deque()
    seen: set[int] = set()
    for path, value in _roots(f):
        if value is t:
            return path
        queue.append((value, path, 0))
    looked = 0
    while queue and looked < _MAX_OBJECTS:
        obj, path, depth = queue.popleft()
        if depth >= _DEPTH or id(obj) in seen or isinstance(obj, _SKIP) or obj is None:
            continue
        seen.add(id(obj))
        looked += 1
        for step, value in _children(obj):
            if value is t:
                return path + step
            if not isinstance(value, (torch.Tensor, *_SKIP)):
                queue.append((value, path + step, depth + 1))
    return None


def _children(obj: Any) -> list[tuple[str, Any]]:
    """The items of a container, or the attributes of an object, with the step to each."""
    try:
        if isinstance(obj, dict):
            return [(f"[{k!r}]", v) for k, v in list(obj.items())[:1000]]
        if isinstance(obj, (list, tuple)):
            return [(f"[{i}]", v) for i, v in enumerate(obj[:1000])]
        if isinstance(obj, torch.nn.Module):  # its tensors by name, at any depth
            tensors = [*obj.named_parameters(), *obj.named_buffers()]
            return [(f".{k}", v) for k, v in tensors[:1000]]
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(obj, torch.Tensor):
            return [(f".{k}", v) for k, v in list(attrs.items())[:1000]]
    except Exception:  # (an object whose items or attributes raise: nothing to find there)
        pass
    return []


def pyro_param_name(t: torch.Tensor) -> str | None:
    """The name of ``t`` in this process's pyro param store, if it is one of its parameters."""
    pyro = sys.modules.get("pyro")
    get_store = getattr(pyro, "get_param_store", None)
    if get_store is None:
        return None
    try:
        name = get_store().param_name(t)
    except Exception:  # (another pyro: no such lookup)
        return None
    return name if isinstance(name, str) else None
