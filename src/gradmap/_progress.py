"""Progress bars for long maps: one per pass (forward, backward), counting elements.

Updated once per chunk, from whichever thread finished the chunk, under a lock: a bar costs one
call per chunk, not per element, so it does not slow the map measurably.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["PassProgress", "open_progress"]


class PassProgress:
    """The bar of one pass; ``update`` is safe from any thread."""

    def __init__(self, bar: Any, owned: bool) -> None:
        self._bar = bar
        self._owned = owned
        self._lock = threading.Lock()

    def update(self, elements: int) -> None:
        with self._lock:
            self._bar.update(elements)

    def close(self) -> None:
        if self._owned:
            self._bar.close()


def open_progress(
    progress: Any, phase: str, total: int, api: str = "gradmap.tmap"
) -> PassProgress | None:
    """The bar for one pass of ``total`` elements, as ``tmap``'s ``progress`` argument asks.

    Arguments:
        progress: ``False``/``None`` (no bar); ``True`` (a ``tqdm`` bar per pass); a tqdm
            *instance* or any object with ``update(n)`` (used as is for every pass, never closed);
            or a callable such as ``tqdm.tqdm`` or ``functools.partial(tqdm.tqdm, leave=False)``,
            called as ``progress(total=total, desc=...)`` to make each pass's bar.
        phase: ``"forward"`` or ``"backward"``.
        total: the elements in the pass.
        api: the public function called, named in errors.

    Returns:
        The bar, or ``None`` when there is none.
    """
    if progress is None or progress is False:
        return None
    desc = f"gradmap {phase}"
    if progress is True:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            raise ImportError(
                f"{api}(progress=True) draws its bars with tqdm, which is not installed: "
                "pip install 'gradmap[progress]' (or pip install tqdm)"
            ) from None
        return PassProgress(tqdm(total=total, desc=desc), owned=True)
    if hasattr(progress, "update") and not isinstance(progress, type):
        return PassProgress(progress, owned=False)
    if callable(progress):
        return PassProgress(progress(total=total, desc=desc), owned=True)
    raise TypeError(
        f"{api}: progress must be a bool, a tqdm instance (or any object with update(n)), "
        f"or a callable making one such as tqdm.tqdm; got {type(progress).__name__}"
    )
