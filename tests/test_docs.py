"""The documentation's examples run, and the documentation covers what it must.

- Every fenced ``python`` block of ``docs/*.md`` and ``README.md`` runs, in a namespace of its
  own. A block that cannot run here (a Ray cluster) opens with the visible line
  ``# not run by the tests: <why>``, and is skipped. A block that calls a map checks it against
  the loop (an ``assert``) or through ``gradmap.compare``, which does.
- The ``Example:`` blocks (``>>>``) of the public objects' docstrings run as doctests.
- The API page renders every public name, and the README stays a front page.

The site itself is built by ``.ci/run`` (``mkdocs build --strict``: no warning, broken link,
anchor or cross-reference).
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

import gradmap

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
SKIP = "# not run by the tests:"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    """(page:number, code) of every fenced python block, in page order."""
    found = []
    for page in PAGES:
        for k, match in enumerate(FENCE.finditer(page.read_text()), 1):
            found.append((f"{page.relative_to(ROOT)}:{k}", match.group(1)))
    return found


BLOCKS = blocks()


def test_the_docs_have_examples():
    pages = {name.split(":")[0] for name, _ in BLOCKS}
    assert "README.md" in pages and "docs/getting-started.md" in pages, pages
    assert len(BLOCKS) >= 10, [name for name, _ in BLOCKS]


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_example_runs(name, code):
    if code.startswith(SKIP):
        pytest.skip(code.splitlines()[0][len(SKIP) :].strip())
    if "gradmap.jax" in code:
        pytest.importorskip("jax")
    # A module name that is not importable: cloudpickle sends the block's functions by value to
    # worker processes, as it does a script's.
    namespace = {"__name__": "gradmap_docs_example"}
    exec(compile(code, name, "exec"), namespace)


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_example_of_a_map_checks_it_against_the_loop(name, code):
    if code.startswith(SKIP) or not re.search(r"gradmap\.(jax\.)?t(map|sum)\(", code):
        return
    assert "assert " in code or "gradmap.compare(" in code, (
        f"{name}: an example that runs a map checks it against the plain loop (an assert), "
        "or runs gradmap.compare, which does"
    )


def public_objects() -> list[tuple[str, object]]:
    import gradmap.jax

    names = [(f"gradmap.{n}", getattr(gradmap, n)) for n in gradmap.__all__]
    return [*names, ("gradmap.jax.tmap", gradmap.jax.tmap), ("gradmap.jax.tsum", gradmap.jax.tsum)]


def test_docstring_examples_run():
    pytest.importorskip("jax")
    finder, ran = doctest.DocTestFinder(recurse=False), []
    for name, obj in public_objects():
        for test in finder.find(obj, name, globs={"gradmap": gradmap}):
            if not test.examples:
                continue
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            result = runner.run(test, out=lambda text: None)
            assert result.failed == 0, f"{name}: a docstring example failed"
            if result.attempted:
                ran.append(name)
    for name in ("gradmap.tmap", "gradmap.tsum", "gradmap.jax.tmap", "gradmap.jax.tsum"):
        assert name in ran, (name, ran)


def test_docstring_example_failure_is_seen():
    # The doctest runner above reports a wrong example (else the test could not fail).
    test = doctest.DocTestParser().get_doctest(">>> 1 + 1\n3\n", {}, "wrong", None, 0)
    result = doctest.DocTestRunner().run(test, out=lambda text: None)
    assert result.failed == 1


def test_api_page_renders_every_public_name():
    pytest.importorskip("jax")  # (gradmap.jax's maps are among the names)
    page = (ROOT / "docs" / "api.md").read_text()
    rendered = set(re.findall(r"^::: (\S+)$", page, re.M))
    missing = [name for name, _ in public_objects() if name not in rendered]
    assert not missing, missing


def test_readme_is_a_front_page_with_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    ci = (ROOT / ".ci" / "run").read_text()
    commands = FENCE.sub("", readme)  # the first block: install and demo, install and test
    first = re.search(r"^```bash\n(.*?)^```", commands, re.S | re.M)
    assert first is not None
    demo, tests = [line for line in first.group(1).splitlines() if not line.startswith("#")]
    assert demo.endswith(".venv/bin/gradmap demo"), demo
    extras = re.search(r"-e '(\.\[[^\]]+\])'", ci)
    assert extras is not None and f"-e '{extras.group(1)}'" in tests, (tests, ci)
    assert tests.endswith(".venv/bin/python -m pytest -q") and tests.split("&& ")[-1] in ci


def test_docs_link_notes_that_exist():
    # The architecture page's index is generated from the source (docs/hooks/notes.py), and the
    # strict build fails on a link to an anchor it lacks; this checks the hook finds the NOTEs.
    import importlib.util

    spec = importlib.util.spec_from_file_location("notes_hook", ROOT / "docs/hooks/notes.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    found = hook.notes()
    assert "forward placement" in found and "the native walk" in found
    linked = set()
    for page in PAGES:
        linked |= set(re.findall(r"architecture\.md#(note-[a-z0-9-]+)", page.read_text()))
    missing = linked - {hook.slug(name) for name in found}
    assert not missing, missing
