"""Pickling for executors in other processes (Ray, local processes): a tensor that requires grad
travels as an identity.

NOTE [tensors travel as identities]:
    On the driver, ``f`` (once per call, with cloudpickle) and each chunk's items (with the
    standard pickler, cloudpickle for what it refuses) are pickled by a pickler that sees every
    tensor that requires grad reachable from them --
    module parameters, closure tensors, attributes, tensors inside items, non-leaf tensors
    computed before the call -- wherever it sits. Such a tensor is written as ``(pid, value)``:
    a number in the call's [`TensorTable`][] (which keeps the original) and its detached value.
    On a worker, the first load of a ``pid`` in a call makes a fresh leaf that requires grad (an
    ``nn.Parameter`` for a parameter) and every later load of it, in ``f`` or in any chunk's items,
    returns that same leaf, so ``f`` sees one object where the loop saw one.

    The pickling cuts the graph where a chunk's boundary does with threads (NOTE [the boundary of
    a chunk]): a non-leaf original (``b = 2 * a``) gets its gradient as an input of the join
    node, and its own upstream graph runs once, on the driver, with the summed gradient.

    Tensors that do not require grad are written as their raw bytes (a ``PickleBuffer``, no
    ``torch.save`` per storage) and only their own elements: a row of a large tensor (``tmap``
    over a tensor iterates over its rows) does not drag the whole storage along, which the
    default tensor pickling would. Results come back through a pickler that detaches every
    tensor that requires grad (the join outputs are detached on the worker).

    Functions and classes of importable modules are pickled by reference (cloudpickle's rule):
    the worker imports them, and their *module globals* are the worker's own. A tensor that
    requires grad reached that way is not the caller's; the worker refuses it (see ``_host``).

    A transport may also pass ``share``: then the leaf tensors of ``f``'s payload (parameters,
    buffers, closure constants) travel as handles to shared memory instead of their bytes
    (NOTE [parameters in shared memory] in ``gradmap._process``), so the payload is the same
    bytes from call to call while ``f`` is unchanged, and an optimizer's in-place step is seen
    by the workers without sending anything; items already in shared memory travel the same way.

    The picklers have no ``persistent_id``: the pickler calls it for every object, ints and
    strings included, which cost the caller more than the items' bytes on small bags. They catch
    tensors in ``reducer_override`` instead, which the pickler calls for objects of other than
    the builtin types only, once per object; a tensor that requires grad loads through
    ``_item_leaf`` as the call's leaf for its pid.
"""

from __future__ import annotations

import ctypes
import functools
import io
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import cloudpickle
import numpy
import torch
from torch import nn

from .._errors import add_note
from ._classes import users_classes

Tensor = torch.Tensor

__all__ = [
    "AsIs",
    "LeafResult",
    "LeafTable",
    "Share",
    "TensorTable",
    "raw_bytes",
    "readable_in_place",
    "version_of",
    "dumps",
    "dumps_results",
    "loads",
    "loads_results",
]

#: How a transport sends a leaf tensor by reference: ``share(t)`` returns a picklable stand-in
#: for ``t``'s value (it unpickles to a tensor on the worker; its ``key`` and ``storage`` name
#: what the worker must have first), or ``None`` to send its bytes.
Share = Callable[[Tensor], Any]


_PID_TAG = "gradmap.grad"


def _rebuild_tensor(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    if len(buffer):
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
    else:
        raw = torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _rebuild_copied(flat: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    return flat.reshape(shape)


_NO_NUMPY = object()
_NUMPY_DTYPES: dict[torch.dtype, Any] = {}  # torch dtype -> numpy's, or _NO_NUMPY


def _numpy_dtype(dtype: torch.dtype) -> Any:
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        try:
            found = torch.empty(0, dtype=dtype).numpy().dtype
        except (TypeError, RuntimeError):
            found = _NO_NUMPY  # bfloat16 and others numpy lacks
        _NUMPY_DTYPES[dtype] = found
    return found


def _rebuild_contiguous(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    if len(buffer):
        array_dtype = _numpy_dtype(dtype)
        if array_dtype is not _NO_NUMPY:
            # numpy's reshape, then from_numpy: 1.7 us for a small tensor, where torch's own
            # view(shape) of frombuffer costs 2.8 (most of a 0-d result's unpickling).
            return torch.from_numpy(numpy.frombuffer(buffer, dtype=array_dtype).reshape(shape))
        return torch.frombuffer(buffer, dtype=dtype).view(shape)
    return torch.empty(shape, dtype=dtype)


def raw_bytes(t: Tensor) -> Any:
    """The bytes of a contiguous CPU tensor (without conjugate or negative bits), read in place:
    a ``ctypes`` array over them, which does not keep ``t`` alive (the caller does).

    Not through numpy: ``t.numpy()`` marks the tensor's storage not resizable for good, and
    the user's items and tensors would be left so after a map (``x.resize_`` refused), where
    the loop leaves them as they were. As cheap (0.86 us against 1.0 for a small tensor)."""
    size = t.numel() * t.element_size()
    if size == 0:
        return b""
    return (ctypes.c_char * size).from_address(t.data_ptr())


def readable_in_place(t: Tensor) -> bool:
    """Whether [`raw_bytes`][] reads ``t``."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
    )


def _reduce_tensor(t: Tensor) -> Any:
    """A plain CPU tensor as its bytes; ``NotImplemented`` for anything else (default pickling).

    ``t`` does not require grad (callers detach)."""
    if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
        return NotImplemented
    if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        # The common case (a bag's many small tensors): the elements' bytes are the buffer.
        buffer = pickle.PickleBuffer(raw_bytes(t))  # type: ignore[arg-type]
        return _rebuild_contiguous, (buffer, t.dtype, tuple(t.shape))
    # A copy of ours, alive while it is pickled (the argument tuple holds it).
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.resolve_conj().resolve_neg().reshape(-1))
    return _rebuild_copied, (flat, t.dtype, tuple(t.shape))


def _is_parameter(t: Tensor) -> bool:
    """``isinstance(t, nn.Parameter)``, without its metaclass's Python check for plain tensors
    (0.5 us; a map over items that require grad asks it once per element): for those the
    check is the flag a parameter of a tensor subclass carries."""
    if type(t) is Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, nn.Parameter)


class TensorTable:
    """The tensors that require grad in one call's payloads, numbered in order of first sight.

    Attributes:
        tensors: the originals, by pid.
    """

    def __init__(self, share: Share | None = None) -> None:
        self.tensors: list[Tensor] = []
        self._refs: dict[int, tuple[str, int, Any, bool]] = {}
        self._numbers: dict[int, int] = {}
        self.share = share  # for ``f``'s payload only (``dumps(..., share=True)``)
        #: The caller's tensors that travelled as references to their memory (NOTE [tensors
        #: changed in place before a backward] in ``_map``).
        self.aliased: list[Tensor] = []

    def ref(self, t: Tensor, share: Share | None = None) -> tuple[str, int, Any, bool]:
        """The reference to ``t``: the same tuple object every time, so that a payload that
        holds ``t`` twice carries its value once (pickle memoizes the tuple)."""
        ref = self._refs.get(id(t))
        if ref is None:
            pid = self.number(t)
            value = None
            if share is not None and t.is_leaf:
                value = share(t)
                if value is not None:
                    self.aliased.append(t)
            if value is None:
                value = t.detach()
            ref = (_PID_TAG, pid, value, _is_parameter(t))
            self._refs[id(t)] = ref
        return ref

    def number(self, t: Tensor) -> int:
        """``t``'s pid, without the reference ``ref`` makes (a value travelling apart)."""
        ref = self._refs.get(id(t))
        if ref is not None:
            return ref[1]
        pid = self._numbers.get(id(t))
        if pid is None:
            pid = self._numbers[id(t)] = len(self.tensors)
            self.tensors.append(t)  # also keeps id(t) from being reused
        return pid


class LeafTable:
    """A worker's leaves for the caller's tensors of one call: pid to leaf, and back."""

    def __init__(self) -> None:
        self.leaves: dict[int, Tensor] = {}
        self._pids: dict[int, int] = {}
        self._versions: dict[int, int] = {}

    def leaf(self, pid: int, value: Tensor, is_parameter: bool) -> Tensor:
        leaf = self.leaves.get(pid)
        if leaf is None:
            leaf = nn.Parameter(value) if is_parameter else value.requires_grad_()
            self.leaves[pid] = leaf
            self._pids[id(leaf)] = pid
            self._versions[pid] = version_of(leaf)
        return leaf

    def copy(self) -> LeafTable:
        """A table with the same leaves so far (a worker's start for a call of a kept ``f``)."""
        table = LeafTable()
        table.leaves = dict(self.leaves)
        table._pids = dict(self._pids)
        table._versions = {pid: version_of(leaf) for pid, leaf in self.leaves.items()}
        return table

    def pid(self, t: Tensor) -> int | None:
        """The pid of ``t`` if it is one of the leaves, else ``None``."""
        return self._pids.get(id(t))

    def changed(self, pid: int) -> bool:
        """Whether the leaf of ``pid`` was changed in place since this table made (or copied)
        it."""
        return version_of(self.leaves[pid]) != self._versions[pid]


def version_of(t: Tensor) -> int:
    """``t``'s version counter; -1 for an inference tensor, which has none (a map called in
    ``inference_mode`` loads its payloads there, in the caller's own host)."""
    return -1 if t.is_inference() else t._version


class LeafResult:
    """A leaf requiring grad that ``f`` returned as it is, on its way back to the caller: one of
    the caller's tensors (its ``pid``), or a leaf ``f`` made (its detached ``value``, and whether
    it was a parameter). NOTE [leaves that come back from another process] in ``_host``."""

    __slots__ = ("parameter", "pid", "value")

    def __init__(self, pid: int | None, value: Tensor | None, parameter: bool) -> None:
        self.pid = pid
        self.value = value
        self.parameter = parameter

    @staticmethod
    def of(t: Tensor, pid: int | None) -> LeafResult:
        """The marker for ``t``, a leaf requiring grad (``pid``: its pid, if it is the caller's)."""
        if pid is not None:
            return LeafResult(pid, None, False)
        return LeafResult(None, t.detach(), isinstance(t, nn.Parameter))

    def __reduce__(self) -> tuple[Any, ...]:
        return LeafResult, (self.pid, self.value, self.parameter)

    def caller_object(self, table: TensorTable) -> Tensor:
        """What the caller hands out: its own tensor, or a fresh leaf of the value."""
        if self.pid is not None:
            return table.tensors[self.pid]
        assert self.value is not None
        if self.parameter:
            return nn.Parameter(self.value)
        return self.value.requires_grad_()


# NOTE [the submodules a function names]:
#     cloudpickle, pickling a function by value (``f`` in the user's script, the methods of the
#     script's model classes), lists the submodules of each package among its globals that its
#     code could name (``_find_imported_submodules``), so that unpickling imports them; it finds
#     them by scanning every name in ``sys.modules`` per package. With torch imported, about a
#     thousand names start with ``torch.``: 0.9 ms per function that uses ``torch``, most of the
#     pickling of ``f`` (1.0 ms of a closure over one tensor; 1.7 ms with a message-passing
#     model defined in the script), paid at every call before a worker gets any chunk. The
#     answer depends only on the code, its packages and the modules imported, so while gradmap
#     pickles, cloudpickle's lookup is one that remembers it per code object and packages for
#     as long as ``sys.modules`` keeps its size (an import adds to it; a module replaced in
#     place would leave an import out of the list, which the worker's own imports of the
#     package make anyway). Other pickling in the process gets the same answers.
#     cloudpickle counts a name as a submodule when the code names it anywhere, and a global of
#     that name (``ops``, a ModuleDict, beside ``import torch``) then brought ``torch.ops``,
#     which does not pickle; so a submodule whose path names a global of ``f`` bound to
#     something else is left out (``_function_getstate``, which has ``f``'s globals).
_find_submodules = getattr(cloudpickle.cloudpickle, "_find_imported_submodules", None)
_function_getstate = getattr(cloudpickle.cloudpickle, "_function_getstate", None)
_MISSING = object()
_submodules: dict[Any, list[Any]] = {}
_submodules_lock = threading.Lock()
_submodules_users = 0


def _remembered_submodules(code: Any, top_level_dependencies: Any) -> list[Any]:
    assert _find_submodules is not None
    dependencies = list(top_level_dependencies)
    packages = tuple(id(x) for x in dependencies if isinstance(x, types.ModuleType))
    if not packages:
        return []
    key = (code, packages, len(sys.modules))
    found = _submodules.get(key)
    if found is None:
        found = _find_submodules(code, dependencies)
        if len(_submodules) >= 4096:
            _submodules.clear()
        _submodules[key] = found
    return list(found)


def _function_state(func: Any) -> Any:
    """cloudpickle's state of ``func``, without the submodules that are not the modules ``func``'s
    globals of their names are bound to (NOTE [the submodules a function names])."""
    assert _function_getstate is not None
    state, slotstate = _function_getstate(func)
    found = slotstate.get("_cloudpickle_submodules")
    if found:
        slotstate["_cloudpickle_submodules"] = [
            m for m in found if _named_as_module(m.__name__, func.__globals__)
        ]
    return state, slotstate


def _named_as_module(name: str, scope: dict[str, Any]) -> bool:
    """Whether each part of module path ``name`` past the package, as a global in ``scope``,
    is missing or that module itself."""
    parts = name.split(".")
    for k in range(1, len(parts)):
        bound = scope.get(parts[k], _MISSING)
        if bound is not _MISSING and bound is not sys.modules.get(".".join(parts[: k + 1])):
            return False
    return True


@contextmanager
def _submodules_remembered() -> Iterator[None]:
    """cloudpickle's submodule lookup remembered while gradmap pickles (NOTE [the submodules a
    function names])."""
    global _submodules_users
    if _find_submodules is None:  # another cloudpickle: its own lookup
        yield
        return
    with _submodules_lock:
        _submodules_users += 1
        cloudpickle.cloudpickle._find_imported_submodules = _remembered_submodules
        if _function_getstate is not None:
            cloudpickle.cloudpickle._function_getstate = _function_state
    try:
        yield
    finally:
        with _submodules_lock:
            _submodules_users -= 1
            if not _submodules_users:
                cloudpickle.cloudpickle._find_imported_submodules = _find_submodules
                if _function_getstate is not None:
                    cloudpickle.cloudpickle._function_getstate = _function_getstate


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with tensors that require grad replaced (by ``table`` ids, or detached)."""

    def dump(self, obj: Any) -> None:
        with _submodules_remembered():
            super().dump(obj)

    def __init__(
        self,
        file: io.BytesIO,
        table: TensorTable | None,
        share: Share | None = None,
        share_shared: Share | None = None,
    ) -> None:
        super().__init__(file, protocol=5)
        self._table = table
        self._share = share
        self._share_shared = share_shared
        self.shared: dict[Any, Any] = {}  # storages named by reference: key -> storage
        self.statistics = False  # a module that updates running statistics (train mode)

    def _named(self, value: Any) -> None:
        key = getattr(value, "key", None)
        if key is not None:
            self.shared[key] = value.storage

    def reducer_override(self, obj: Any) -> Any:
        # No persistent_id (see the NOTE): a tensor that requires grad is caught here, once per
        # object (the pickler memoizes it), and loads as the call's leaf (``_item_leaf``).
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                if self._table is not None:
                    ref = self._table.ref(obj, self._share)
                    self._named(ref[2])
                    return _item_leaf, ref[1:]
                obj = obj.detach()
            if type(obj) is Tensor:
                share = self._share
                if (
                    share is None
                    and self._share_shared is not None
                    and obj.layout == torch.strided  # sparse tensors have no one storage
                    and obj.untyped_storage().is_shared()
                ):
                    share = self._share_shared  # an item already in shared memory
                if share is not None:
                    shared = share(obj)
                    if shared is not None:
                        if self._table is not None:
                            self._table.aliased.append(obj)
                        self._named(shared)
                        return _identity, (shared,)
                return _reduce_tensor(obj)
        kind = type(obj)
        if kind is torch.Generator and self._share is not None:
            # f draws from a generator it holds (not the global one, which gradmap seeds per
            # element): each worker would draw from a copy in the same state, and elements on
            # different workers would get the same numbers.
            raise RuntimeError(
                f"gradmap: f holds a torch.Generator of its own (a {obj.device.type} "
                "generator). On worker processes each worker would draw "
                "from a copy of it in the same state, so elements on different workers would "
                "get the same random numbers, and yours would not advance. Draw from the global "
                "generator in f (torch.randn(..., generator=None): gradmap seeds it per element, "
                "the same draws on every executor), pass a generator or a seed per element as "
                "an item, or use threads (executor='threads')."
            )
        if kind is type:
            if obj.__module__ == "builtins" and _is_autograd_node_class(obj):
                return _autograd_node_class, (obj.__name__,)
        elif kind is _LRU_CACHED:
            wrapped = getattr(obj, "__wrapped__", None)
            if isinstance(wrapped, types.FunctionType) and not _by_reference(wrapped):
                return _lru_cached, (wrapped, obj.cache_parameters())
        elif isinstance(obj, nn.Module):
            if isinstance(obj, _NORMS) and obj.training and obj.track_running_stats:
                self.statistics = True  # NOTE [running statistics on worker processes]
            parametrizations = obj.__dict__.get("_modules", {}).get("parametrizations")
            if isinstance(parametrizations, _PARAMETRIZATIONS):
                return _parametrized_module, (kind, dict(obj.__dict__))
        return super().reducer_override(obj)


def _identity(value: Any) -> Any:
    return value


def _is_autograd_node_class(cls: type) -> bool:
    """Whether ``cls`` is one of PyTorch's C++ autograd node classes (``DelayedError``, which
    ``torch.autograd.function.once_differentiable`` names; ``AccumulateGrad``, ...). They say
    their module is ``builtins``, where they are not, so cloudpickle would copy them by value,
    and a copy does not load (its descriptors name another class): they travel by name."""
    return getattr(torch._C._functions, cls.__name__, None) is cls


def _autograd_node_class(name: str) -> type:
    return getattr(torch._C._functions, name)  # type: ignore[no-any-return]


_PARAMETRIZATIONS = nn.ModuleDict  # a module's parametrizations (``parametrize.is_parametrized``)
_NORMS = nn.modules.batchnorm._NormBase  # BatchNorm and InstanceNorm, with running statistics


def _parametrized_module(cls: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    """A module with parametrizations (``nn.utils.parametrizations.weight_norm``,
    ``orthogonal``, ``register_parametrization``), whose class refuses to pickle (PyTorch asks
    for ``state_dict`` when saving one): rebuilt from its class, which cloudpickle sends by
    value (PyTorch makes it at run time), and its attributes, the parametrizations' original
    tensors among them, which travel as every tensor ``f`` uses does."""
    module: nn.Module = cls.__new__(cls)
    module.__setstate__(state)
    return module


_LRU_CACHED = type(functools.lru_cache(maxsize=None)(lambda: None))
_by_reference = getattr(cloudpickle.cloudpickle, "_should_pickle_by_reference", lambda obj: True)


def _lru_cached(wrapped: Callable[..., Any], parameters: dict[str, Any]) -> Any:
    """A function of the user's script under ``functools.lru_cache`` (or ``cache``), which
    pickles itself by name, where the script is not: its function travels by value as
    cloudpickle sends the script's functions, and a worker wraps it in a cache of its own."""
    return functools.lru_cache(**parameters)(wrapped)


class Payload(bytes):
    """Pickled bytes, and the shared storages they name (by key; kept alive with the payload):
    a transport that passes storages by reference sends those first. Pickles as plain bytes."""

    keys: dict[Any, Any] = {}  # noqa: RUF012 - replaced per instance
    #: ``f`` holds a module that updates running statistics in train mode (BatchNorm's).
    statistics = False

    def __reduce__(self) -> Any:
        return bytes, (bytes(self),)


def dumps(obj: Any, table: TensorTable, share: bool = False) -> Payload:
    """Pickle ``obj`` on the driver, numbering its tensors that require grad in ``table``. With
    ``share`` (``f``'s payload), its leaf tensors travel by ``table.share`` where that gives a
    reference; without (items), only tensors already in shared memory do (``share_memory_()`` on
    a dataset that is mapped over many times saves copying it for every call)."""
    sharer = table.share
    if not share:
        obj = _leaf_rows(obj, table)  # NOTE [many small tensors travel as one]
        # Items: the standard pickler first (several times faster on many small objects than
        # cloudpickle, whose hooks run in Python for each), cloudpickle for what it refuses.
        buffer = io.BytesIO()
        plain = _ItemsPickler(buffer, table, sharer)
        try:
            plain.dump(obj)
        except Exception:
            pass
        else:
            payload = Payload(buffer.getvalue())
            payload.keys = plain.shared
            return payload
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, table, sharer if share else None, None if share else sharer)
    pickler.dump(obj)
    payload = Payload(buffer.getvalue())
    payload.keys = pickler.shared
    payload.statistics = pickler.statistics
    return payload


def loads(data: bytes, leaves: LeafTable) -> Any:
    """Unpickle a driver payload on a worker; ``leaves`` is the call's, shared by all its
    payloads."""
    previous = getattr(_loading, "leaves", None)
    _loading.leaves = leaves
    try:
        return pickle.loads(data)
    except ModuleNotFoundError as exc:
        # A module only the caller has: one made at run time (torch_geometric generates a
        # ``MessagePassing`` class's ``propagate`` into ``__main___<Class>_propagate`` for a
        # class of the script; a module made by ``exec`` or ``types.ModuleType``), pickled by
        # reference. (A helper's case: the bare error named no cause and no fix.)
        add_note(
            exc,
            f"gradmap: f, or an object it uses, refers to the module {exc.name!r}, which the "
            "worker process cannot import: it exists only in the caller's process (made at "
            "run time, such as torch_geometric's generated propagate() of a MessagePassing "
            "class defined in the script) or is not on the worker's path. Define the class or "
            "function in a module file the workers can import, or use executor='threads'.",
        )
        raise
    finally:
        _loading.leaves = previous


class _ItemsPickler(pickle.Pickler):
    """The standard pickler with ``_Pickler``'s tensor rules, for items. It has no
    ``persistent_id`` (which the pickler calls for every object, ints and strings included):
    a tensor that requires grad is caught by ``reducer_override`` (called for objects of other
    than the builtin types only) and loads as the call's leaf through ``_item_leaf``."""

    def __init__(self, file: io.BytesIO, table: TensorTable, share_shared: Share | None) -> None:
        super().__init__(file, protocol=5)
        self._table = table
        self._share_shared = share_shared
        self.shared: dict[Any, Any] = {}

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            if type(obj).__module__ == "__main__" or getattr(obj, "__module__", "") == "__main__":
                # The user's script's: by value, which cloudpickle does (a worker's __main__
                # is not the script, so by reference it would not load there)
                raise pickle.PicklingError("an object of the user's script")
            return NotImplemented
        if obj.requires_grad:
            ref = self._table.ref(obj)
            key = getattr(ref[2], "key", None)
            if key is not None:
                self.shared[key] = ref[2].storage
            return _item_leaf, ref[1:]
        if type(obj) is not Tensor:
            return NotImplemented
        share = self._share_shared
        if share is not None and obj.layout == torch.strided and obj.untyped_storage().is_shared():
            shared = share(obj)
            if shared is not None:
                self._table.aliased.append(obj)
                self.shared[shared.key] = shared.storage
                return _identity, (shared,)
        return _reduce_tensor(obj)


_loading = threading.local()


def _load_leaf_rows(pids: list[int], stacked: Tensor) -> list[tuple[Tensor]]:
    leaves: LeafTable | None = getattr(_loading, "leaves", None)
    assert leaves is not None, "a payload with tensor ids loaded without a call"
    return [(leaves.leaf(pid, value, False),) for pid, value in zip(pids, _unstack(stacked))]


def _leaf_rows(obj: Any, table: TensorTable) -> Any:
    """A chunk of items that are each one tensor that requires grad, all of one shape and dtype
    (``tmap(f, xs)`` over leaves, or over the rows of a tensor made before the call), as their
    pids and their values stacked, loading as the chunk's list of 1-tuples of the call's leaves
    (NOTE [many small tensors travel as one]); any other chunk as it is."""
    if type(obj) is not list or len(obj) < _ROWS_MIN:
        return obj
    tensors = []
    for item in obj:
        if type(item) is not tuple or len(item) != 1:
            return obj
        t = item[0]
        if type(t) is not Tensor or not t.requires_grad or _is_parameter(t):
            return obj
        tensors.append(t)
    stacked = _stacked(tensors)
    if stacked is None:
        return obj
    return _PidRows(_load_leaf_rows, [table.number(t) for t in tensors], stacked)


def _item_leaf(number: int, value: Any, is_parameter: bool) -> Tensor:
    leaves: LeafTable | None = getattr(_loading, "leaves", None)
    assert leaves is not None, "a payload with tensor ids loaded without a call"
    return leaves.leaf(number, value, is_parameter)


class _PlainPickler(pickle.Pickler):
    """The standard pickler with the same tensor rules: results and gradients are tensors and
    containers, which it pickles several times faster than cloudpickle (whose pickler is the
    fallback for a result holding a lambda or a local class)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)

    def reducer_override(self, obj: Any) -> Any:  # no persistent_id: see ``_ItemsPickler``
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                obj = obj.detach()
            if type(obj) is Tensor:
                return _reduce_tensor(obj)
        return NotImplemented


# NOTE [many small tensors travel as one]:
#     A chunk's results, its cotangents and its gradients are most often one small tensor per
#     element, all of one shape and dtype (a loss, a row); pickled one by one, each costs its
#     sender ~2.2 us and its receiver ~1.7 us (``f(x) = x * 2`` on processes: four such
#     crossings per element). So ``dumps_results`` sends a list of at least ``_ROWS_MIN`` plain
#     CPU tensors of one shape and dtype (numpy's, as the bytes are read through numpy) -- the
#     message itself, or a list in the message's tuple -- as one stacked tensor (0.3 us per
#     element), and a list of ``(pid, gradient)`` pairs as the pids and one stacked tensor. The
#     receiver gets the list back, each tensor its own (``from_numpy`` of a row: 0.6 us), with
#     its own version counter, as separately pickled tensors are: a result written in place
#     does not touch its neighbours' versions. Lists of anything else travel as before. A
#     chunk of items that are each one tensor that requires grad (``tmap(f, xs)`` over leaves,
#     or over the rows of a tensor made before the call) travels the same way, as its pids and
#     the stacked values, and loads as the call's leaves (``_PidRows``).

#: The fewest tensors a list must hold to travel as one stacked tensor.
_ROWS_MIN = 8


class _Rows:
    """A list of tensors of one shape and dtype, as one stacked tensor, while it travels."""

    __slots__ = ("stacked",)

    def __init__(self, stacked: Tensor) -> None:
        self.stacked = stacked

    def __reduce__(self) -> Any:
        return _unstack, (self.stacked,)


class _PidRows:
    """Tensors of one shape and dtype, stacked, each with its pid, while they travel; ``load``
    makes them again on the other side: ``(pid, gradient)`` pairs, or a chunk's leaf items."""

    __slots__ = ("load", "pids", "stacked")

    def __init__(self, load: Callable[[list[int], Tensor], Any], pids: list[int], stacked: Tensor):
        self.load = load
        self.pids = pids
        self.stacked = stacked

    def __reduce__(self) -> Any:
        return self.load, (self.pids, self.stacked)


def _unstack(stacked: Tensor) -> list[Tensor]:
    """The tensors ``_Rows`` stacked, each a tensor of its own over the received bytes."""
    array = stacked.numpy()
    if array.ndim == 1:  # rows of 0-d tensors: numpy's iteration would give scalars
        return [torch.from_numpy(array[i, ...]) for i in range(array.shape[0])]
    return [torch.from_numpy(row) for row in array]


def _unstack_pairs(pids: list[int], stacked: Tensor) -> list[tuple[int, Tensor]]:
    return list(zip(pids, _unstack(stacked)))


def _stacked(tensors: list[Any]) -> Tensor | None:
    """``tensors`` stacked, if they are plain CPU tensors of one shape and a numpy dtype."""
    first = tensors[0]
    if type(first) is not Tensor or first.layout != torch.strided or first.is_nested:
        return None
    dtype = first.dtype
    if _numpy_dtype(dtype) is _NO_NUMPY or first.device.type != "cpu":
        return None
    for t in tensors:
        if type(t) is not Tensor or t.dtype != dtype:
            return None
    try:
        with torch.no_grad():
            stacked = torch.stack(tensors)
    except RuntimeError:  # shapes, devices or layouts that differ
        return None
    return stacked if stacked.device.type == "cpu" and stacked.layout == torch.strided else None


def _packed_list(items: list[Any]) -> Any:
    if len(items) < _ROWS_MIN:
        return items
    first = items[0]
    if type(first) is Tensor:
        stacked = _stacked(items)
        return items if stacked is None else _Rows(stacked)
    pairs = type(first) is tuple and len(first) == 2 and type(first[1]) is Tensor
    if pairs and all(type(p) is tuple and len(p) == 2 and type(p[0]) is int for p in items):
        stacked = _stacked([g for _, g in items])
        if stacked is not None:
            return _PidRows(_unstack_pairs, [pid for pid, _ in items], stacked)
    return items


def _packed(obj: Any) -> Any:
    """``obj`` with its lists of small tensors (itself, or in its tuple) stacked (NOTE [many
    small tensors travel as one])."""
    kind = type(obj)
    if kind is list:
        return _packed_list(obj)
    if kind is tuple and any(type(x) is list for x in obj):
        return tuple(_packed_list(x) if type(x) is list else x for x in obj)
    return obj


def dumps_results(obj: Any) -> bytes:
    """Pickle ``obj`` with every tensor that requires grad detached (results, gradients); its
    lists of small tensors travel as one (NOTE [many small tensors travel as one])."""
    buffer = io.BytesIO()
    try:
        _PlainPickler(buffer).dump(_packed(obj))
    except Exception:
        buffer = io.BytesIO()
        buffer.write(_BY_CLOUDPICKLE)
        _Pickler(buffer, None).dump(obj)
    return buffer.getvalue()


#: The first byte of results that cloudpickle pickled (a pickle's own first byte is 0x80).
_BY_CLOUDPICKLE = b"\xfe"


def loads_results(data: Any) -> Any:
    """Unpickle what [`dumps_results`][] made (the caller's own host answers unpickled); what
    cloudpickle pickled (objects of classes the user's script defines, among others) with the
    user's own classes (NOTE [the user's classes stay theirs])."""
    if not isinstance(data, bytes):
        return data
    if data[:1] == _BY_CLOUDPICKLE:
        with users_classes():
            return pickle.loads(memoryview(data)[1:])
    return pickle.loads(data)


class AsIs:
    """Arguments handed to the caller's own host as they are, not pickled: cotangents."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value
