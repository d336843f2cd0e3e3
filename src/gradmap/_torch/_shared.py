"""State that every thread of the process shares, written by ``f``: how a map finds it.

NOTE [process-wide state f writes]:
    Threads of one process share every module and class. A library that keeps the state of a
    call there -- pyro's effect-handler stack (``_PYRO_STACK``, pushed by every ``poutine``
    handler's ``__enter__``), gpytorch's and linear_operator's settings (classes whose
    ``__enter__`` writes a class attribute that ``__exit__`` restores, entered by botorch around
    every posterior), PyTorch's process-wide switches -- is not safe for two elements at once:
    one element's exit restores a setting under another, a trace records the other's sites. A
    plain thread pool then gives wrong values or gradients, without an error. gradmap cannot lock
    code it did not write, so it looks: the first forward of each kind of map runs in one thread
    (NOTE [forward placement]), and there a profile hook (``sys.setprofile``, that thread only)
    compares, around every ``__enter__`` and ``__exit__``, the dictionaries of the object's
    classes and the globals of the modules its methods (or generator) live in -- each binding,
    and the length of lists, dicts and sets -- and notes calls of PyTorch's process-wide setters.
    A change marks ``f`` (``Placement.shared``): from then on its forwards stay in one thread,
    its recomputes run one at a time, and its chunks are pulled back after the forward rather
    than during it (a backward may read what a forward entered); its backward stays parallel. A
    warning says so once per ``f``, naming the state and ``executor='processes'``, where each
    worker is a process of its own. Not seen: state written outside an enter or exit (but for the
    setters), the standard library's, gradmap's and PyTorch's private modules' (the compiler's
    configuration), a first forward that touches none, and any forward under another profiler.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .._placement import user_stacklevel

__all__ = ["Watch", "warn_shared"]

_SIZED = frozenset({list, dict, set, collections.deque, collections.OrderedDict})
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"builtins", "gradmap"}
#: Modules of PyTorch whose globals change for reasons of PyTorch's own (compilation, tracing),
#: or which gradmap guards already (``torch.random``: NOTE [random numbers of recomputes]).
_TORCH_OWN = (
    "torch.fx",
    "torch.export",
    "torch.jit",
    "torch.onnx",
    "torch.random",
    "torch.compiler",
)
#: A call into these stops the watch for the rest of the element: a compilation (``torch.compile``
#: compiles in the thread of the call) makes a great many calls, each of them an event.
_COMPILER = ("torch._dynamo", "torch._inductor")


def _setters() -> frozenset[Any]:
    """The code of PyTorch's Python functions that change a process-wide setting."""
    found = []
    for owner, name in [
        (torch, "set_default_dtype"),
        (torch, "set_default_tensor_type"),
        (torch, "use_deterministic_algorithms"),
        (torch, "set_deterministic_debug_mode"),
        (torch, "set_float32_matmul_precision"),
        (getattr(torch.backends, "ContextProp", None), "__set__"),
    ]:
        code = getattr(getattr(owner, name, None), "__code__", None)
        if code is not None:
            found.append(code)
    return frozenset(found)


_SETTER_CODES = _setters()
#: PyTorch's process-wide setters written in C.
_C_SETTERS = frozenset(
    f for f in (getattr(torch, "set_flush_denormal", None), torch._C._set_default_dtype) if f
)


def _ignored(module: object) -> bool:
    """Whether a module's state is none of ``f``'s concern (NOTE [process-wide state f
    writes])."""
    if not isinstance(module, str):
        return True
    top = module.partition(".")[0]
    if top in _STDLIB:
        return True
    if top == "torch":
        return module.startswith(_TORCH_OWN) or any(p.startswith("_") for p in module.split("."))
    return False


#: An owner of state (a class, or a module's globals) and its bindings: name -> (id, length).
_Shot = list[tuple[Any, str, dict[str, tuple[int, int]]]]


def _bindings(d: Any) -> dict[str, tuple[int, int]]:
    return {k: (id(v), len(v) if type(v) in _SIZED else -1) for k, v in list(d.items())}


