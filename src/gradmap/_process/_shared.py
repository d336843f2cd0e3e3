"""Tensors in shared memory: the caller's side (a tensor's storage, by key) and the worker's
side (the storages it was sent, by key).

NOTE [parameters in shared memory]:
    The leaf tensors of ``f``'s payload -- module parameters and buffers, closure and attribute
    tensors -- travel to the worker processes as references, not bytes. The first time one is
    sent, its storage is moved into shared memory in place (``UntypedStorage._share_fd_cpu_``,
    what ``Tensor.share_memory_()`` does: the same storage object, so the tensor, its views and an
    optimizer holding it see nothing change but where the bytes live), and the storage's file
    descriptor is passed to each worker once, over a Unix socket (``SCM_RIGHTS``); the worker
    maps the same pages. After that, a payload names the storage by a key, and an optimizer's
    in-place step is seen by every worker with nothing sent.

    The key is the shared file's identity (device and inode), not the storage's address: an
    address can be reused by a new storage after the old one is freed, and a worker would then
    read the old pages. The inode cannot be reused while the worker still maps the file. A
    swapped storage (``p.data = torch.randn(...)``) is a new storage: it is noticed at the next
    call (its key is new), shared and sent; nothing goes stale.

    Storages are tracked weakly: when one dies in the caller (a step's temporary tensor that
    ``f`` closed over, a swapped parameter's old storage), its key is queued, and the next call
    to each worker that holds it tells that worker to forget it, so neither side keeps its
    descriptor or its pages. A map's payload keeps the storages it names alive while the map
    lives (a worker that restarts mid-map gets them again).

    ``f``'s payload is then the same bytes from call to call while ``f`` is unchanged (the keys
    do not change with the values), so a worker keeps it, and the function unpickled from it, by
    the payload's digest, and a call sends the digest alone.

    Not shared: tensors on other devices, sparse, quantized or subclassed tensors, and tensors
    whose storage must not move: one PyTorch marks not resizable, because a numpy array shares
    it (``torch.from_numpy(a)``, or ``t.numpy()`` taken before the map: moved, the tensor would
    stop sharing the array's memory, or the array would point at freed memory); they travel by
    value.
    Items travel by value too; a chunk of them that has not changed since an earlier call is
    not pickled again (NOTE [items kept from call to call] in ``_remote/_kept.py``).
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import torch

__all__ = [
    "FDS_PER_MESSAGE",
    "SharedRef",
    "Sharer",
    "WorkerStorages",
    "caller_storages",
    "worker_storages",
]

#: File descriptors sent in one datagram on the second socket (the kernel's limit is 253).
FDS_PER_MESSAGE = 200

Tensor = torch.Tensor

_SHAREABLE = (torch.Tensor, torch.nn.Parameter)


class SharedRef:
    """A tensor's place in a shared storage; unpickles to the tensor on a worker. ``storage``
    (not pickled) keeps the storage alive while the payload naming it is."""

    __slots__ = ("key", "place", "storage")

    def __init__(self, storage: Any, key: tuple[int, int], t: Tensor) -> None:
        self.storage = storage
        self.key = key
        # dtype, shape, stride, offset: ``_rebuild``'s arguments after the key
        self.place = (t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def __reduce__(self) -> Any:
        return _rebuild, (self.key, *self.place)


class Sharer:
    """The caller's shared storages, by key, and the file descriptors to send for them."""

    def __init__(self) -> None:
        # Plain dict and list operations only (atomic under the GIL): ``_died`` runs from a
        # finalizer, at any allocation of any thread, and must take no lock.
        self._fds: dict[tuple[int, int], tuple[int, int, Any]] = {}
        self.dead: list[tuple[int, int]] = []  # keys whose storages died, to forget

    def __call__(self, t: Tensor) -> SharedRef | None:
        """A reference to ``t`` in shared memory (moving its storage there), or ``None`` if it
        travels by value."""
        if (
            type(t) not in _SHAREABLE
            or t.device.type != "cpu"
            or t.layout != torch.strided
            or t.is_quantized
        ):
            return None
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or not (storage.is_shared() or storage.resizable()):
            # Not resizable, and still to move: numpy's memory (``torch.from_numpy``), or memory
            # a numpy array points at (``t.numpy()``): moved, the array would lose the tensor,
            # or point at freed memory. By value.
            return None
        moved = not storage.is_shared()
        if moved and len(self._fds) >= _fd_budget():
            _warn_fds(len(self._fds))  # NOTE [file descriptors of shared storages]
            return None
        try:
            fd, size = storage._share_fd_cpu_()  # in place; returns the same fd once shared
        except Exception:
            return None  # a storage that cannot move (from numpy), or shared by file name
        if moved:
            _not_resizable(storage)
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        if key not in self._fds:
            self._fds[key] = (fd, size, weakref.finalize(storage, self._died, key))
            caller_storages[key] = storage
        return SharedRef(storage, key, t)

    def fd(self, key: tuple[int, int]) -> tuple[int, int]:
        """The file descriptor and size of a live shared storage (the storage holds the fd)."""
        fd, size, _ = self._fds[key]
        return fd, size

    def _died(self, key: tuple[int, int]) -> None:
        self._fds.pop(key, None)
        self.dead.append(key)

    def take_dead(self) -> set[tuple[int, int]]:
        """The keys whose storages died since the last call."""
        dead, self.dead = self.dead, []
        return set(dead)


