"""A chunk's boundary, read off the autograd graph it built; every private PyTorch API in one place.

NOTE [the boundary of a chunk]:
    ``f`` runs untouched: no mode, no stand-ins. What the gradient must reach is read off the graph
    the chunk built. The native walk does it exactly (NOTE [the native walk] in ``_native``); what
    follows is the Python walk, its fallback where no compiler is found. Walking
    ``grad_fn.next_functions`` from the chunk's outputs, every node is either *inner* (created by
    this chunk) or not; the walk goes through inner nodes and stops at the others, which form the
    boundary:
    - an ``AccumulateGrad`` node: a leaf (a parameter, a closure or global leaf, an item leaf);
    - any other node: a non-leaf tensor made before the call (an item cut from a tensor, a tensor
      computed before the map); the boundary entry is the edge ``(node, output_nr)``, and the graph
      behind it runs once, in the caller's backward, with the summed gradient.
    A chunk's pullback is one ``torch.autograd.grad`` with those entries as ``inputs`` (leaves as
    tensors, non-leaf edges as ``GradientEdge``): it writes no ``.grad``, so chunks pull back
    concurrently.

    Which nodes are inner: autograd numbers nodes per thread (``_sequence_nr``, a thread-local
    counter that only grows). A chunk's forward runs in one thread; the counter before and after it
    brackets every node the chunk created. A node with a number outside that range was not created
    by this chunk. Inside the range, a node could still be another thread's (the counters are per
    thread; the caller's nodes are the likely ones when chunks run on the pool), so every tensor the
    map can see that was made before the call -- the items, and the non-leaf tensors reachable from
    ``f`` (closure cells, defaults, bound ``self``, the globals its code names,
    ``functools.partial`` arguments, a few levels of containers and attributes) -- marks its node as
    outside whatever its number (``Known``; for the serial executor, whose chunks run in the
    caller's thread after all of its earlier nodes, only when an edge needs its tensor). What
    remains is a node another thread made, numbered inside this chunk's range and reachable from
    ``f`` by no reference gradmap follows; it would be walked through as inner. The gradient to
    every leaf stays right even then (the walk just goes further up); only a request for that very
    tensor's gradient (``autograd.grad`` with it as input, a hook on it) would miss the map's part.
    A node numbered outside the range with no tensor found stops the map with an error: its
    gradient cannot be passed on without its tensor, and is never guessed. Cost: one counter read
    per chunk and the walk, about 1 us per node in Python, measured per workload in the README.

NOTE [nothing past the boundary]:
    ``autograd.grad`` stops at its inputs only where nothing behind them is needed: if a chunk
    reaches both a parameter ``w`` and ``h = g(w)`` made before the call, asking for both would
    run ``h``'s graph inside the chunk's pullback and count ``w``'s gradient through ``h`` twice
    (once there, once when the caller's backward runs ``h``'s graph). So every non-leaf boundary
    node gets, for the life of the map, a pre-hook that turns its incoming gradients into
    undefined ones while the calling thread is inside a chunk pullback: the engine then neither
    computes nor propagates anything behind it. The edge's own gradient is captured before the
    hook runs. In the caller's backward the hook does nothing.
"""

from __future__ import annotations

import functools
import gc
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NoReturn

import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd.graph import GradientEdge

from .._scoped import scoped
from ._native import native

__all__ = [
    "Boundary",
    "caller_only",
    "find_boundary",
    "hooks_quiet",
    "keep_graph",
    "needed",
    "plain_backward",
    "pulling_back",
    "reachable_from",
    "reaches",
    "sequence_nr",
    "transforms_active",
    "warn_caller_only",
]

Tensor = torch.Tensor
Node = Any

#: The thread's autograd node counter (the number the next node will get).
sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr


def keep_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def plain_backward() -> bool:
    """Whether the running backward is a plain ``backward()`` (no ``inputs``, not ``grad``)."""
    return bool(torch.autograd._is_checkpoint_valid())


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform or a forward-AD dual level is active."""
    return bool(torch._C._are_functorch_transforms_active()) or fwAD._current_level >= 0


def caller_only() -> str | None:
    """What in the caller's thread-local state other threads cannot share, so that a map runs
    as the plain loop in the caller's thread (NOTE [state only the caller's thread has]);
    ``None`` where nothing is.

    NOTE [state only the caller's thread has]:
        Some of PyTorch's state lives in the thread that set it and is not carried into other
        threads, let alone processes, yet changes what ``f`` computes or what sees it: a
        ``torch.func`` transform or a forward-AD level (functorch's interpreter stack; the join
        has no forward rule either), saved-tensor hooks (``saved_tensors_hooks``,
        ``save_on_cpu``, a non-reentrant ``checkpoint`` around the map: pool threads saved
        their tensors unhooked, so hooks that change what they save gave other gradients, and a
        checkpoint around the map kept the chunks' graphs whole), and torch function and
        dispatch modes (``FlopCounterMode``, ``torch.set_default_device``, a user's
        ``TorchDispatchMode``).
        Replaying them in pool threads would run users' hooks and modes concurrently and out
        of order, which the loop never does. So under any of them a map runs as the plain
        loop, in the caller's thread: the loop's results and gradients by construction, and no
        speed-up (a warning says so, except under ``torch.func``, where the loop is expected).
        The default device set to the CPU (``torch.set_default_device("cpu")``) is what other
        threads have anyway, and does not count.
    """
    if transforms_active():
        return "torch.func"
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return "saved-tensor hooks (saved_tensors_hooks, save_on_cpu, a checkpoint around the map)"
    if torch._C._len_torch_dispatch_stack():
        return "a torch dispatch mode (such as FlopCounterMode)"
    for i in range(torch._C._len_torch_function_stack()):
        mode = torch._C._get_function_stack_at(i)
        device = getattr(mode, "device", None) if type(mode).__name__ == "DeviceContext" else None
        if device is None or torch.device(device).type != "cpu":
            return "a torch function mode (such as torch.set_default_device)"
    return None


def warn_caller_only(api: str, stacklevel: int) -> None:
    """Say that a map runs as the plain loop, and why (``caller_only``), if it does."""
    reason = caller_only()
    if reason is not None and reason != "torch.func":
        warnings.warn(
            f"{api} runs as the plain loop in the caller's thread, with no speed-up: {reason} "
            "is active there, which other threads and processes do not share (NOTE [state only "
            "the caller's thread has]). Enter it inside f instead, where f's own work needs it "
            "(for a checkpoint around the map: remat=True keeps no graph of its own).",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


_LEGACY_BATCHED: Callable[[Tensor], bool] = getattr(
    torch._C._functorch, "is_legacy_batchedtensor", lambda t: False
)


def batched(cotangents: Sequence[Tensor | None]) -> bool:
    """Whether a backward runs batched, its cotangents batched tensors: ``torch.vmap`` over a
    vector-Jacobian product, ``autograd.grad(..., is_grads_batched=True)``,
    ``jacobian(..., vectorize=True)``. Its cotangents' values are not known per example (no
    zero check), and only the thread it runs in knows its vmap levels."""
    g = next((c for c in cotangents if c is not None), None)
    if g is None:
        return False
    return bool(torch._C._are_functorch_transforms_active()) or _LEGACY_BATCHED(g)


def _accumulate_grad_type() -> type:
    # (first imported inside inference_mode or no_grad, perhaps: a map's first call)
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True)
        return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


_ACCUMULATE_GRAD = _accumulate_grad_type()
#: The node of a custom ``autograd.Function`` (``grad_fn`` of its outputs).
_CUSTOM = torch.autograd.function.BackwardCFunction

#: Floating types of 16 bits or fewer (NOTE [gradients of reduced precision]).
_REDUCED = frozenset(
    d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
    and ((d.is_floating_point and d.itemsize <= 2) or d == torch.complex32)
)
"""NOTE [gradients of reduced precision]:
    ``tsum`` pulls a chunk of losses back with cotangent one during the forward and multiplies
    the gradients by the sum's cotangent in the backward (NOTE [early gradients scaled once] in
    ``_sum``), and so does a ``tmap`` that learnt its cotangents are one and the same. In exact
    arithmetic that is the loop's gradient; in float32 and float64 it is the loop's up to
    rounding. In half precision it is not: a loss scale (``GradScaler``'s ``scale(loss)``, a
    cotangent of 1024 or 65536) exists to move the float16 gradients inside the graph out of
    underflow, and scaled afterwards they had underflowed already: a helper measured exact zeros
    where the loop's gradients were 2.7e-5, and finite gradients where the loop's overflowed to
    the inf a scaler watches for. So the walks mark a chunk whose graph carries a gradient of a
    floating type of 16 bits or fewer (an edge's input metadata in the native walk; a node's,
    a leaf's or a tensor's dtype in the Python one), and such a chunk is pulled back in the
    backward with the cotangent the loop's would see."""

_pullback = threading.local()


def in_a_pullback() -> bool:
    """Whether the calling thread runs a chunk pullback of some map (``pulling_back``)."""
    return getattr(_pullback, "owner", None) is not None


def pulling_back(owner: object) -> AbstractContextManager[None]:
    """Mark the calling thread as running a chunk pullback of the map ``owner`` stands for
    (NOTE [nothing past the boundary]). A map nested in ``f`` pulls back inside its outer map's
    pullback: only the innermost owner's hooks block."""
    return scoped(_pullback, "owner", owner)


class Boundary:
    """What one chunk's graph reaches outside itself.

    Attributes:
        keys: one hashable key per entry; equal keys across chunks are the same join input.
        tensors: the tensor of each entry (the join's input for it).
        inputs: what ``autograd.grad`` takes for each entry: the leaf, or a ``GradientEdge``.
        nodes: the non-leaf boundary nodes the Python walk found (kept alive: their ids are in
            ``keys``), which ``BlockHooks`` blocks; a pullback reaches past them. Empty from the
            native walk, past whose gates no pullback runs (NOTE [the native walk]).
        user: a node of the chunk's graph runs user code in its backward (NOTE [chunks whose
            backward is user code]).

    NOTE [chunks whose backward is user code]:
        A pullback of the loop's graph gives a gradient linear in the cotangent, and zeros for
        a cotangent of zeros, for every built-in op; gradmap uses that twice: ``tmap`` does no
        backward work for elements whose cotangents are zeros, and ``tsum`` pulls a chunk of
        losses back during the forward with cotangent one and scales by the sum's cotangent
        later. User code in the backward breaks both: a hook on a tensor ``f`` made
        (``register_hook``, ``retain_grad``) sees, and may change, the cotangent, and runs at
        backward time in the loop; a custom ``autograd.Function``'s backward may clip, or add a
        term of its own. The native walk marks a chunk whose graph holds such a node (a hook on
        a node or a tensor it made, or a custom Function's node); such a chunk is pulled back in
        the map's backward with its own cotangents, zeros included, as the loop's would be. The
        Python walk sees custom Functions' nodes but not tensors' hooks (PyTorch lists them to
        C++ only); and where its pullback reaches past a non-leaf boundary node (a map inside
        ``f`` over tensors ``f`` computed), blocked there by ``BlockHooks``, a custom Function
        beyond runs with zeros, which a backward that adds a term of its own turns into a wrong
        gradient. The native walk's gates stop the engine there.
    """

    __slots__ = ("inputs", "keys", "nodes", "reduced", "tensors", "user")

    def __init__(self) -> None:
        self.keys: list[Any] = []  # hashable
        self.tensors: list[Tensor] = []
        self.inputs: list[Tensor | GradientEdge] = []
        self.nodes: list[Node] = []
        self.user = False
        self.reduced = False  # NOTE [gradients of reduced precision]


