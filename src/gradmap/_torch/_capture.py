"""Capture: find the tensors ``f`` uses that were made outside it, and cut them per chunk.

NOTE [capturing closure tensors]:
    The gradient contract covers every tensor ``f`` *uses* that requires grad and was created
    outside it: module parameters, closure and global tensors, attributes, non-leaf tensors
    computed before the call. Python gives no list of those, so a chunk runs ``f`` under a
    ``TorchFunctionMode`` (entered in the worker's thread: modes are per thread) that sees every
    tensor handed to a torch function, method or operator. A tensor that requires grad and was
    not produced inside the current element (nor is one of its item stand-ins) is *foreign*: it is
    replaced, for the rest of the chunk, by a stand-in ``s = t.view_as(t)`` made once per chunk.

    Why a stand-in and not the tensor itself: the chunk's graph ends at its stand-ins, so its
    backward stops there. Pulling back to the original tensors would, when one of them is computed
    from another outside ``f`` (``b = 2 * a``), count ``a``'s gradient twice and run the shared
    graph above them once per chunk (shared notes, trap 8). The originals become inputs of the join
    node instead, so the outer engine runs their graph once, with the summed gradient.

    Which stand-in: for the forward whose graph is kept, a fresh leaf ``t.detach()`` requiring
    grad. The chunk's backward is then a plain ``backward()`` that accumulates into the stand-ins'
    ``.grad``, with no ``inputs=`` -- which reentrant ``torch.utils.checkpoint`` inside ``f``
    requires. For a ``create_graph=True`` backward, which recomputes the chunk (NOTE [double
    backward recomputes]), a view ``t.view_as(t)`` (``connected=True``): it stays connected to
    the original, so the second-order gradients reach it exactly (shared notes, trap 5).

    ``autograd.Function.apply`` is not a torch function: a user's custom Function would wire its
    node to the original tensor and the gradient would be lost silently (trap 7). gradmap wraps
    ``Function.apply`` once, process-wide; the wrapper does nothing unless the calling thread is
    inside a capture, and then routes the arguments like any other call. The same wrapper routes
    the arguments of the join node of a ``tmap`` nested inside ``f``.

    "Produced inside the element" is told by a tensor's autograd node: the capture records the
    node of every result of every call in the element, by ``id()``, and keeps the node objects (not
    the tensors, whose memory must be freed and reused as in the loop) until the element ends, so
    that no id is reused meanwhile (trap 9). A leaf that an op inside the element made require grad
    has no node; it is recorded, and kept, itself (a rare case).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._random import RANDOM_CALLS, ElementRandom

__all__ = ["Capture", "install_apply_hook"]

Tensor = torch.Tensor

_tls = threading.local()
_CONTAINERS = (list, tuple, dict)

# Calls that read metadata, or leave the graph, need no routing: passing them straight through
# keeps the mode cheap (attribute reads such as ``t.shape`` reach it too).
_GETTERS = (
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "is_leaf",
    "grad_fn",
    "ndim",
    "layout",
    "is_sparse",
    "is_cuda",
    "is_quantized",
    "is_meta",
    "is_nested",
    "names",
    "_version",
    "output_nr",
    "grad",
    "data",
    "_base",
    "itemsize",
    "nbytes",
)
_METHODS = (
    "dim",
    "size",
    "numel",
    "stride",
    "is_contiguous",
    "element_size",
    "data_ptr",
    "storage_offset",
    "is_floating_point",
    "is_complex",
    "item",
    "tolist",
    "__len__",
    "__repr__",
    "__format__",
    "__bool__",
    "__index__",
    "__int__",
    "__float__",
    "get_device",
    "_is_view",
    "untyped_storage",
    "numpy",
)
_PASSTHROUGH = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in _GETTERS if hasattr(torch.Tensor, name)]
    + [getattr(torch.Tensor, name) for name in _METHODS if hasattr(torch.Tensor, name)]
)


def _stack() -> list[Capture]:
    stack: list[Capture] | None = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


class Capture(TorchFunctionMode):
    """The capture of one chunk: its stand-ins, in the order the chunk first used them.

    Attributes:
        originals: the foreign tensors the chunk used.
        standins: their stand-ins, in the same order.
    """

    def __init__(self, connected: bool = False) -> None:
        super().__init__()
        self.connected = connected
        self.originals: list[Tensor] = []
        self.standins: list[Tensor] = []
        self._standin_of: dict[int, Tensor] = {}
        self._chunk_local: set[int] = set()
        self._chunk_keep: list[Tensor] = []
        self._elem_nodes: set[int] = set()
        self._elem_keep: list[Any] = []
        self._quiet = False  # while set, the mode passes calls through untouched
        self._random: ElementRandom | None = None

    # -- bookkeeping -------------------------------------------------------------------------

    def begin_element(self, random: ElementRandom | None = None) -> None:
        """Forget the tensors of the previous element (only their ids were needed), and draw
        the next element's random numbers from ``random``."""
        self._elem_nodes = set()
        self._elem_keep = []
        self._random = random

    def _is_foreign(self, t: Tensor) -> bool:
        return t.requires_grad and not self._is_local(t)

    def _is_local(self, t: Tensor) -> bool:
        """Whether ``t`` (which requires grad) was made in this element, or is a stand-in."""
        if id(t) in self._chunk_local:
            return True
        node = t.grad_fn
        return id(t if node is None else node) in self._elem_nodes

    def _cut(self, t: Tensor) -> Tensor:
        """A stand-in for ``t``: a fresh leaf, or a view of ``t`` when ``connected``."""
        quiet, self._quiet = self._quiet, True
        try:
            if not self.connected:
                return t.detach().requires_grad_()
            try:
                return t.view_as(t)
            except RuntimeError:  # layouts without views (sparse, ...)
                return t.clone()
        finally:
            self._quiet = quiet

    def item_standin(self, t: Tensor) -> Tensor:
        """A stand-in for an item tensor of the current chunk."""
        s = self._cut(t)
        self._chunk_local.add(id(s))
        self._chunk_keep.append(s)
        return s

    def standin(self, t: Tensor) -> Tensor:
        """The stand-in of foreign tensor ``t``, made on its first use in this chunk."""
        s = self._standin_of.get(id(t))
        if s is None:
            s = self._cut(t)
            self._standin_of[id(t)] = s
            self.originals.append(t)  # also keeps id(t) from being reused
            self.standins.append(s)
            self._chunk_local.add(id(s))
        return s

    def route(self, obj: Any) -> Any:
        """``obj`` with foreign tensors replaced by their stand-ins (tensors, lists, tuples,
        dicts, nested); ``obj`` itself when nothing is foreign."""
        if isinstance(obj, Tensor):
            return self.standin(obj) if self._is_foreign(obj) else obj
        if type(obj) not in _CONTAINERS or not self._has_foreign(obj):
            return obj
        if type(obj) is dict:
            return {k: self.route(v) for k, v in obj.items()}
        return type(obj)([self.route(x) for x in obj])

    def _route_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``route(args)`` in one pass, for an op's positional arguments."""
        routed: list[Any] | None = None
        for i, x in enumerate(args):
            if isinstance(x, Tensor):
                if x.requires_grad and not self._is_local(x):
                    s = self._standin_of.get(id(x))
                    if routed is None:
                        routed = list(args)
                    routed[i] = self.standin(x) if s is None else s
            elif type(x) in _CONTAINERS:
                r = self.route(x)
                if r is not x:
                    if routed is None:
                        routed = list(args)
                    routed[i] = r
        return args if routed is None else tuple(routed)

    def _has_foreign(self, obj: Any) -> bool:
        """Whether a list, tuple or dict holds a foreign tensor, at any depth (the fast path: an
        op's arguments are seldom foreign)."""
        values = obj.values() if type(obj) is dict else obj
        for x in values:
            if type(x) is Tensor or isinstance(x, Tensor):
                if x.requires_grad and not self._is_local(x):
                    return True
            elif type(x) in _CONTAINERS and self._has_foreign(x):
                return True
        return False

    def register(self, out: Any) -> None:
        """Mark what an op returned as produced inside the element: by its autograd node, or,
        for a leaf that an op made require grad (``requires_grad_()``), by the tensor itself."""
        if isinstance(out, Tensor):
            self._register_tensor(out)
        elif type(out) in (list, tuple):
            for o in out:
                self.register(o)

    def _register_tensor(self, out: Tensor) -> None:
        node = out.grad_fn
        if node is not None:
            if id(node) not in self._elem_nodes:
                self._elem_nodes.add(id(node))
                self._elem_keep.append(node)
        elif out.requires_grad:
            self._elem_nodes.add(id(out))
            self._elem_keep.append(out)

    # -- the mode ----------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # The hot path of a chunk's forward: every torch call in f comes through here, under
        # the GIL, so the common case (no foreign argument, one tensor out) is kept inline.
        if self._quiet or func in _PASSTHROUGH:
            return func(*args, **kwargs) if kwargs else func(*args)
        args = self._route_args(args)
        if kwargs and self._has_foreign(kwargs):
            kwargs = self.route(kwargs)
        if func in RANDOM_CALLS and self._random is not None:
            out = self._random.call(func, args, kwargs or {})
        elif kwargs:
            out = func(*args, **kwargs)
        else:
            out = func(*args)
        if type(out) is Tensor:
            node = out.grad_fn
            if node is not None and id(node) in self._elem_nodes:
                return out
            self._register_tensor(out)
        else:
            self.register(out)
        return out

    def __enter__(self) -> Capture:
        super().__enter__()
        _stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()
        super().__exit__(*exc)


