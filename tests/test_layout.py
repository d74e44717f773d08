"""The package's shape: no import cycles, the server never reaches the command line, modules stay short.

The import graph is read from the source (every `import` and `from ... import`, at any depth, outside
`if TYPE_CHECKING:` blocks), so a cycle through a function-level import counts too. Check it alone with
`python -m pytest tests/test_layout.py`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "verispec"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The verispec modules that `path` (module `name`) imports."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` imports the module, else the package itself
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_negative_control_a_planted_cycle_is_found():
    graph = _graph()
    graph["verispec.config"] = graph["verispec.config"] | {"verispec.engine"}  # engine imports config
    assert any("verispec.config" in cycle for cycle in _cycles(graph))


def test_the_server_never_imports_the_command_line():
    graph = _graph()
    for name in [m for m in graph if m.startswith("verispec.server")]:
        assert not any(m.startswith("verispec.cli") for m in _reachable(graph, name) | {name}), name
    code = (
        "import sys, verispec.server, verispec.server.app, verispec.server.replicas, verispec.server.run; "
        "print([m for m in sys.modules if m.startswith('verispec.cli')])"
    )
    pytest.importorskip("fastapi")
    ray = "ray" in sys.modules or __import__("importlib").util.find_spec("ray") is not None
    if not ray:
        code = code.replace(" verispec.server.replicas,", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_longer_than_500_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