class Known:
    """The tensors made before the call that the map can see: items and what ``f`` refers to.

    Non-leaf ones mark their nodes as outside every chunk, and give the tensor for an edge. A
    map scans at once (``eager``), before any chunk runs: chunks on other threads than the
    caller's need it (a caller's node may be numbered inside a chunk's range), and a scan made
    later, when an edge first needs its tensor, would also find a tensor an earlier chunk made
    and left where ``f`` looks (a cache ``f`` fills: NOTE [a tensor one chunk made and another
    read] in ``_chunk``), take it for one made before the call and block the maker's pullback at
    its node -- that chunk's share of its gradient lost, silently. Made during the call, it is
    not found, and the walk stops with ``_not_found``'s error.
    """

    def __init__(self, f: Any, elements: Sequence[tuple[Any, ...]], *, eager: bool) -> None:
        self._edges: dict[tuple[int, int], Tensor] = {}
        self._nodes: dict[int, Node] = {}
        self._lock = threading.Lock()
        #: The native walk, which needs none of this (NOTE [the native walk]).
        self.native = native()
        self._source: tuple[Any, Sequence[tuple[Any, ...]]] | None = (
            None if self.native is not None else (f, elements)
        )
        if eager:
            self.complete()

    def complete(self) -> None:
        """Scan now (before chunks run on other threads than the caller's)."""
        if self._source is not None:
            self._scan()

    def _scan(self) -> None:
        with self._lock:
            source, self._source = self._source, None
            if source is not None:
                for t in reachable_from(*source):
                    self.add(t)

    def add(self, t: Tensor) -> None:
        node = t.grad_fn
        if node is not None:
            self._edges.setdefault((id(node), t.output_nr), t)
            self._nodes.setdefault(id(node), node)

    def is_outside(self, node: Node) -> bool:
        return id(node) in self._nodes

    def tensor_for(self, node: Node, nr: int) -> Tensor | None:
        """The tensor whose gradient edge is ``(node, nr)``, or ``None`` if none can be found."""
        t = self._edges.get((id(node), nr))
        if t is None and self._source is not None:
            self._scan()
            t = self._edges.get((id(node), nr))
        return t


def find_boundary(outputs: list[Tensor], lo: int, hi: int, known: Known) -> Boundary:
    """Walk a chunk's graph from ``outputs``; nodes numbered in ``[lo, hi)`` are inner unless
    ``known`` says otherwise (NOTE [the boundary of a chunk]).

    With the native walk (NOTE [the native walk]), an output made outside the chunk is replaced
    in ``outputs`` by a gated alias. Otherwise, the Python walk below: the hot loop of a map's
    bookkeeping, written out flat. Each node it reaches gets a Python
    wrapper, an object the cyclic garbage collector tracks; with the collector on, the walk's own
    allocations set off collections of the whole heap, which cost more than the walk (measured:
    3-6 us per node with it on). The walk calls no user code and frees what it allocates, so the
    collector is paused for its length (if no one else paused it) and resumed after.
    """
    walker = known.native
    if walker is not None:
        keys, tensors, inputs, roots, user, reduced = walker.walk(outputs, lo, hi)
        boundary = Boundary()
        boundary.keys, boundary.tensors, boundary.inputs = keys, tensors, inputs
        boundary.user, boundary.reduced = user, reduced
        for i, t in roots:  # outputs made outside the chunk: their gated aliases
            outputs[i] = t
        return boundary
    if not gc.isenabled():
        return _walk(outputs, lo, hi, known)
    gc.disable()
    try:
        return _walk(outputs, lo, hi, known)
    finally:
        gc.enable()


def _walk(outputs: Iterable[Tensor], lo: int, hi: int, known: Known) -> Boundary:
    boundary = Boundary()
    keys, tensors, inputs, nodes = boundary.keys, boundary.tensors, boundary.inputs, boundary.nodes
    seen: set[int] = set()  # inner and leaf nodes already reached
    kept: list[Node] = []  # keeps every node seen alive, so that no id is reused meanwhile
    edges: set[tuple[int, int]] = set()
    outside = known.is_outside
    accumulate = _ACCUMULATE_GRAD
    stack: list[tuple[Node, int]] = []
    leaves: set[int] = set()
    for t in outputs:
        if t.dtype in _REDUCED:  # NOTE [gradients of reduced precision]
            boundary.reduced = True
        node = t.grad_fn
        if node is None:  # a leaf that requires grad, returned as it is
            if id(t) not in leaves:
                leaves.add(id(t))
                keys.append(("leaf", id(t)))
                tensors.append(t)
                inputs.append(t)
        else:
            stack.append((node, t.output_nr))
    while stack:
        node, nr = stack.pop()
        key = id(node)
        if key in seen:
            continue
        if type(node) is accumulate:
            seen.add(key)
            kept.append(node)
            leaf: Tensor = getattr(node, "variable")  # noqa: B009 - narrowed type has no attribute
            if id(leaf) not in leaves:
                leaves.add(id(leaf))
                keys.append(("leaf", id(leaf)))
                tensors.append(leaf)
                inputs.append(leaf)
                if leaf.dtype in _REDUCED:
                    boundary.reduced = True
            continue
        if not (lo <= node._sequence_nr() < hi) or outside(node):
            if (key, nr) in edges:
                continue
            found = known.tensor_for(node, nr)
            if found is not None:
                edges.add((key, nr))
                kept.append(node)
                keys.append(("edge", key, nr))
                tensors.append(found)
                inputs.append(GradientEdge(node, nr))
                nodes.append(node)
                if found.dtype in _REDUCED:
                    boundary.reduced = True
                continue
            if not (lo <= node._sequence_nr() < hi):
                _not_found(node, nr)
            # Numbered as the chunk's, with no known tensor: the chunk's own (the Python walk
            # cannot tell another thread's node apart: NOTE [the boundary of a chunk]).
        seen.add(key)
        kept.append(node)
        if isinstance(node, _CUSTOM):  # NOTE [chunks whose backward is user code]
            boundary.user = True
        if not boundary.reduced and any(m.dtype in _REDUCED for m in node._input_metadata):
            boundary.reduced = True
        for child in node.next_functions:
            if child[0] is not None:
                stack.append(child)
    return boundary


def reaches(outputs: list[Tensor], boundary: Boundary) -> list[bool]:
    """For each entry of a chunk's boundary, whether the graph from ``outputs`` (some of the
    chunk's outputs, their graph stored) reaches it: where a cotangent of zeros gives zeros."""
    walker = native()
    if walker is not None and not boundary.nodes:
        return list(walker.reaches(outputs, boundary.inputs))
    index = {key: k for k, key in enumerate(boundary.keys)}
    hit = [False] * len(index)
    seen: set[int] = set()
    stack: list[tuple[Node, int, Tensor | None]] = [(t.grad_fn, t.output_nr, t) for t in outputs]
    while stack:
        node, nr, t = stack.pop()
        if node is None:
            k = index.get(("leaf", id(t)))
        elif type(node) is _ACCUMULATE_GRAD:
            k = index.get(("leaf", id(getattr(node, "variable"))))  # noqa: B009
        else:
            k = index.get(("edge", id(node), nr))
        if k is not None:
            hit[k] = True
            continue
        if node is None or id(node) in seen or type(node) is _ACCUMULATE_GRAD:
            continue
        seen.add(id(node))
        stack.extend((child, child_nr, None) for child, child_nr in node.next_functions)
    return hit


