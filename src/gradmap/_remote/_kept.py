"""Items kept from call to call: a chunk whose items are the same as at an earlier map is not
pickled again by the caller, nor unpickled again by a worker that has them.

NOTE [items kept from call to call]:
    Training maps over the same items at every step, and a chunk's items cost the caller a
    pickling (about 2 us per tensor, and a copy of its bytes) and each worker an unpickling
    (as much again) at every call. So the caller keeps, for a chunk of items it pickled, the
    payload and a *reference*: the chunk's structure and every tensor's bytes. At the next map,
    a chunk made of the same objects (looked up by their ids) is checked against the reference
    -- the same types, scalars, dtypes and shapes, and the same bytes, compared in full -- and
    travels as its earlier payload, under the same key ([`KeptItems`][]). The check reads the
    items' memory as a copy would and makes no Python object per element; it is what makes the
    reuse safe: a tensor written in place by any route (``x.data``, a numpy view, a loader that
    refills its buffers) is seen, where its version counter would not be.

    Only chunks of plain values are kept: tuples and named tuples of ints, floats, strings,
    ``None`` and plain contiguous CPU tensors that do not require grad (the data of most maps).
    A chunk holding anything else -- lists and dicts (which may change without a trace), other
    objects, tensors that require grad (which travel as the call's identities, NOTE [tensors
    travel as identities]), tensors in shared memory (which travel as handles already) -- is
    pickled at every call, as before.

    A host (a worker, or the caller's own host) keeps the items it unpickled from a kept
    payload, by key, and hands ``f`` the same objects at the next call with that key, unless one
    of their tensors was written in place (its version changed: ``f`` wrote into its items) --
    then it unpickles the payload again, which every call carries (a worker process holds it:
    NOTE [kept items cross to a worker process once]). Nothing has to be told back to the
    caller, so concurrent maps on one worker need no bookkeeping between them. (A write
    that bypasses the version counter, ``x.data`` or numpy inside ``f``, is not seen there; it
    changes a worker's copy, which in the loop would have changed the caller's items.)

    Both sides keep at most ``KEPT_BYTES`` of payloads, least recently used out first; the
    caller drops a chunk's entry as soon as one of its tensors is freed.

NOTE [kept items cross to a worker process once]:
    A kept payload still crossed the socket at every call (ragged bags: 7 MB a call, copied
    four times on the way: pickled into the message, through the socket, read, unpickled). A
    worker process now holds the payloads it was sent ([`HeldPayloads`][], by key, at most
    ``KEPT_BYTES``), and the caller keeps per worker an account of them ([`PayloadAccount`][]):
    the first call sends a chunk's payload (``_ToHold``), the calls after send its key alone
    (``_HeldRef``). The account is exact by construction: both sides are the same LRU with the
    same budget and the same sizes, and both are touched at the same points in the same order
    -- the caller as it writes a call to the worker (under the worker's lock, so message order),
    the worker as it *unpickles* that message (its main loop, one message after another, before
    anything in the call can fail). A payload over the budget is never held on either side (it
    travels whole every time). A worker that dies takes its payloads with it, and its
    replacement starts with an empty account. The caller's own host and Ray's actors get the
    payload with every call as before (the caller's host in place, with nothing copied).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import uuid
import weakref
from collections import OrderedDict
from typing import Any, cast

import torch

from .._torch._native import native
from ._pickling import LeafTable, loads, raw_bytes, readable_in_place, version_of

__all__ = [
    "KEPT_BYTES",
    "HeldPayloads",
    "ItemsCache",
    "KeptItems",
    "KeptOnHost",
    "PayloadAccount",
    "held_payloads",
    "items_cache",
]

Tensor = torch.Tensor

#: Bytes of kept payloads on each side (the caller keeps the reference too: as much again).
KEPT_BYTES = 128 << 20

_ATOMS = (int, str, bool, type(None), bytes)


class KeptItems:
    """A chunk's items as a kept payload: the key names the content (one key, one payload)."""

    __slots__ = ("key", "payload")

    def __init__(self, key: int, payload: bytes) -> None:
        self.key = key
        self.payload = payload

    def __reduce__(self) -> Any:
        return KeptItems, (self.key, self.payload)


