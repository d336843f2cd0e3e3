"""The caller's warnings filters, taken by the workers that run its calls.

NOTE [the caller's warnings filters]:
    ``warnings.filterwarnings`` and ``simplefilter`` change the caller's process only, and a
    worker printed every warning ``f`` raised (a library's FutureWarning once per worker) that
    the loop would have ignored, or went on where the loop raised (``"error"``). So each call's
    ``CallSpec`` carries the caller's filters -- each one pickled by itself (those that do not
    pickle stay behind), with a digest of them all, remembered while ``warnings.filters`` stays
    equal, so an unchanged list costs a comparison per call -- and a worker process sets them
    when their digest is not the one it set last (each unpickled alone: one whose category the
    worker cannot import is left out). A worker does not set its own filters back after a call:
    the chunks of one call run on several of its threads at once, and a thread restoring them
    would take the caller's filters from another mid-chunk; the worker runs its caller's calls
    only, and keeps the filters of the latest. The caller's own process (its chunks there) has
    them already.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import warnings
from typing import Any, cast

__all__ = ["caller_filters", "take_filters"]

#: What ``caller_filters`` gave last: (the filters it saw, what it gave).
_last: tuple[tuple[Any, ...], tuple[bytes, bytes] | None] | None = None
#: The digest of the filters this process set last.
_set_last: bytes | None = None
_lock = threading.Lock()


def caller_filters() -> tuple[bytes, bytes] | None:
    """The caller's warnings filters as they travel, ``(digest, payload)`` (``None``: none
    pickles)."""
    global _last
    now = tuple(warnings.filters)
    last = _last
    if last is not None and last[0] == now:
        return last[1]
    blobs = []
    for entry in now:
        try:
            blobs.append(pickle.dumps(entry))
        except Exception:  # (a category that does not pickle: the worker's own filters for it)
            continue
    payload = pickle.dumps(tuple(blobs))
    shipped = (hashlib.blake2b(payload, digest_size=16).digest(), payload) if blobs else None
    _last = (now, shipped)
    return shipped


def take_filters(shipped: tuple[bytes, bytes] | None) -> None:
    """In a worker process: the caller's filters, unless they are those it set last."""
    global _set_last
    if shipped is None or shipped[0] == _set_last:
        return
    with _lock:
        if shipped[0] == _set_last:
            return
        filters = []
        for blob in pickle.loads(shipped[1]):
            try:
                filters.append(pickle.loads(blob))
            except Exception:  # (a category this process cannot import)
                continue
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is None:
            warnings.resetwarnings()  # (public: tells the warnings machinery they changed)
        cast(list, warnings.filters)[:] = filters  # (in place: the C module's list too)
        if mutated is not None:
            mutated()
        _set_last = shipped[0]