def needed(ctx: Any, count: int) -> list[bool]:
    """For each of the ``count`` inputs of a join (``ctx``, in its backward), whether the running
    backward needs its gradient (with ``autograd.grad`` or ``backward(inputs=...)``, only those
    on a path to what was asked for). Without the native walk: all."""
    walker = native()
    if walker is None:
        return [True] * count
    mask = list(walker.needed(ctx))
    return mask if len(mask) == count else [True] * count


def _not_found(node: Node, nr: int) -> NoReturn:
    raise RuntimeError(
        f"gradmap: f uses a tensor that requires grad and was computed before the call, or by "
        f"f for another element (a cache f fills) (grad_fn={node.name()}, output {nr}), and "
        "gradmap's Python walk cannot find it among "
        "the items and what f refers to (closure cells, defaults, globals its code names, bound "
        "self). Its gradient would be lost, so the map stops. Fix: let gradmap build its native "
        "walk, which needs no such search (install a C++ compiler and ninja, then run `python -m "
        "gradmap build`; NOTE [the native walk]), or pass the tensor to the map as an item or "
        "as an attribute of f."
    )


class BlockHooks:
    """The pre-hooks of NOTE [nothing past the boundary] on a map's non-leaf boundary nodes;
    they block while the thread pulls back a chunk of the map ``owner`` stands for."""

    def __init__(self, nodes: Iterable[Node], owner: object) -> None:
        def block(grad_outputs: tuple[Tensor | None, ...]) -> tuple[None, ...] | None:
            if getattr(_pullback, "owner", None) is owner:
                return (None,) * len(grad_outputs)
            return None

        self._handles = []
        seen: set[int] = set()
        for node in nodes:
            if id(node) not in seen:
                seen.add(id(node))
                self._handles.append(node.register_prehook(block))

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()


def retains_grad(tensors: Iterable[Tensor]) -> bool:
    """Whether a non-leaf among ``tensors`` retains its gradient.

    The engine runs a retained gradient's hook whenever the tensor's edge is an
    ``autograd.grad`` input, and the hook writes the tensor's ``.grad``: chunk pullbacks running
    at once would write it from several threads, a data race in C++ that crashed the test suite
    (a segmentation fault in ``test_graph``'s hooks test, once in six runs). Such a map pulls its
    chunks back one after another.
    """
    return any(t.grad_fn is not None and t.retains_grad for t in tensors)


def hooked(tensors: Iterable[Tensor]) -> bool:
    """Whether a tensor among ``tensors`` has hooks of its own or retains its gradient (what
    ``hooks_quiet`` must set aside before a chunk is pulled back)."""
    return any(t._backward_hooks or (t.grad_fn is not None and t.retains_grad) for t in tensors)


@contextmanager
def hooks_quiet(tensors: Iterable[Tensor]) -> Iterator[None]:
    """While chunks pull back: the boundary tensors' own hooks (``register_hook``,
    ``retain_grad``) stay quiet.

    The engine runs a tensor's hooks whenever its gradient edge is an ``autograd.grad`` input, so
    every chunk pullback would run them with its share, and the caller's backward once more with
    the sum; the loop runs them once, with the sum. So during the join's backward (when nothing
    else can reach these edges: they wait for the join) the hooks are set aside and a retained
    ``.grad`` is put back as it was.
    """
    stashed: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    retained: list[tuple[Tensor, Tensor | None]] = []
    for t in tensors:
        hooks = t._backward_hooks
        if hooks:
            stashed.append((hooks, dict(hooks)))
            hooks.clear()
        if t.grad_fn is not None and t.retains_grad:
            retained.append((t, t.grad))
    try:
        yield
    finally:
        for hooks, saved in stashed:
            hooks.update(saved)
        for t, grad in retained:
            t.grad = grad


# -- what f refers to ---------------------------------------------------------------------------

_SKIP = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float, bool)
_MAX_OBJECTS = 2000


