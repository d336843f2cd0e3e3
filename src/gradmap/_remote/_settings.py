"""Module settings ``f`` reads, as the caller sees them, checked where a worker runs ``f``.

NOTE [settings a worker imports anew]
cloudpickle sends a function of an importable module by reference (its module and name): a
worker process imports the module itself, so the module's globals there hold their import-time
values. A setting the caller changed at run time (``mymod.SCALE = 3.0``, ``mymod.CONF["k"] =
2``) is then another value in the workers than in the loop, and the results differ silently (the
caller's own chunks see the caller's value, so even one map mixes both). Tensors that require
grad are caught by the worker's boundary (``ForeignTensorError``); plain data and other CPU
tensors (by a digest of their bytes: NOTE [tensor settings]) are not, so the
caller lists, per call, the plain-data globals that the functions it can see read: ``f`` (or its
``__call__``/``forward`` and the other methods of its classes and of its submodules' classes)
and the functions of the same kind those name, a few levels deep, each as ``(module, name,
repr(value))``. A global those functions assign (``global n; n += 1``) is state they keep, not a
setting, and is left out. A worker compares them with its own modules once per call and raises
``WorkerViewError`` naming each setting that differs and the fix (an argument or closure value,
or ``cloudpickle.register_pickle_by_value``). Functions sent by value (``__main__``, closures,
lambdas, registered modules) carry their globals' current values and are not listed. What a
function reaches only through an object attribute or another module's helper outside the listed
functions is not checked: the README says how to pass settings.
"""

from __future__ import annotations

import dis
import functools
import importlib
import sys
import types
import weakref
from typing import Any

from cloudpickle import cloudpickle as _cloudpickle

__all__ = ["WorkerViewError", "check_settings", "settings_of"]

#: A setting: the module's name, the global's name, the value's ``repr``.
Setting = tuple[str, str, str]

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_MAX_FUNCTIONS = 64  # functions looked at per call
_MAX_ITEMS = 256  # elements of a container setting
_MAX_REPR = 2000  # characters of a setting's repr
_DEPTH = 3  # levels of functions followed through globals


class WorkerViewError(RuntimeError):
    """A module setting ``f`` reads differs between the caller and a worker process."""


def settings_of(f: Any) -> tuple[Setting, ...]:
    """The plain-data module globals that ``f``'s functions sent by reference read, as the
    caller sees them now (NOTE [settings a worker imports anew])."""
    functions = _functions(f)
    if not functions:
        return ()
    found: dict[tuple[str, str], str] = {}
    seen: set[int] = set()
    todo = [(fn, 0) for fn in functions]
    while todo and len(seen) < _MAX_FUNCTIONS:
        fn, depth = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        module = fn.__module__
        if module.partition(".")[0] in _SKIPPED:
            continue
        namespace = fn.__globals__
        for name in _names(fn.__code__):
            value = namespace.get(name, _MISSING)
            if isinstance(value, types.FunctionType):
                if depth < _DEPTH and _by_reference(value):
                    todo.append((value, depth + 1))
            elif value is not _MISSING:
                text = _text(value)
                if text is not None and len(text) <= _MAX_REPR:
                    found[module, name] = text
    return tuple((m, n, v) for (m, n), v in found.items())


def check_settings(settings: tuple[Setting, ...], api: str) -> None:
    """In a worker: raise ``WorkerViewError`` if a setting the caller listed has another value
    in this process."""
    differ = []
    for module, name, text in settings:
        namespace = sys.modules.get(module)
        if namespace is None:
            try:
                namespace = importlib.import_module(module)
            except Exception:
                continue
        value = vars(namespace).get(name, _MISSING)
        mine = "<not set>" if value is _MISSING else (_text(value) or repr(value))
        if mine != text:
            differ.append(
                f"{module}.{name} is {_short(text)} in the caller but {_short(mine)} in the workers"
            )
    if differ:
        raise WorkerViewError(
            f"{api}: f reads module settings that differ in the worker processes (the results "
            "would differ from the loop's): "
            + "; ".join(differ)
            + ". Functions of importable modules travel by reference, and a worker imports their "
            "module anew, with its import-time values. Pass the setting to f as an argument or a "
            "closure value (functools.partial), or register the module with "
            "cloudpickle.register_pickle_by_value(module), or use executor='threads'"
        )


_MISSING = object()


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _functions(f: Any) -> list[types.FunctionType]:
    """The functions of ``f`` sent by reference: ``f`` itself, a bound method's function, a
    partial's function, and the methods of an object's classes (and of its submodules')."""
    out: list[types.FunctionType] = []
    while isinstance(f, types.MethodType) or _is_partial(f):
        if isinstance(f, types.MethodType):
            objects = [f.__self__]
            f = f.__func__
        else:
            objects = []
            f = f.func
        for obj in objects:
            out.extend(_methods(obj))
    if isinstance(f, types.FunctionType):
        if _by_reference(f):
            out.append(f)
    elif not isinstance(f, (types.BuiltinFunctionType, type)):
        out.extend(_methods(f))
    return out


def _is_partial(f: Any) -> bool:
    return isinstance(f, functools.partial)


def _methods(obj: Any) -> list[types.FunctionType]:
    classes: set[type] = {type(obj)}
    torch_nn = sys.modules.get("torch.nn")
    if torch_nn is not None and isinstance(obj, torch_nn.Module):
        classes.update(type(m) for m in obj.modules())
    out = []
    for cls in classes:
        out.extend(_class_functions(cls))
    return out


_class_functions_kept: weakref.WeakKeyDictionary[type, list[types.FunctionType]] = (
    weakref.WeakKeyDictionary()
)


def _class_functions(cls: type) -> list[types.FunctionType]:
    """The functions of ``cls`` and its bases that are sent by reference, leaving out the
    standard library's, torch's and gradmap's classes (read once per class)."""
    kept = _class_functions_kept.get(cls)
    if kept is not None:
        return kept
    out = []
    for klass in cls.__mro__:
        if klass.__module__.partition(".")[0] in _SKIPPED or not _by_reference(klass):
            continue
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, types.FunctionType):
                out.append(value)
    _class_functions_kept[cls] = out
    return out


_SKIPPED = frozenset(sys.stdlib_module_names) | {"torch", "gradmap"}


def _by_reference(obj: Any) -> bool:
    try:
        return bool(_cloudpickle._should_pickle_by_reference(obj))
    except Exception:
        return False


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` and the code nested in it (lambdas, comprehensions) load and
    do not assign (a global the function assigns is state it keeps, such as a counter, not a
    setting)."""
    loads, stores = _uses(code)
    return tuple(sorted(loads - stores))


def _uses(code: types.CodeType) -> tuple[set[str], set[str]]:
    loads: set[str] = set()
    stores: set[str] = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            loads.add(ins.argval)
        elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_loads, inner_stores = _uses(const)
            loads |= inner_loads
            stores |= inner_stores
    return loads, stores


def _text(value: Any) -> str | None:
    """What is compared of a setting: a plain value's ``repr``; a tensor's dtype, shape and a
    digest of its bytes (NOTE [tensor settings]); ``None`` for anything else."""
    if _plain(value, [0]):
        return repr(value)
    torch = sys.modules.get("torch")
    if torch is not None and type(value) is torch.Tensor:
        return _tensor_text(value)
    return None


#: NOTE [tensor settings]: a module-global tensor ``f`` reads (``mymod.MEAN``, changed in place
#: or rebound by the caller) is another tensor in a worker, which imported the module anew: the
#: results differed from the loop's, silently (one that requires grad is refused at the
#: boundary, ``ForeignTensorError``; this is for the others). It is compared by a digest of its
#: bytes, kept while the tensor's version and data are the same (a caller's tensor is hashed
#: once until it changes; the worker's own, once). Up to ``_MAX_DIGEST`` bytes; larger ones
#: (and those on other devices or with other layouts) are not checked.
_MAX_DIGEST = 64 * 2**20
_digests: dict[int, tuple[Any, int, int, str]] = {}


def _tensor_text(t: Any) -> str | None:
    import hashlib

    import torch

    from ._pickling import raw_bytes

    if t.requires_grad or t.device.type != "cpu" or t.layout != torch.strided:
        return None
    if t.numel() * t.element_size() > _MAX_DIGEST:
        return None
    kept = _digests.get(id(t))
    if kept is not None and kept[0]() is t and kept[1:3] == (t._version, t.data_ptr()):
        return kept[3]
    flat = t.detach().resolve_conj().resolve_neg().contiguous()
    digest = hashlib.blake2b(raw_bytes(flat), digest_size=16).hexdigest()
    text = f"tensor(dtype={t.dtype}, shape={tuple(t.shape)}, bytes {digest})"
    if len(_digests) > 1024:
        _digests.clear()
    _digests[id(t)] = (weakref.ref(t), t._version, t.data_ptr(), text)
    return text


def _plain(value: Any, count: list[int]) -> bool:
    """Plain data: scalars, strings, and tuples, lists and dicts of them (no sets: their repr
    depends on the process's string hashing)."""
    count[0] += 1
    if count[0] > _MAX_ITEMS:
        return False
    if type(value) in _PLAIN:
        return True
    if type(value) in (tuple, list):
        return all(_plain(v, count) for v in value)
    if type(value) is dict:
        return all(_plain(k, count) and _plain(v, count) for k, v in value.items())
    return False
