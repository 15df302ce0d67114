"""The import graph of src/arlm against docs/architecture.md's "Layering": every import (at a
module's top or inside a function, TYPE_CHECKING's too) goes to a module of the importer's layer
or one below, and no modules import each other round a circle. Read from the source with `ast`:
nothing is imported, so a lazy import counts as much as any."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "arlm"


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def imports() -> dict[str, dict[str, int]]:
    """Module -> {module of arlm it imports: the line}, names resolved to the deepest module."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, init) in mods.items():
        edges = graph.setdefault(name, {})
        here = name.split(".") if init else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "arlm" and (to := resolve(target)) not in (None, name, "arlm"):
                    edges.setdefault(to, node.lineno)
    return graph


def layers() -> dict[str, int]:
    """Top-level module or package -> its layer, from the doc's numbered list (a parenthesis
    says what lies inside one: left out)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Layering"):]
    out = {}
    for number, line in re.findall(r"^(\d+)\. (.*)$", section, re.M):
        for token in re.findall(r"`([^`]+)`", re.sub(r"\([^()]*\)", "", line)):
            out[token.removesuffix(".py").removesuffix("/")] = int(number)
    return out


def top(module: str) -> str:
    return module.split(".")[1]


def test_every_module_has_a_layer():
    placed = layers()
    missing = sorted({top(m) for m in modules() if m != "arlm"} - placed.keys())
    assert not missing, f"not in docs/architecture.md's Layering: {missing}"


def test_no_import_reaches_a_layer_above():
    placed = layers()
    upward = [f"{a} (layer {placed[top(a)]}) -> {b} (layer {placed[top(b)]}), line {line}"
              for a, edges in imports().items() if a != "arlm"
              for b, line in edges.items() if placed[top(b)] > placed[top(a)]]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                circles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles
