"""No import circles in ``training/`` (issue 35, item 6), type-only imports (``if TYPE_CHECKING:``) included.

The graph is read from the source with ``ast``: an edge for every ``import`` and ``from ... import`` of the
toolkit's own modules, wherever it stands in a file. A circle is a strongly connected component of more than one
module; a type-only one still means the modules cannot be read, tested or moved one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("accel", "deep_gemm", "dualpipe", "flash_mla", "fused_ce", "fused_ops", "models", "planner", "recipes",
            "training", "verifier")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            name = ".".join(file.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = file
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the toolkit modules it imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, file in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_training_has_no_import_circle():
    """Formerly ``training.trainer`` -> ``training.preempt`` -> ``training.checkpoint.trainer_hooks`` -> back, all
    type-only: the hooks and the preemption save took the whole ``Trainer``. They now take a ``Checkpointable``
    (the trainer's attributes they use) and the hooks, step and process groups."""
    graph = import_graph()
    assert "training.trainer" in graph["training.run"]  # the graph sees the package's imports at all
    assert [c for c in circles(graph) if any(m.startswith("training.") for m in c)] == []