class _LRU:
    """Sizes by key, least recently used first, at most ``budget`` in all: the one rule both
    sides of NOTE [kept items cross to a worker process once] follow."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0
        self.entries: OrderedDict[int, Any] = OrderedDict()

    def touch(self, key: int) -> bool:
        """Whether ``key`` is held; if so, it is now the most recently used."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        return False

    def add(self, key: int, size: int, value: Any) -> bool:
        """Hold ``value`` under ``key`` (least recently used out, past the budget); ``False``
        if it is over the budget alone (not held)."""
        if size > self.budget:
            return False
        old = self.entries.pop(key, None)
        if old is not None:
            self.size -= old[0]
        self.entries[key] = (size, value)
        self.size += size
        while self.size > self.budget:
            self.size -= self.entries.popitem(last=False)[1][0]
        return True


class PayloadAccount:
    """The caller's account of the kept payloads one worker process holds (NOTE [kept items
    cross to a worker process once]); used under the worker's lock, as calls are written."""

    def __init__(self, budget: int = KEPT_BYTES) -> None:
        self._held = _LRU(budget)

    def wire(self, items: KeptItems) -> Any:
        """What travels for ``items`` in the call being written: its key, if the worker holds
        the payload; else the payload, for the worker to hold."""
        if self._held.touch(items.key):
            return _HeldRef(items.key)
        if self._held.add(items.key, len(items.payload), None):
            return _ToHold(items)
        return items

    def __contains__(self, key: int) -> bool:
        return key in self._held.entries


class HeldPayloads:
    """The kept payloads a worker process holds, by key (NOTE [kept items cross to a worker
    process once]); touched only while a message is unpickled."""

    def __init__(self, budget: int = KEPT_BYTES) -> None:
        self._held = _LRU(budget)
        self._lock = threading.Lock()

    def hold(self, key: int, payload: bytes) -> KeptItems:
        items = KeptItems(key, payload)
        with self._lock:
            self._held.add(key, len(payload), items)
        return items

    def get(self, key: int) -> KeptItems:
        with self._lock:
            if self._held.touch(key):
                return cast(KeptItems, self._held.entries[key][1])
        raise RuntimeError(
            "gradmap: a worker process was sent the key of a chunk's items that it does not "
            "hold (the caller's account of its payloads is out of step). This is a bug in "
            "gradmap; please report it. executor='threads' is not affected."
        )

    def __len__(self) -> int:
        return len(self._held.entries)


held_payloads = HeldPayloads()


def _hold(key: int, payload: bytes) -> KeptItems:
    return held_payloads.hold(key, payload)


def _held(key: int) -> KeptItems:
    return held_payloads.get(key)


class _ToHold:
    """A kept payload sent to a worker process that is to hold it: it unpickles as the
    ``KeptItems``, held."""

    __slots__ = ("items",)

    def __init__(self, items: KeptItems) -> None:
        self.items = items

    def __reduce__(self) -> Any:
        return _hold, (self.items.key, self.items.payload)


