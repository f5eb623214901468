"""The package layout of ``docs/architecture.md`` holds in the code: imports run one way, no circles, no hidden imports.

The import graph is read from the source with :mod:`ast` (every ``import`` / ``from ... import`` of ``llmc_fsm``,
those under ``TYPE_CHECKING`` and inside functions included), so these tests see what a reader sees.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

import llmc_fsm

ROOT = Path(llmc_fsm.__file__).resolve().parent
DOC = ROOT.parent / "docs" / "architecture.md"

#: The packages from the lowest layer up: a package imports only packages before it (docs/architecture.md).
LAYERS = [
    "core",
    "toolkit",
    "recipes",
    "session",
    "data",
    "models",
    "report",
    "output",
    "pipeline",
    "oneshot_job",
    "integrations",
    "testing",
    "cli",
]

#: First-party imports allowed inside a function, (module, imported module) -> the reason. Empty: there are none.
IN_FUNCTION_ALLOWED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("llmc_fsm", *path.relative_to(ROOT).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def _imports() -> list[tuple[str, str, bool, int]]:
    """``(module, imported first-party module, inside a function, line)`` for every import of llmc_fsm."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        inner = {id(x) for f in functions for x in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                pytest.fail(f"{name}:{node.lineno}: relative import (write the absolute llmc_fsm.<package> path)")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llmc_fsm":
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in MODULES else node.module for t in targets]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "llmc_fsm"]
            else:
                continue
            for target in dict.fromkeys(targets):
                while target not in MODULES and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    found.append((name, target, id(node) in inner, node.lineno))
    return found


IMPORTS = _imports()


def test_every_module_belongs_to_a_documented_package():
    loose = sorted(m for m in MODULES if _package(m) is None and m not in ("llmc_fsm", "llmc_fsm.__main__"))
    assert loose == []
    packages = {p for m in MODULES if (p := _package(m))}
    assert packages == set(LAYERS)


def test_imports_run_one_way():
    upward = []
    for module, target, _, line in IMPORTS:
        src, dst = _package(module), _package(target)
        if src is None or dst is None or src == dst:
            continue
        if LAYERS.index(dst) > LAYERS.index(src):
            upward.append(f"{module}:{line} imports {target} ({src} is below {dst})")
    assert upward == []


def test_no_import_circle():
    graph = defaultdict(set)
    for module, target, _, _ in IMPORTS:
        graph[module].add(target)
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
                circles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert circles == []


def test_first_party_imports_sit_at_module_level():
    inside = [
        f"{module}:{line} imports {target} inside a function"
        for module, target, in_function, line in IMPORTS
        if in_function and (module, target) not in IN_FUNCTION_ALLOWED
    ]
    assert inside == []


@pytest.mark.parametrize("package", LAYERS)
def test_each_package_states_its_job_and_exports(package):
    init = ROOT / package / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{init} has no docstring saying what the package is for"
    names = [t.id for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign) for t in _targets(n)]
    assert "__all__" in names, f"{init} has no __all__"
    module = __import__(f"llmc_fsm.{package}", fromlist=["__all__"])
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == []


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.Name]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t for t in targets if isinstance(t, ast.Name)]


def package_graph() -> dict[str, set[str]]:
    """Package -> the packages it imports, from the code."""
    graph: dict[str, set[str]] = {p: set() for p in LAYERS}
    for module, target, _, _ in IMPORTS:
        src, dst = _package(module), _package(target)
        if src and dst and src != dst:
            graph[src].add(dst)
    return graph


def mermaid_layers() -> str:
    """The mermaid diagram of docs/architecture.md: one arrow per package that imports another."""
    lines = ["flowchart BT"]
    for src in LAYERS:
        lines += [f"    {src} --> {dst}" for dst in sorted(package_graph()[src], key=LAYERS.index)]
    return "\n".join(lines)


def _doc_blocks() -> list[str]:
    return re.findall(r"```mermaid\n(.*?)\n```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_documented_package_diagram_is_the_code_s():
    assert _doc_blocks()[0] == mermaid_layers(), (
        "docs/architecture.md's package diagram differs from the imports; paste this:\n" + mermaid_layers()
    )


def test_the_documented_data_flow_names_real_functions_along_real_imports():
    """Each node of the data-flow diagram is ``module.function`` that exists; each arrow's caller module imports the
    callee's module (or is it)."""
    flow = _doc_blocks()[1]
    nodes = dict(re.findall(r'(\w+)\["`?([\w.]+)`?', flow))
    assert len(nodes) >= 8
    for key, qualified in nodes.items():
        module, _, function = qualified.rpartition(".")
        assert f"llmc_fsm.{module}" in MODULES, f"{key}: no module llmc_fsm.{module}"
        assert hasattr(__import__(f"llmc_fsm.{module}", fromlist=[function]), function), f"{key}: no {qualified}"
    graph = defaultdict(set)
    for module, target, _, _ in IMPORTS:
        graph[module].add(target)
    arrows = re.findall(r"(\w+)\s*-->(?:\|[^|]*\|)?\s*(\w+)", flow)
    assert arrows
    for a, b in arrows:
        ma, mb = (f"llmc_fsm.{nodes[x].rpartition('.')[0]}" for x in (a, b))
        assert ma == mb or mb in graph[ma], f"{nodes[a]} -> {nodes[b]}: {ma} does not import {mb}"
