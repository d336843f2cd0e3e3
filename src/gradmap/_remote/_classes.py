"""The user's classes across processes: the caller's own classes stay as they are, and objects
that come back to the caller are of them.

NOTE [the user's classes stay theirs]:
    cloudpickle sends a class of the user's script (``__main__``) by value, with an id it keeps
    per process. Unpickled in the process that pickled it, cloudpickle finds the user's own class
    by that id and sets the pickled attributes on it: its methods become copies reading copies
    of the script's globals, for the rest of the process (a global parameter used in
    ``forward`` then got no gradient, from the loop too). Two places in the caller unpickle
    what holds such classes, and each takes its own way:
    - the caller's own host (``_process/_local``) unpickles ``f`` and the items to run chunks
      as a worker does: there the classes load as fresh copies (``fresh_classes``), as in a
      worker, and what the copies make -- results, exceptions -- is handed back as the user's
      class (``as_users``: an object's ``__class__`` set back, an enum member looked up by name),
      so that ``isinstance`` and ``except`` work as in the loop;
    - what a worker sends back (results, exceptions) loads with the user's own class found and
      left as it is (``users_classes``): the same objects as the loop's, nothing rebound.
    Both patch two functions of cloudpickle's module for the length of one unpickling, under one
    lock: another thread unpickling with cloudpickle meanwhile is affected the same way.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["as_users", "as_users_class", "fresh_classes", "users_classes"]

_lock = threading.Lock()
os.register_at_fork(after_in_child=_lock._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]

#: Each copy made by ``fresh_classes``, to the user's own class it copies.
_originals: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


@contextmanager
def _patched(
    lookup: Callable[[Any, Any], Any], setstate: Callable[[Any, Any], Any] | None
) -> Iterator[None]:
    from cloudpickle import cloudpickle as cp

    with _lock:
        saved = cp._lookup_class_or_track, cp._class_setstate
        cp._lookup_class_or_track = lookup
        if setstate is not None:
            cp._class_setstate = setstate
        try:
            yield
        finally:
            cp._lookup_class_or_track, cp._class_setstate = saved


def _users_class(class_tracker_id: Any) -> type | None:
    from cloudpickle import cloudpickle as cp

    if class_tracker_id is None:
        return None
    return cp._DYNAMIC_CLASS_TRACKER_BY_ID.get(class_tracker_id)  # type: ignore[no-any-return]


def _copy(class_tracker_id: Any, class_def: Any) -> Any:
    original = _users_class(class_tracker_id)
    if original is not None and original is not class_def:
        _originals[class_def] = original
    return class_def


def fresh_classes() -> Any:
    """While the caller's own host unpickles ``f`` or items: the classes sent by value load as
    fresh copies, as in a worker (NOTE [the user's classes stay theirs])."""
    return _patched(_copy, None)


@contextmanager
def users_classes() -> Iterator[None]:
    """While the caller unpickles what a worker sent back: a class the caller sent by value is
    the user's own, left as it is (NOTE [the user's classes stay theirs])."""
    from cloudpickle import cloudpickle as cp

    found: set[int] = set()
    setstate = cp._class_setstate

    def lookup(class_tracker_id: Any, class_def: Any) -> Any:
        original = _users_class(class_tracker_id)
        if original is None:
            return class_def  # a class the worker made: a copy of its own
        found.add(id(original))
        return original

    def keep(obj: Any, state: Any) -> Any:
        return obj if id(obj) in found else setstate(obj, state)

    with _patched(lookup, keep):
        yield


def as_users_class(cls: type) -> type:
    """``cls``, or the user's own class where it is a copy ``fresh_classes`` made."""
    return _originals.get(cls, cls) if _originals else cls


def as_users(obj: Any) -> Any:
    """``obj``, of the user's own class where it is of a copy ``fresh_classes`` made."""
    if not _originals:
        return obj
    original = _originals.get(type(obj))
    if original is None:
        return obj
    if isinstance(obj, enum.Enum):
        return original[obj.name]  # type: ignore[index]
    with contextlib.suppress(TypeError):  # (a layout that differs: left a copy)
        obj.__class__ = original
    return obj
