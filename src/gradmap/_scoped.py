"""A thread-local value set for the length of a block, then restored: the flags that say what the
calling thread is doing (running a chunk, pulling one back)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["scoped"]

_UNSET = object()


@contextmanager
def scoped(local: threading.local, name: str, value: object) -> Iterator[None]:
    """Within it, ``local.<name>`` is ``value`` in the calling thread; after it, what it was
    (unset again if it was unset)."""
    was = getattr(local, name, _UNSET)
    setattr(local, name, value)
    try:
        yield
    finally:
        if was is _UNSET:
            delattr(local, name)
        else:
            setattr(local, name, was)