def reachable_from(f: Any, elements: Sequence[tuple[Any, ...]]) -> list[Tensor]:
    """The non-leaf tensors requiring grad among the items and what ``f`` refers to."""
    found: list[Tensor] = []
    for args in elements:
        for arg in args:
            if isinstance(arg, Tensor):  # the common item, without the generic walk
                if arg.grad_fn is not None:
                    found.append(arg)
            elif not isinstance(arg, _SKIP):
                _collect(arg, found, set(), 0, items=True)
    _collect(f, found, set(), 0)
    return found


def versions_used(f: Any, elements: Sequence[tuple[Any, ...]]) -> list[tuple[Tensor, int]]:
    """Each tensor among the items and what ``f`` refers to (module parameters and buffers
    aside), with its version now: what a recompute reads again (NOTE [a recompute reads what
    the forward read])."""
    return [(t, t._version) for t in _tensors_seen(f, elements) if not t.is_inference()]


def leaves_before(f: Any, elements: Sequence[tuple[Any, ...]]) -> list[Tensor]:
    """The leaves requiring grad among the items, what ``f`` refers to, and the parameters of
    its modules: those a map can tell existed before its call."""
    found = _tensors_seen(f, elements) + [p for m in modules_of(f) for p in m.parameters()]
    return [t for t in found if t.is_leaf and t.requires_grad]


def _tensors_seen(f: Any, elements: Sequence[tuple[Any, ...]]) -> list[Tensor]:
    """Every tensor among the items and what ``f`` refers to (module parameters and buffers
    aside)."""
    found: list[Tensor] = []
    seen: set[int] = set()
    for args in elements:
        for arg in args:
            if isinstance(arg, Tensor):
                found.append(arg)
            elif not isinstance(arg, _SKIP):
                _collect(arg, found, seen, 0, items=True, every=True)
    _collect(f, found, seen, 0, every=True)
    return found


def tensors_of(f: Any) -> list[Tensor]:
    """The tensors ``f`` refers to (its closure, the globals its code names, attributes), a few
    levels deep; module parameters and buffers aside."""
    found: list[Tensor] = []
    _collect(f, found, set(), 0, every=True)
    return found


def tensors_in(obj: Any) -> list[Tensor]:
    """The tensors an object holds in its attributes and containers (a few levels deep)."""
    found: list[Tensor] = []
    _collect(obj, found, set(), 0, items=True, every=True)
    return found


def check_versions(versions: list[tuple[Tensor, int]], api: str) -> None:
    """Raise where a tensor of ``versions`` changed in place since they were taken.

    NOTE [a recompute reads what the forward read]:
        ``remat`` recomputes ``f`` in the backward from the items and what ``f`` refers to. A
        tensor among them changed in place between the forward and the backward would be read
        at its new value, and the gradient taken at a point the forward never was; the loop's
        backward raises PyTorch's error there, for a tensor it saved. So the map notes their
        versions after its forward and checks them before recomputing (the loop's error is
        raised even where the loop's backward would not have needed that tensor: gradmap
        cannot tell).
    """
    for t, version in versions:
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: {api} with remat=True recomputes f in the backward, and a "
                f"tensor f uses (shape {tuple(t.shape)}) was changed in place since the forward "
                f"(its version was {version}, is now {t._version}): the recompute would "
                "differentiate at the new values. Change it after the backward, or use "
                "remat=False."
            )


def modules_of(f: Any) -> list[torch.nn.Module]:
    """The ``nn.Module`` objects ``f`` refers to (whose buffers a recompute must not update)."""
    found: list[Any] = []
    _collect(f, found, set(), 0, modules=True)
    return found