class WorkerStorages:
    """A worker's shared storages, by key."""

    def __init__(self) -> None:
        self.storages: dict[tuple[int, int], Any] = {}

    def add(self, key: tuple[int, int], fd: int, size: int) -> None:
        try:
            self.storages[key] = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]
        finally:
            os.close(fd)

    def forget(self, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            self.storages.pop(key, None)


worker_storages = WorkerStorages()

#: The caller's shared storages, by key, for the chunks the caller runs itself (``_local.py``).
caller_storages: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()


def _rebuild(
    key: tuple[int, int],
    dtype: torch.dtype,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
) -> Tensor:
    storage = worker_storages.storages.get(key)
    if storage is None:  # in the caller: a chunk it runs itself
        storage = caller_storages[key]
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def _not_resizable(storage: torch.UntypedStorage) -> None:
    """Mark a storage moved into shared memory as not resizable.

    NOTE [shared storages are not resizable]:
        PyTorch (2.13, CPU) crashes the process (SIGSEGV) resizing a storage in shared memory
        (``t.share_memory_(); t.resize_(8)``, no gradmap involved), and a tensor ``f`` uses is
        moved there in place: a later ``resize_`` of it, or an ``out=`` tensor of another size,
        crashed the user's program after a map, where it works after the loop. Marked not
        resizable, it raises PyTorch's "Trying to resize storage that is not resizable"
        instead. The mark is the one a numpy view of the bytes leaves (PyTorch has no other way
        to set it from Python); it lasts as long as the storage.
    """
    if storage.nbytes():
        view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        view.numpy()  # (the array goes at once; the storage stays marked)


def _fd_budget() -> int:
    """How many storages gradmap moves into shared memory at most: half the process's limit of
    open files (NOTE [file descriptors of shared storages])."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 512
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft // 2)


_told_fds = False


def _warn_fds(count: int) -> None:
    """NOTE [file descriptors of shared storages]:
    A storage in shared memory keeps a file descriptor open in the caller for as long as it
    lives (PyTorch's file-descriptor sharing). A model of 1,200 parameter tensors took them
    all under the usual limit of 1,024: the storages past it went by value, and the user's
    next ``open()`` failed with "Too many open files" (so did gradmap's own build of its
    native walk). gradmap now moves at most half the limit; the rest travel by value at
    every call, which costs pickling time, and the first such call says so, once."""
    global _told_fds
    if _told_fds:
        return
    _told_fds = True
    warnings.warn(
        f"gradmap: f uses more tensors than gradmap moves into shared memory ({count}, half "
        "the process's limit of open files: each keeps a file descriptor open); the others "
        "are pickled at every call. Raise the limit (ulimit -n, or resource.setrlimit with "
        "RLIMIT_NOFILE) before the first map, or use fewer, larger tensors.",
        RuntimeWarning,
        stacklevel=2,
    )