# -- autograd.Function.apply ----------------------------------------------------------------

_hook_lock = threading.Lock()
_original_apply: Any = None


def _apply_routed(cls: type, *args: Any, **kwargs: Any) -> Any:
    stack = getattr(_tls, "stack", None)
    if not stack:
        return _original_apply.__func__(cls, *args, **kwargs)
    capture = stack[-1]
    if capture._quiet:
        return _original_apply.__func__(cls, *args, **kwargs)
    # Routing reads attributes of tensors, which would reach the mode itself: keep it quiet.
    capture._quiet = True
    try:
        args = capture.route(args)
        if kwargs:
            kwargs = capture.route(kwargs)
    finally:
        capture._quiet = False
    out = _original_apply.__func__(cls, *args, **kwargs)
    capture._quiet = True
    try:
        capture.register(out)
    finally:
        capture._quiet = False
    return out


def install_apply_hook() -> None:
    """Route the arguments of ``torch.autograd.Function.apply`` inside captures (idempotent)."""
    global _original_apply
    if _original_apply is not None:
        return
    with _hook_lock:
        if _original_apply is None:
            _original_apply = torch.autograd.Function.__dict__["apply"]
            torch.autograd.Function.apply = classmethod(_apply_routed)  # type: ignore[assignment,method-assign]
