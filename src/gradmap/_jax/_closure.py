"""What ``f`` closes over: the key its traces are reused under, and the arrays it reaches.

Why this file exists: measured (NOTE [reusing traces across calls]): 250 us a shape, per call.

NOTE [reusing traces across calls]:
    Under differentiation each element is traced (NOTE [hoisting the tracers an element uses]
    in ``_element``), about 250 us of Python per distinct shape. A map in a training step is
    called again and again with a new ``f`` each time -- ``lambda bag: loss(params, bag)``
    closes over the step's tracers -- so keying traces on ``f`` would trace every shape on every
    call. Instead, traces are keyed on what ``f`` *is*: its code, and everything its code can
    reach by name -- closure cells, defaults, the globals its code names -- walked recursively
    through pytrees (tuples, lists, dicts, registered nodes), ``functools.partial``, bound
    methods and the Python functions found there:

    - an array (a JAX array or tracer, a numpy array) is a *channel*: the key holds its shape
      and dtype only. For tracing, ``f`` is rebuilt (same code, new cells, globals and defaults)
      with every channel an abstract input of the trace, as the element's own arrays are; each
      call passes its own arrays. So the same lambda over new parameters -- tracers of a new
      ``jax.grad``, or different values -- reuses the trace, and a trace never holds an array of
      an earlier call. ``f`` that reads a channel's value (``int(n)``, ``np.asarray(w)``)
      cannot be traced so; it is traced per call with its closure concrete, as before.
    - Python numbers, strings, bytes, ``None`` and numpy scalars and dtypes are keyed by value
      (a float by its bits): a different value is a different trace, as in ``jax.jit``'s
      static arguments.
    - anything else -- modules, classes, jitted functions, other objects -- is keyed by
      identity, and the cache entry lives only as long as those objects do (weak references).

    Not seen by the key, and so assumed not to change between calls, as ``jax.jit`` assumes of
    everything it closes over: Python values and numpy arrays that ``f`` reads through the
    attributes of objects that are not pytrees (``self.scale``, ``config.table``). JAX arrays
    reached that way are found in the trace (they are constants of it); such a trace is used
    for the current call only. A closure too large to walk (``MAX_LEAVES``) is not reused.
"""

from __future__ import annotations

import dis
import functools
import types
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

__all__ = ["Closure", "closure_of"]

#: Values ``f`` may reach before its closure counts as too large to key on every call.
MAX_LEAVES = 4096
#: Nested Python functions walked.
MAX_DEPTH = 16

_ARRAYS = (jax.Array, np.ndarray)
_VALUES = (int, float, complex, str, bytes, bool, type(None), np.generic, np.dtype)


class _TooLarge(Exception):
    pass


# Templates: how to rebuild a value with its channels replaced.


class _Node:
    def build(self, values: list[Any]) -> Any:
        raise NotImplementedError


@dataclass(slots=True)
class _Same(_Node):
    value: Any

    def build(self, values: list[Any]) -> Any:
        return self.value


@dataclass(slots=True)
class _Channel(_Node):
    index: int

    def build(self, values: list[Any]) -> Any:
        return values[self.index]


@dataclass(slots=True)
class _Tree(_Node):
    treedef: Any
    children: list[_Node]

    def build(self, values: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, [c.build(values) for c in self.children])


@dataclass(slots=True)
class _Partial(_Node):
    func: _Node
    args: _Node
    keywords: _Node

    def build(self, values: list[Any]) -> Any:
        return functools.partial(
            self.func.build(values), *self.args.build(values), **self.keywords.build(values)
        )


@dataclass(slots=True)
class _Method(_Node):
    func: _Node
    owner: _Node

    def build(self, values: list[Any]) -> Any:
        return types.MethodType(self.func.build(values), self.owner.build(values))


_EMPTY = object()  # an empty closure cell


