"""mkdocs hook: the architecture page's index of the ``NOTE [name]:`` blocks in ``src/gradmap``.

A NOTE block is where the source explains an invariant or a decision. The index is read from the
source at every build, so it cannot fall behind: the page's ``<!-- NOTE INDEX -->`` line becomes a
table of every NOTE, its file and line, and each row carries the anchor ``note-<name>`` that the
other pages link to (``architecture.md#note-forward-placement``); the strict build fails on a link
to a NOTE that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gradmap"
MARKER = "<!-- NOTE INDEX -->"

#: A NOTE's definition: the name opens the line (after a comment sign or a docstring's quotes).
DEFINITION = re.compile(r'^\s*(?:#+:?\s*|//\s*|[rb]?"""\s*)?NOTE \[([^\]]+)\]:')


def slug(name: str) -> str:
    """``forward placement`` -> ``note-forward-placement``: the anchor of a NOTE's row."""
    return "note-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def notes() -> dict[str, list[tuple[str, int]]]:
    """NOTE name -> where it is defined (file relative to the repository, line), in file order."""
    found: dict[str, list[tuple[str, int]]] = {}
    for path in sorted([*SRC.rglob("*.py"), *SRC.rglob("*.cpp")]):
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = DEFINITION.match(line)
            if match:
                found.setdefault(match.group(1), []).append((rel, number))
    return found


def index() -> str:
    rows = ["| NOTE | where |", "|---|---|"]
    for name, places in sorted(notes().items(), key=lambda item: item[0].lower()):
        where = ", ".join(f"`{file}:{line}`" for file, line in places)
        rows.append(f"| **{name}**{{#{slug(name)}}} | {where} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, index())
    return markdown
