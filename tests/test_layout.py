"""The layout of ``src/gradmap``: no import circle between modules, and no import from a lower
layer to a higher one.

Every import counts, wherever it stands: at the top of a module, inside a function (the lazy
imports of optional backends), under ``TYPE_CHECKING``. The layers, bottom to top, are those the
architecture page draws (``docs/architecture.md``); a module belongs to the layer of the longest
prefix that names it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradmap

SRC = Path(gradmap.__file__).parent

#: Bottom to top. A module may import modules of its own layer and of the layers below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "basics",
        (
            "gradmap._errors",
            "gradmap._scoped",
            "gradmap._tree",
            "gradmap._plan",
            "gradmap._progress",
            "gradmap._placement",
            "gradmap._join",
            "gradmap._items",
        ),
    ),
    ("executors", ("gradmap._executors",)),
    ("engine", ("gradmap._engine", "gradmap._request")),
    ("rules", ("gradmap._torch", "gradmap._jax")),
    ("remote rule", ("gradmap._remote",)),
    ("transports", ("gradmap._process", "gradmap._ray")),
    ("api", ("gradmap._resolve", "gradmap._api", "gradmap._jax._map", "gradmap._compare")),
    ("package", ("gradmap", "gradmap.jax")),
    ("bench", ("gradmap.bench",)),
    ("command line", ("gradmap._cli", "gradmap.__main__", "gradmap._demo")),
]


def modules() -> dict[str, tuple[Path, str]]:
    """Module name -> (its file, the package its relative imports start from)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("gradmap", *path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            name = ".".join(parts[:-1])
            out[name] = (path, name)
        else:
            name = ".".join(parts)
            out[name] = (path, ".".join(parts[:-1]))
    return out


def imports() -> dict[str, dict[str, int]]:
    """Module -> {module of gradmap it imports: the line of the first such import}."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, package) in mods.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                # ``from package import submodule`` imports the submodule
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module
                    for a in node.names
                ]
            for target in targets:
                while target and target not in mods:  # ``import gradmap._x.y`` -> its module
                    target = target.rpartition(".")[0]
                if target.startswith("gradmap") and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def layer(module: str) -> int:
    best, found = -1, None
    for k, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), k
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    for module in modules():
        layer(module)


def test_no_import_circle():
    circles = cycles(imports())
    assert not circles, "import circles:\n" + "\n".join(" ".join(c) for c in circles)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [
        f"{module}:{line} imports {target} ({LAYERS[layer(module)][0]} -> "
        f"{LAYERS[layer(target)][0]})"
        for module, edges in sorted(imports().items())
        for target, line in sorted(edges.items())
        if layer(target) > layer(module)
    ]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_check_sees_lazy_imports():
    """The graph counts an import inside a function: the API's lazy import of a backend."""
    graph = imports()
    assert "gradmap._remote._map" in graph["gradmap._api"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == [["a", "b", "c"]]