class _HeldRef:
    """The key of a payload the worker process holds: it unpickles as the held ``KeptItems``."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key

    def __reduce__(self) -> Any:
        return _held, (self.key,)


def _flatten(obj: Any, atoms: list[Any], tensors: list[Tensor]) -> bool:
    """Append ``obj``'s structure and scalars to ``atoms`` and its tensors to ``tensors``;
    ``False`` if it holds something that is not kept.

    (Tensors and tuples first, a loop rather than ``all`` over a generator, and whether a class
    is a named tuple looked up once: 0.7 us an item of small bags, where the checks in turn and
    a generator per tuple took 1.5 -- most of the caller's check of a chunk of 32 such items.)
    """
    kind = type(obj)
    if kind is Tensor:
        if obj.requires_grad or not obj.is_cpu or obj.layout != _STRIDED:
            return False
        atoms.append(obj.dtype)
        atoms.append(obj.shape)
        tensors.append(obj)
        return True
    if kind is tuple or _named_tuple(kind):
        atoms.append(kind)
        atoms.append(len(obj))
        for child in obj:  # noqa: SIM110 (no generator per tuple: see above)
            if not _flatten(child, atoms, tensors):
                return False
        return True
    if kind in _ATOMS:
        atoms.append(kind)
        atoms.append(obj)
        return True
    if kind is float:
        # -0.0 == 0.0 but they are other bytes; a NaN never equals itself (no reuse).
        atoms.append(kind)
        atoms.append(obj)
        atoms.append(math.copysign(1.0, obj))
        return True
    return False


def _flatten_all(chunk: Any, atoms: list[Any], tensors: list[Tensor]) -> bool:
    """[`_flatten`][] of each element's arguments in turn."""
    for args in chunk:  # noqa: SIM110 (no generator: see ``_flatten``)
        if not _flatten(args, atoms, tensors):
            return False
    return True


_STRIDED = torch.strided
_NAMED_TUPLES: dict[type, bool] = {}  # class -> whether it is a named tuple


def _named_tuple(kind: type) -> bool:
    found = _NAMED_TUPLES.get(kind)
    if found is None:
        if len(_NAMED_TUPLES) > 1024:  # classes made on the fly: do not hold them all
            _NAMED_TUPLES.clear()
        found = _NAMED_TUPLES[kind] = issubclass(kind, tuple) and hasattr(kind, "_fields")
    return found


def _contents(tensors: list[Tensor]) -> bytes | None:
    """Every tensor's bytes, one after another; ``None`` where one cannot be read so (not
    contiguous, conjugate or negative bits, not on the CPU)."""
    if not all(readable_in_place(t) for t in tensors):
        return None
    return b"".join([raw_bytes(t) for t in tensors])  # (not numpy's view: see ``raw_bytes``)


def _find_memcmp() -> Any:
    try:
        libc = ctypes.CDLL("msvcrt" if sys.platform == "win32" else None)
        memcmp = libc.memcmp
    except (OSError, AttributeError):  # pragma: no cover - no C library to call
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_memcmp = _find_memcmp()


def _same_contents(tensors: list[Tensor], reference: bytes, address: int | None) -> bool:
    """Whether the tensors' bytes, one after another, are ``reference`` (at ``address``).

    NOTE [kept items compared in place]:
        The check of a kept chunk read every tensor's bytes into one new buffer and compared
        that: for ragged bags, 7 MB allocated, copied and compared at every call, 1.3-3 ms of
        the caller's time (the larger figure while the freed buffer's pages were handed back
        to the system and faulted in again). Each tensor is now compared where it lies, with
        the C library's ``memcmp``, against its place in the reference: nothing is copied
        (0.4 ms for the same chunks). Where no ``memcmp`` is found, the copy as before.
        The native module's ``same_bytes`` runs the same checks and comparisons in one call,
        where the loop below spent 1.5 us of Python on each tensor (ragged bags: 13 us a chunk
        of four bags against 4, about 0.6 ms of the caller's time a call)."""
    if address is None:
        return _contents(tensors) == reference
    module = native()
    if module is not None:
        return bool(module.same_bytes(tensors, address, len(reference)))
    if _memcmp is None:
        return _contents(tensors) == reference
    if not all(readable_in_place(t) for t in tensors):
        return False
    end = len(reference)
    offset = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if offset + size > end:
            return False
        if size and _memcmp(t.data_ptr(), address + offset, size):
            return False
        offset += size
    return offset == end


def _address(reference: bytes) -> int | None:
    """Where ``reference``'s bytes lie (while it lives; CPython does not move them)."""
    return ctypes.cast(ctypes.c_char_p(reference), ctypes.c_void_p).value


class _Entry:
    __slots__ = ("__weakref__", "address", "atoms", "contents", "items", "refs")

    def __init__(self, atoms: list[Any], contents: bytes, items: KeptItems) -> None:
        self.atoms = atoms
        self.contents = contents
        self.address = _address(contents) if contents else None
        self.items = items
        self.refs: list[Any] = []


class ItemsCache:
    """The caller's kept chunk payloads, by the ids of the chunk's items."""

    def __init__(self, budget: int = KEPT_BYTES) -> None:
        self.budget = budget
        self.size = 0
        self.hits = 0  # chunks sent as kept (for tests and the curious)
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        # Reentrant: a tensor freed by a collection while the lock is held drops its entry.
        self._lock = threading.RLock()

    def after_fork(self) -> None:
        """In a forked child: the lock free again (NOTE [after a fork] in ``_executors``)."""
        self._lock._at_fork_reinit()  # type: ignore[attr-defined]

    def lookup(self, chunk: list[tuple[Any, ...]]) -> tuple[KeptItems | None, Any]:
        """The kept payload of ``chunk`` if its items are what they were when it was kept;
        else ``None`` and what [`keep`][] needs."""
        ident = tuple([id(a) for args in chunk for a in args])
        with self._lock:
            entry = self._entries.get(ident)
            if entry is not None:
                self._entries.move_to_end(ident)
        atoms: list[Any] = []
        tensors: list[Tensor] = []
        if not _flatten_all(chunk, atoms, tensors):
            return None, None
        # NOTE [kept items compared in place]
        if (
            entry is not None
            and atoms == entry.atoms
            and _same_contents(tensors, entry.contents, entry.address)
        ):
            self.hits += 1
            return entry.items, None
        return None, (ident, atoms, tensors)

    def keep(self, found: Any, payload: bytes) -> KeptItems | None:
        """Keep ``payload`` for a chunk [`lookup`][] did not find (``found`` is what it said
        then); ``None`` where the chunk is not kept."""
        if found is None or getattr(payload, "keys", None) or len(payload) > self.budget:
            return None
        ident, atoms, tensors = found
        contents = _contents(tensors)
        if contents is None:
            return None
        # A key no other caller makes (Ray's actors may outlive one driver), and plain bytes:
        # the payload is pickled into every call that sends it.
        items = KeptItems(uuid.uuid4().int, bytes(payload))
        entry = _Entry(atoms, contents, items)
        with self._lock:
            old = self._entries.pop(ident, None)
            if old is not None:
                self.size -= len(old.items.payload)
            self._entries[ident] = entry
            self.size += len(payload)
            while self.size > self.budget:
                _, dropped = self._entries.popitem(last=False)
                self.size -= len(dropped.items.payload)
        # The entry goes when any of its tensors is freed (its id may then name another).
        drop = _Dropper(self, ident, entry)
        entry.refs = [weakref.ref(t, drop) for t in tensors]
        return items

    def _drop(self, ident: tuple[int, ...], entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(ident) is entry:
                del self._entries[ident]
                self.size -= len(entry.items.payload)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.size = 0


class _Dropper:
    """A weakref callback that drops one entry (holds the cache weakly: no cycle)."""

    __slots__ = ("cache", "entry", "ident")

    def __init__(self, cache: ItemsCache, ident: tuple[int, ...], entry: _Entry) -> None:
        self.cache = weakref.ref(cache)
        self.ident = ident
        self.entry = weakref.ref(entry)

    def __call__(self, _: Any) -> None:
        cache, entry = self.cache(), self.entry()
        if cache is not None and entry is not None:
            cache._drop(self.ident, entry)


items_cache = ItemsCache()
os.register_at_fork(after_in_child=items_cache.after_fork)  # NOTE [after a fork]


class KeptOnHost:
    """A host's items unpickled from kept payloads, by key."""

    def __init__(self, budget: int = KEPT_BYTES) -> None:
        self.budget = budget
        self.size = 0
        self._kept: OrderedDict[int, tuple[Any, list[tuple[Tensor, int]], int]] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, items: Any, leaves: LeafTable) -> Any:
        """The items of a chunk: unpickled from a plain payload, or the kept ones."""
        if type(items) is not KeptItems:
            return loads(items, leaves)
        with self._lock:
            entry = self._kept.get(items.key)
            if entry is not None:
                self._kept.move_to_end(items.key)
        if entry is not None:
            local, versions, _ = entry
            if all(version_of(t) == v and not t.requires_grad for t, v in versions):
                return local
        local = loads(items.payload, leaves)
        atoms: list[Any] = []
        tensors: list[Tensor] = []
        if _flatten_all(local, atoms, tensors):
            size = len(items.payload)
            with self._lock:
                old = self._kept.pop(items.key, None)
                if old is not None:
                    self.size -= old[2]
                self._kept[items.key] = (local, [(t, version_of(t)) for t in tensors], size)
                self.size += size
                while self.size > self.budget:
                    self.size -= self._kept.popitem(last=False)[1][2]
        return local