@dataclass(slots=True)
class _Function(_Node):
    fn: types.FunctionType
    defaults: _Node
    kwdefaults: _Node
    cells: list[_Node]
    names: dict[str, _Node]  # globals that hold channels

    def build(self, values: list[Any]) -> Any:
        fn = self.fn
        scope = fn.__globals__
        if self.names:
            scope = dict(scope)
            scope.update((name, node.build(values)) for name, node in self.names.items())
        cells = tuple(_cell(node.build(values)) for node in self.cells) or None
        new = types.FunctionType(
            fn.__code__, scope, fn.__name__, self.defaults.build(values), cells
        )
        new.__kwdefaults__ = self.kwdefaults.build(values)
        new.__qualname__ = fn.__qualname__
        new.__dict__.update(fn.__dict__)
        return new


def _cell(value: Any) -> types.CellType:
    return types.CellType() if value is _EMPTY else types.CellType(value)


@dataclass(eq=False)
class Closure:
    """``f`` seen through its closure.

    Attributes:
        key: what ``f`` is, hashable; ``None`` when its traces cannot be reused across calls.
        channels: the arrays ``f`` reaches, in a fixed order (the key holds their types).
        holders: objects the key holds by identity; the cache entry dies with any of them.
        template: rebuilds ``f`` with other values in place of the channels.
    """

    key: Hashable | None
    channels: list[Any] = field(default_factory=list)
    holders: list[Any] = field(default_factory=list)
    template: _Node | None = None

    def rebuild(self, values: list[Any]) -> Callable[..., Any]:
        """``f`` with ``values`` in place of its channels."""
        assert self.template is not None
        return self.template.build(values)  # type: ignore[no-any-return]


def closure_of(f: Callable[..., Any], context: Hashable) -> Closure:
    """Walk ``f`` (see NOTE [reusing traces across calls]).

    Arguments:
        f: the mapped function.
        context: what else the traces depend on (JAX's trace-time settings), part of the key.
    """
    walk = _Walk()
    try:
        key, template = walk.value(f, 0)
    except _TooLarge:
        return Closure(None)
    if not walk.channels:
        template = _Same(f)  # nothing to replace: trace ``f`` itself
    return Closure((key, context), walk.channels, walk.holders, template)