def _owners(frame: types.FrameType) -> list[tuple[Any, str]]:
    """What an ``__enter__``/``__exit__`` may write: the classes of its ``self`` and the
    globals of the modules its code, its class and (for ``contextlib.contextmanager``) its
    generator live in; each with a name for messages."""
    owners: list[tuple[Any, str]] = []
    seen: set[int] = set()

    def module_globals(g: Any) -> None:
        if isinstance(g, dict) and id(g) not in seen and not _ignored(g.get("__name__")):
            seen.add(id(g))
            owners.append((g, str(g.get("__name__"))))

    module_globals(frame.f_globals)
    this = frame.f_locals.get("self")
    if this is None:
        return owners
    cls = type(this)
    for c in cls.__mro__:
        if c is not object and not _ignored(getattr(c, "__module__", None)):
            owners.append((c, f"{c.__module__}.{c.__qualname__}"))
    module = sys.modules.get(getattr(cls, "__module__", ""))
    if module is not None:
        module_globals(vars(module))
    gen = getattr(this, "gen", None)  # contextlib's generator-based context managers
    gen_frame = getattr(gen, "gi_frame", None)
    if gen_frame is not None:
        module_globals(gen_frame.f_globals)
    return owners


def _shot(frame: types.FrameType) -> _Shot:
    out: _Shot = []
    for owner, name in _owners(frame):
        d = owner if isinstance(owner, dict) else vars(owner)
        out.append((owner, name, _bindings(d)))
    return out


def _changed(before: _Shot) -> str | None:
    """The first binding of ``before``'s owners that is another now, named."""
    for owner, name, bindings in before:
        now = _bindings(owner if isinstance(owner, dict) else vars(owner))
        if now != bindings:
            key = next(k for k in {*now, *bindings} if now.get(k) != bindings.get(k))
            what = "class" if isinstance(owner, type) else "module"
            return f"{key!r} of the {what} {name}"
    return None


class Watch:
    """Watches forwards in the threads that enter it for writes to process-wide state (NOTE
    [process-wide state f writes]); ``found`` names the first one seen."""

    def __init__(self) -> None:
        self.found: str | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Within it (around one element), this thread's calls are watched (not under another
        profiler, nor once something was found)."""
        if self.found is not None or sys.getprofile() is not None:
            yield
            return
        stack: list[tuple[types.FrameType, _Shot]] = []

        def event(frame: types.FrameType, kind: str, arg: Any) -> None:
            if kind == "call":
                code = frame.f_code
                name = code.co_name
                if str(frame.f_globals.get("__name__")).startswith(_COMPILER):
                    sys.setprofile(None)  # (for the rest of the element)
                    stack.clear()
                elif name == "__enter__" or name == "__exit__":
                    stack.append((frame, _shot(frame)))
                elif code in _SETTER_CODES:
                    self._found(f"a call of {getattr(code, 'co_qualname', name)}")
            elif kind == "return":
                if stack and stack[-1][0] is frame:
                    where, before = stack.pop()
                    if self.found is None:
                        changed = _changed(before)
                        if changed is not None:
                            self._found(f"{changed}, changed by {where.f_code.co_name}")
            elif kind == "c_call" and arg in _C_SETTERS:
                self._found(f"a call of torch.{getattr(arg, '__name__', arg)}")

        sys.setprofile(event)
        try:
            yield
        finally:
            sys.setprofile(None)

    def _found(self, what: str) -> None:
        if self.found is None:
            self.found = what


_warned: set[Any] = set()
_warned_lock = threading.Lock()


def warn_shared(key: Any, api: str, found: str) -> None:
    """Say once per ``f`` (``key``) that its forwards stay in one thread, and why."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        f"{api}: f changes state that every thread of this process shares ({found}): "
        "a library f calls keeps the state of a call in a class or module (pyro's handler "
        "stack, gpytorch's settings, ...), and two elements on two threads at once would see "
        "each other's, giving other values or gradients than the loop, without an error. "
        "gradmap runs f's forwards in one thread from now on and pulls its chunks back in "
        "parallel after the forward. For forwards in parallel, use executor='processes' "
        "(each worker a process of its own).",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
