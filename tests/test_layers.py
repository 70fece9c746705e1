"""The layer contract: the packages of workbench form a stack, and every import points down.

Read from every module's source with ``ast`` (nothing is imported), so the contract covers
imports inside functions and annotation-only imports (``if TYPE_CHECKING:``) too. Rules
(docs/architecture.md draws the picture):

- the packages are layered in ``PACKAGES`` order, bottom first, and no import of any kind
  goes from a package to one above it (package pairs, not only module cycles); a test plants
  such an import and checks that it is caught;
- no module cycles, annotation-only imports included;
- nothing below the front-ends imports a front-end library at module level, and importing
  any module below them really pulls in none (checked in fresh interpreters).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FRONT_END_LIBRARIES = ("textual", "textual_plotext", "ipywidgets", "bqplot", "plotly", "plotext", "transformers")
# The layers, bottom first: a package may import its own modules and those of the packages
# before it, never one after it. "top" is the package's facade (workbench/__init__.py) and the
# other top-level modules.
PACKAGES = ("core", "data", "models", "checkpoint", "distributed", "guard", "train", "config",
            "door", "autopilot", "widgets", "control", "session", "cli", "top")
# The front-ends' packages: below them, no front-end library is imported at module level.
FRONT_ENDS = ("widgets", "cli", "top")


def _modules() -> dict[str, Path]:
    """Every module of the installed package: workbench/ and widgets/ (as workbench.widgets)."""
    found: dict[str, Path] = {}
    for root, prefix in ((REPO / "workbench", "workbench"), (REPO / "widgets", "workbench.widgets")):
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def package(module: str) -> str:
    """The layer package a module belongs to (``top`` for the top-level modules)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and MODULES[module].name == "__init__.py"):
        return parts[1]
    return "top"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path) -> list[tuple[str, bool]]:
    """(imported workbench module, at module level?) for every import that can run."""
    return _imports_in(ast.parse(path.read_text(encoding="utf-8")), module, path)


def _imports_in(tree: ast.AST, module: str, path: Path) -> list[tuple[str, bool]]:
    is_package = path.name == "__init__.py"
    out: list[tuple[str, bool]] = []

    def visit_import(child: ast.AST, top: bool) -> None:
        if isinstance(child, ast.Import):
            out.extend((alias.name, top) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            target = _resolve(module, is_package, child)
            for alias in child.names:
                candidate = f"{target}.{alias.name}"
                out.append((candidate if candidate in MODULES else target, top))

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                # Annotation-only imports count for cycles too, but never as module-level imports.
                for sub in child.body:
                    visit_import(sub, False)
                for sub in child.orelse:
                    visit(sub, top)
                continue
            visit_import(child, top)
            inner_top = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner_top)

    visit(tree, True)
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _ in imports_of(module, path):
            if target in MODULES and target != module and target != "workbench":
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def upward_imports(imports: dict[str, list[tuple[str, bool]]]) -> list[str]:
    """Every import from a package to one above it in PACKAGES, whatever its kind."""
    found = []
    for module, targets in imports.items():
        own = PACKAGES.index(package(module))
        for target, _ in targets:
            if target in MODULES and PACKAGES.index(package(target)) > own:
                found.append(f"{module} ({package(module)}) imports {target} ({package(target)})")
    return found


def test_every_package_is_a_layer():
    assert {package(m) for m in MODULES} == set(PACKAGES)


def test_no_import_points_up_a_layer():
    imports = {module: imports_of(module, path) for module, path in MODULES.items()}
    found = upward_imports(imports)
    assert not found, "imports pointing up the layers (lazy and annotation-only ones count):\n" + "\n".join(found)


def test_the_contract_catches_a_planted_upward_import():
    """The check above is not vacuous: a core module importing the session layer, at module
    level, in a function or only for annotations, is reported each time."""
    source = ("from workbench.session.local import Session\n"
              "def f():\n    import workbench.control.client\n"
              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workbench.widgets.view import fmt_number\n")
    planted = REPO / "workbench" / "core" / "state.py"
    tree_imports = _imports_in(ast.parse(source), "workbench.core.state", planted)
    found = upward_imports({"workbench.core.state": tree_imports})
    assert [line.split(" imports ")[1] for line in found] == [
        "workbench.session.local (session)", "workbench.control.client (control)", "workbench.widgets.view (widgets)"]


def test_the_import_graph_has_no_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_below_the_front_ends_no_module_level_front_end_import():
    found = []
    for module, path in MODULES.items():
        if package(module) in FRONT_ENDS:
            continue
        for target, top in imports_of(module, path):
            if top and target.split(".")[0] in FRONT_END_LIBRARIES:
                found.append(f"{module} imports {target}")
    assert not found, "\n".join(found)


# One probe interpreter imports the heavy third-party libraries once (after checking they pull
# in no front-end), then forks a fresh child per core module: each child starts without any
# workbench module loaded, imports one, and reports which front-ends are in sys.modules.
# Same answer as a brand-new interpreter per module, at a fraction of the start-up cost.
_IMPORT_PROBE = """
import importlib, json, os, sys
forbidden = {forbidden!r}
for heavy in ("numpy", "torch", "accelerate", "safetensors", "pydantic"):
    importlib.import_module(heavy)
preloaded = sorted(name for name in forbidden if name in sys.modules)
assert not preloaded, preloaded
assert not any(name == "workbench" or name.startswith("workbench.") for name in sys.modules)
for module in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            found = sorted(name for name in forbidden if name in sys.modules)
            payload = json.dumps({{"module": module, "found": found}})
        except BaseException as exc:
            payload = json.dumps({{"module": module, "error": repr(exc)}})
        os.write(write, payload.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    print(b"".join(chunks).decode(), flush=True)
"""

# What really loads, for every module below the front-ends (the CLI's headless path too).
PROBED = sorted(m for m in MODULES if package(m) not in FRONT_ENDS
                or m in ("workbench", "workbench.cli", "workbench.cli.train", "workbench.cli.hangup"))


@pytest.fixture(scope="module")
def import_results() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", _IMPORT_PROBE.format(forbidden=FRONT_END_LIBRARIES), *PROBED],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {row["module"]: row for row in rows}


@pytest.mark.parametrize("module", PROBED)
def test_importing_a_module_below_the_front_ends_loads_no_front_end(module, import_results):
    row = import_results[module]
    assert "error" not in row, row
    assert row["found"] == []


def test_import_workbench_does_not_import_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = "import sys, workbench; print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_package_folder_is_in_the_wheel():
    """pyproject's explicit package list must name every package, or a wheel install lacks it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; stale: {sorted(listed - found)}"