class _Walk:
    def __init__(self) -> None:
        self.channels: list[Any] = []
        self.holders: list[Any] = []
        self._active: dict[int, int] = {}  # functions being walked (recursion): id -> order
        self._count = 0

    def _tick(self) -> None:
        self._count += 1
        if self._count > MAX_LEAVES:
            raise _TooLarge

    def value(self, x: Any, depth: int) -> tuple[Hashable, _Node]:
        self._tick()
        if isinstance(x, np.ndarray) and x.dtype.kind not in "biufc":
            # strings or objects: no JAX type; used as they are, text keyed by its contents
            if x.dtype.kind in "SU":
                return ("np", x.dtype.str, x.shape, x.tobytes()), _Same(x)
            return self._identity(x)
        if isinstance(x, _ARRAYS):
            self.channels.append(x)
            kind = "jax" if isinstance(x, jax.Array) else "np"
            return (kind, jax.typeof(x)), _Channel(len(self.channels) - 1)
        if isinstance(x, _VALUES):
            return _by_value(x), _Same(x)
        if isinstance(x, types.FunctionType):
            return self.function(x, depth)
        if type(x) is functools.partial:
            func, fnode = self.value(x.func, depth)
            args, anode = self.value(x.args, depth)
            kws, knode = self.value(x.keywords, depth)
            return ("partial", func, args, kws), self._node(_Partial(fnode, anode, knode))
        if isinstance(x, types.MethodType):
            func, fnode = self.value(x.__func__, depth)
            owner, onode = self.value(x.__self__, depth)
            return ("method", func, owner), self._node(_Method(fnode, onode))
        if not isinstance(x, (types.ModuleType, type)):
            leaves, treedef = jax.tree_util.tree_flatten(x)
            if not (len(leaves) == 1 and leaves[0] is x):  # a pytree node
                try:
                    hash(treedef)
                except TypeError:
                    return self._identity(x)
                parts = [self.value(leaf, depth) for leaf in leaves]
                children = [node for _, node in parts]
                return ("tree", treedef, tuple(k for k, _ in parts)), self._node(
                    _Tree(treedef, children), x
                )
        return self._identity(x)

    def function(self, fn: types.FunctionType, depth: int) -> tuple[Hashable, _Node]:
        order = self._active.get(id(fn))
        if order is not None:  # recursion: the original function, by identity
            return ("recursive", order), _Same(fn)
        if depth >= MAX_DEPTH:
            return self._identity(fn)
        self._active[id(fn)] = len(self._active)
        try:
            before = len(self.channels)
            defaults, dnode = self.value(fn.__defaults__, depth + 1)
            kwdefaults, knode = self.value(fn.__kwdefaults__, depth + 1)
            cells: list[Hashable] = []
            cnodes: list[_Node] = []
            for cell in fn.__closure__ or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # not assigned yet
                    cells.append("empty")
                    cnodes.append(_Same(_EMPTY))
                    continue
                key, cnode = self.value(contents, depth + 1)
                cells.append(key)
                cnodes.append(cnode)
            scope = fn.__globals__
            names: list[tuple[str, Hashable]] = []
            nnodes: dict[str, _Node] = {}
            for name in _global_names(fn.__code__):
                if name in scope:
                    key, gnode = self.value(scope[name], depth + 1)
                    names.append((name, key))
                    if not isinstance(gnode, _Same):
                        nnodes[name] = gnode
                else:
                    names.append((name, "absent"))  # a builtin, or an attribute name
        finally:
            del self._active[id(fn)]
        key = ("function", fn.__code__, defaults, kwdefaults, tuple(cells), tuple(names))
        if len(self.channels) == before:
            node: _Node = _Same(fn)  # reaches no array: used as it is
        else:
            node = _Function(fn, dnode, knode, cnodes, nnodes)
        return key, node

    def _node(self, node: _Node, original: Any = None) -> _Node:
        """``node``, or the original value where the node reaches no channel."""
        if original is not None and _static(node):
            return _Same(original)
        return node

    def _identity(self, x: Any) -> tuple[Hashable, _Node]:
        self.holders.append(x)
        return ("id", id(x)), _Same(x)


def _static(node: _Node) -> bool:
    if isinstance(node, _Same):
        return True
    if isinstance(node, _Tree):
        return all(_static(c) for c in node.children)
    return False


def _by_value(x: Any) -> Hashable:
    if isinstance(x, (float, np.floating)):
        # 0.0 and -0.0 are equal, but not the same constant; a Python float (weakly typed) and
        # an ``np.float64`` (a float too) give other dtypes
        return (type(x), float(x).hex())
    if isinstance(x, (complex, np.complexfloating)):
        return (type(x), float(x.real).hex(), float(x.imag).hex())
    return (type(x), x)


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` and the code nested in it (lambdas, comprehensions) load."""
    names: dict[str, None] = {}
    stack = [code]
    while stack:
        c = stack.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
                names[ins.argval] = None
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return tuple(names)


def _caller(on_death: Callable[[], None]) -> Callable[[Any], None]:
    return lambda _: on_death()


def weak_holders(holders: list[Any], on_death: Callable[[], None]) -> list[Any]:
    """References to ``holders`` for a cache entry: weak where possible, calling ``on_death``
    when one dies; strong otherwise (an object that cannot be weakly referenced lives as long
    as the entry)."""
    refs: list[Any] = []
    for h in holders:
        if isinstance(h, (types.ModuleType, type)):
            refs.append(h)  # lives as long as the program
            continue
        try:
            refs.append(weakref.ref(h, _caller(on_death)))
        except TypeError:
            refs.append(h)
    return refs
