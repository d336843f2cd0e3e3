"""Errors: say which element failed, keep the worker's traceback.

An exception raised by ``f`` (or by an element's backward) reaches the caller as the same object:
its type, message and traceback (the worker's frames) are untouched, and a note names the element.
"""

from __future__ import annotations

__all__ = ["add_note", "element_note"]


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