@contextmanager
def buffers_kept(f: Any) -> Iterator[None]:
    """Around a pass that recomputes ``f``: buffers its modules update (BatchNorm running
    statistics) keep the values the forward left, so updates are not applied twice. Worker
    processes update the caller's buffers in shared memory, so this holds for them too when the
    caller wraps their whole pass."""
    saved = []
    if f is not None:
        for module in modules_of(f):
            for b in module.buffers():
                saved.append((b, b._version, b.detach().clone()))
    try:
        yield
    finally:
        # Only buffers the recompute changed (BatchNorm's kernel updates its statistics
        # without bumping their version): writing back an unchanged one would bump its
        # version, and a double backward through an eval-mode BatchNorm, which saved its
        # running statistics, would then refuse them as modified in place.
        with torch.no_grad():
            for b, version, value in saved:
                if b._version != version or not _same_values(b, value):
                    b.copy_(value)


#: The index tensors of each compressed sparse layout, compressed then plain.
_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def _same_values(b: Tensor, value: Tensor) -> bool:
    """Whether buffer ``b`` still holds ``value`` (its clone): ``torch.equal`` has strided
    kernels only, so a sparse buffer (cvxpylayers' ``CvxpyLayer`` holds one) compares its parts,
    never densified (an adjacency matrix's dense form may not fit); other layouts (nested
    tensors) count as kept unless their version moved."""
    if b.layout == torch.strided:
        return torch.equal(b, value)
    if b.shape != value.shape or b.layout != value.layout:
        return False
    if b.layout == torch.sparse_coo:
        parts = [(t._indices(), t._values()) for t in (b, value)]
        return b.is_coalesced() == value.is_coalesced() and _all_equal(*parts)
    names = _COMPRESSED.get(b.layout)
    if names is None:
        return True
    parts = [(*(getattr(t, name)() for name in names), t.values()) for t in (b, value)]
    return _all_equal(*parts)


def _all_equal(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _collect(
    obj: Any,
    found: list[Any],
    seen: set[int],
    depth: int,
    items: bool = False,
    modules: bool = False,
    every: bool = False,
) -> None:
    if len(seen) > _MAX_OBJECTS or id(obj) in seen or isinstance(obj, _SKIP) or obj is None:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        if every or (not modules and obj.requires_grad and obj.grad_fn is not None):
            found.append(obj)
        return
    if isinstance(obj, torch.nn.Module):
        if modules:
            found.append(obj)
            return
        for value in obj.__dict__.values():  # plain attributes; parameters are leaves anyway
            if isinstance(value, Tensor):
                _collect(value, found, seen, depth + 1, modules=modules, every=every)
        return
    if depth > 3:
        return
    children: Iterable[Any]
    if isinstance(obj, (list, tuple, set, frozenset)):
        if modules and len(obj) > _LONG and not isinstance(obj, (set, frozenset)):
            first = obj[0]
            if isinstance(first, (list, tuple)) and first:
                first = first[0]  # a dataset of tuples
            if isinstance(first, _DATA):
                return  # data (a dataset's items), not modules: a scan per call costs per item
        children = obj
    elif isinstance(obj, dict):
        children = obj.values()
    elif items:
        children = getattr(obj, "__dict__", {}).values()
    elif isinstance(obj, types.MethodType):
        children = (obj.__self__, obj.__func__)
    elif isinstance(obj, functools.partial):
        children = (obj.func, obj.args, obj.keywords)
    elif isinstance(obj, types.FunctionType):
        code = obj.__code__
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        named = [obj.__globals__[n] for n in code.co_names if n in obj.__globals__]
        children = [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values(), *named]
    else:
        d = getattr(obj, "__dict__", None)
        children = d.values() if isinstance(d, dict) else ()
        call = type(obj).__dict__.get("__call__")
        if isinstance(call, types.FunctionType) and depth == 0:
            children = [*children, call]
    for child in children:
        _collect(child, found, seen, depth + 1, items=items, modules=modules, every=every)


#: A list or tuple longer than this whose first entry (or that entry's first, for a list of
#: tuples) is data (``_DATA``) holds no module (``modules_of``): a map over a workload object
#: that keeps its 192 items scanned each of them per call (0.44 ms of 25 on molecules of 10-30
#: atoms).
_LONG = 16
_DATA = (Tensor, int, float, complex, str, bytes)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True
