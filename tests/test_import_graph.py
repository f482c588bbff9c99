"""The package's modules import each other in one direction: no cycles.

Every ``import`` and ``from ... import`` inside ``ipc_dpsample/`` is read with ``ast``
(also those inside functions and under ``if TYPE_CHECKING:``: a cycle through a lazy
or type-only import is still a cycle of the design). ``from pkg import name`` is an
edge to the submodule ``pkg.name`` when one exists, else to ``pkg``'s ``__init__``.
A package's ``__init__`` that re-exports its submodules depends on them, so a
submodule that imports from its package's ``__init__`` (``from . import
__version__``) closes a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ipc_dpsample"


def _module_name(path: Path) -> str:
    parts = ["ipc_dpsample", *path.relative_to(PKG).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}
    kernels = PKG.parent / "kernels" / "__init__.py"  # installed as ipc_dpsample.kernels
    if kernels.is_file():
        found["ipc_dpsample.kernels"] = kernels
    return found


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join([*base, node.module] if node.module else base)
                else:
                    stem = node.module or ""
                targets = [
                    f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem
                    for a in node.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.add(target)
        graph[name] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_the_graph_reader_sees_known_edges() -> None:
    graph = _edges(_modules())
    assert "ipc_dpsample.rendezvous" in graph["ipc_dpsample.comm"]
    assert "ipc_dpsample.backends.nccl.setup" in graph["ipc_dpsample.backends.nccl.backend"]
    assert "ipc_dpsample.backends.torch" in graph["ipc_dpsample.comm"]
    assert "ipc_dpsample.backends.torch.backend" in graph["ipc_dpsample.backends.torch"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_package_imports_have_no_cycles() -> None:
    cycles = _cycles(_edges(_modules()))
    assert not cycles, "modules that import each other in a circle: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )
