"""Errors: say which element failed, keep the worker's traceback.

An exception raised by ``f`` (or by an element's backward) reaches the caller as the same object:
its type, message and traceback (the worker's frames) are untouched, and a note names the element.
"""

from __future__ import annotations

__all__ = ["add_note", "element_note", "mark_place", "take_place"]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where notes are stored but not printed)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        notes = getattr(exc, "__notes__", None)
        if notes is None:
            notes = []
            try:
                exc.__notes__ = notes  # type: ignore[attr-defined]
            except AttributeError:
                return
        notes.append(note)


def element_note(index: int, n: int, phase: str, api: str = "gradmap.tmap") -> str:
    """The note for element ``index`` of ``n`` failing in ``phase`` ("forward" or "backward")
    of ``api``."""
    return f"{api}: raised in the {phase} pass of element {index} (of {n})"


#: The attribute a worker's host sets on an exception for the place, in its call's batch, of the
#: chunk that raised it (``mark_place``); the driver takes it off again (``take_place``).
_PLACE = "_gradmap_place"


def mark_place(exc: BaseException, place: int) -> None:
    """Note on ``exc`` the place, among the chunks of one call, of the chunk that raised it (it
    travels with the exception's attributes, as its notes do)."""
    state = getattr(exc, "__dict__", None)
    if state is not None:
        state[_PLACE] = place


def take_place(exc: BaseException) -> int | None:
    """The place ``mark_place`` noted on ``exc``, removed from it; ``None`` if none was."""
    state = getattr(exc, "__dict__", None)
    return None if state is None else state.pop(_PLACE, None)
