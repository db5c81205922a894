"""The house's rules, checked by tools: import-linter's contracts (pyproject.toml) keep the arrows
one-way (between the four packages, into the engine's door, between the engine's floors), grimp's
import graph has no circle, a function-level import in the engine says why it is one, mypy
(strict on the engine, the live layer and the chat, [tool.mypy] in pyproject.toml) checks the
types, and ruff keeps the code clean. Each runs as the developer would run it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = run("lint-imports")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # the contracts must actually have been checked, not skipped
    assert "broken" in result.stdout and " 0 broken" in result.stdout, result.stdout[-2000:]
    assert "Analyzed" in result.stdout


PACKAGES = ("engine", "live", "widgets", "app", "tools")


def test_no_import_circles():
    """No module reaches itself through its imports (function-level and type-checking ones
    included): every circle is a floor plan broken, whatever the layers contract lets through."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    ours = {m for m in graph.modules if m.split(".")[0] in PACKAGES}
    circles = [
        sorted(component)
        for component in _strongly_connected(
            ours, lambda m: graph.find_modules_directly_imported_by(m) & ours
        )
        if len(component) > 1 or component[0] in graph.find_modules_directly_imported_by(component[0])
    ]
    assert circles == [], circles


def _strongly_connected(nodes, successors):
    """Tarjan's algorithm, iterative: the strongly connected components of the graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(successors(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                out.append(component)
    return out


def test_function_level_imports_in_the_engine_say_why():
    """An import inside a function hides an arrow from whoever reads the module's head; in the
    engine it is there only where a heavy or optional dependency earns it, and a comment on it
    (or just above it and the imports beside it) gives the reason."""
    unexplained = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and not _explained(lines, inner):
                    unexplained.append(
                        f"{path.relative_to(ROOT)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}"
                    )
    assert unexplained == [], "\n".join(sorted(set(unexplained)))


def _explained(lines: list[str], node: ast.stmt) -> bool:
    if any("#" in lines[i] for i in range(node.lineno - 1, node.end_lineno or node.lineno)):
        return True
    above = node.lineno - 2
    # over the imports (and blank lines) of the same block, up to the comment that leads them
    while above >= 0 and (not lines[above].strip() or _is_import_line(lines[above])):
        if "#" in lines[above]:
            return True
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def _is_import_line(line: str) -> bool:
    text = line.strip()
    return text.startswith(("from ", "import ", ")")) or (text.endswith(",") and " " not in text.rstrip(","))


# The packages mypy checks with the strict flags of [tool.mypy] (what they import is checked too).
# One run for all: live and the chat import the engine's vocabulary, so several runs would
# analyse it again each.
TYPED_PACKAGES = ("engine", "live", "app/chat")


def test_the_typed_packages_type_check():
    result = run("mypy", *TYPED_PACKAGES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.stdout.startswith("Success: no issues found"), result.stdout[-2000:]
    # every module of the typed packages was checked, not a subset
    checked = int(re.search(r"in (\d+) source files", result.stdout).group(1))
    modules = sum(1 for package in TYPED_PACKAGES for _ in (ROOT / package).rglob("*.py"))
    assert checked == modules, result.stdout
