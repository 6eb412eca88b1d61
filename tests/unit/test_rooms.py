"""The package is arranged by the process that runs the code (docs/architecture.md, "Modules"), and these are
the rules that keep it so, read from the source's import statements (lazy ones too; `if TYPE_CHECKING:`
blocks are annotations, not imports):

- no import cycle between modules: each one can be read after the ones it imports;
- the library a training script imports (train/) imports only the shared modules: a rank's process never
  loads the launcher's, the supervisor's or the agent's code;
- the shared modules (the vocabulary every process uses) import no room's code.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "entrypoint" / "trainpod"
ROOMS = ("launcher", "supervisor", "agent", "train")
# Subpackages that are not a process's room: cluster sources, rendezvous backends, schedulers, examples.
SUBPACKAGES = ("environments", "rendezvous", "jobs", "examples")


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if _type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        yield from _imports(node)


def graph() -> dict[str, set[str]]:
    """module -> the trainpod modules it imports (a name imported from a package counts as its module when it is one)."""
    found = modules()
    edges: dict[str, set[str]] = {}
    for name, path in found.items():
        targets = set()
        for imported in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            while imported and imported not in found:
                imported = imported.rpartition(".")[0]
            if imported and imported not in (name, "trainpod"):
                targets.add(imported)
        edges[name] = targets
    return edges


def room(module: str) -> str:
    """launcher, supervisor, agent, train, one of SUBPACKAGES, or 'shared' (trainpod's own top-level modules)."""
    if module == "trainpod.__main__":
        return "launcher"  # `python -m trainpod`: the launcher's entry
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS + SUBPACKAGES) else "shared"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_room_and_subpackage_exists_and_nothing_else_sits_in_a_directory_of_its_own():
    directories = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert directories == set(ROOMS + SUBPACKAGES)


@pytest.mark.slow
def test_no_module_imports_itself_back():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.slow
def test_a_training_scripts_library_imports_only_the_shared_modules():
    wrong = {f"{module} -> {other}" for module, targets in graph().items() if room(module) == "train"
             for other in targets if room(other) != "shared" and room(other) != "train"}  # fmt: skip
    assert not wrong, sorted(wrong)


@pytest.mark.slow
def test_the_shared_modules_import_no_rooms_code():
    wrong = {f"{module} -> {other}" for module, targets in graph().items() if room(module) == "shared"
             for other in targets if room(other) in ROOMS}  # fmt: skip
    assert not wrong, sorted(wrong)


def test_the_launcher_starts_without_torch():
    """`trainpod explain` and a bad flag answer before torch could even be imported: no launcher module
    (nor what it imports) imports torch when it is loaded."""
    launcher = sorted(m for m in modules() if room(m) == "launcher")
    check = f"import sys; import {', '.join(launcher)}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    result = subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)},
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr
