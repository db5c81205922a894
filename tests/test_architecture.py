"""The house's rules, checked by tools: import-linter's contracts (pyproject.toml) keep the arrows
one-way (between the four packages, into the engine's door, between the engine's floors, never
into the developer tools), grimp's import graph has no circle, a function-level import in the
engine says why it is one, mypy (strict on the engine, the live layer and the chat, [tool.mypy]
in pyproject.toml) checks the types. Each runs as the developer would run it. Then, read from the
code's syntax: nothing outside the engine reaches behind its front door, and each fact that has
one home (blocks for N tokens, tokens/s, what fits, the speedup, run-to-end, the page-map
replay) is written there only."""

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


# ---- the front door: nothing outside the engine reaches behind it ------------------------------
# The engine's thread owns the model, the tokenizer and the pool; the app asks it named questions
# (engine.api.EngineClient). Running a closure there (`_call`), or holding the synchronous engine
# (`core`, `_core`), is the engine's own: its drivers (engine/serve) may, the shipped packages and
# the developer tools above it may not. Tests may look inside to check what an answer says.
OUTSIDE_THE_ENGINE = ("app", "live", "widgets", "tools")
BEHIND_THE_DOOR = {"_call", "core", "_core", "_commands", "_loaded_core"}


def modules_of(*packages: str):
    """(path relative to the root, its syntax tree) of every module of `packages`."""
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text())


def test_outside_the_engine_nothing_reaches_behind_its_door():
    reaching = [
        f"{where}:{node.lineno}: .{node.attr}"
        for where, tree in modules_of(*OUTSIDE_THE_ENGINE)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in BEHIND_THE_DOOR
    ]
    assert reaching == [], "\n".join(reaching)


# ---- one home each ---------------------------------------------------------------------------
# Each fact below is written once; its former copies (the issue "The engine's front door and
# floor plan" listed them) are gone, and these checks keep new ones from growing back. Each scans
# the shipped packages and the developer tools, not the tests (a test may derive a figure on its
# own to check the one home against).
EVERYWHERE = ("engine", "live", "widgets", "app", "tools")


def _named(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _is_block_size(node: ast.AST) -> bool:
    name = _named(node)
    return name == "bs" or name.lower().endswith("block_size")


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 1


def _terms(node: ast.AST, sign: int = 1) -> list[tuple[int, ast.AST]]:
    """A sum's terms with their signs: n + bs - 1 is [(+1, n), (+1, bs), (-1, 1)]."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        return _terms(node.left, sign) + _terms(node.right, sign if isinstance(node.op, ast.Add) else -sign)
    return [(sign, node)]


def _is_ceil_division(node: ast.AST) -> bool:
    """n divided by a block size, rounded up by hand."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and _is_block_size(node.right):
        if isinstance(node.left, ast.UnaryOp) and isinstance(node.left.op, ast.USub):
            return True  # -(-n // bs)
        terms = _terms(node.left)  # (n + bs - 1) // bs
        return any(s > 0 and _is_block_size(t) for s, t in terms) and any(
            s < 0 and _is_one(t) for s, t in terms
        )
    if isinstance(node, ast.Call) and _named(node.func) == "ceil" and node.args:
        arg = node.args[0]  # ceil(n / bs)
        return isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div) and _is_block_size(arg.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        sides = (node.left, node.right)  # n // bs + (n % bs > 0)
        divided = any(
            isinstance(side, ast.BinOp) and isinstance(side.op, ast.FloorDiv) and _is_block_size(side.right)
            for side in sides
        )
        remainder = any(
            isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and _is_block_size(n.right)
            for side in sides
            for n in ast.walk(side)
        )
        return divided and remainder
    return False


def blocks_for_tokens_copies(tree: ast.AST) -> list[int]:
    """Lines that count the KV blocks for some tokens by hand: -(-n // bs), (n + bs - 1) // bs,
    n // bs + (n % bs > 0) or ceil(n / bs), with bs a block size."""
    return [node.lineno for node in ast.walk(tree) if _is_ceil_division(node)]


def test_the_finder_of_block_counts_finds_every_spelling():
    """The check below can fail: each hand-written count of blocks is found, and what is not one
    (a slot's block, a quantization block's padding) is not."""
    spelled = [
        "-(-tokens // bs)",
        "-(-seq.context_len // self.block_size)",
        "(n + block_size - 1) // block_size",
        "(n - 1 + bs) // bs",
        "math.ceil(n / KV_BLOCK_SIZE)",
        "n // bs + (n % bs > 0)",
    ]
    for text in spelled:
        assert blocks_for_tokens_copies(ast.parse(text)) == [1], text
    for text in ("slot // block_size", "(slot - 1) // bs", "-(-n // block) * block", "ceil(n / cols)"):
        assert blocks_for_tokens_copies(ast.parse(text)) == [], text


def test_blocks_for_tokens_are_counted_in_one_place():
    """engine.limits.blocks_for_tokens (and Limits.blocks_for, which calls it)."""
    copies = [
        f"{where}:{line}"
        for where, tree in modules_of(*EVERYWHERE)
        if where != "engine/limits.py"
        for line in blocks_for_tokens_copies(tree)
    ]
    assert copies == [], "\n".join(copies)


def test_an_engine_is_run_to_its_end_in_one_place():
    """LLMEngine.run: `while engine.has_work(): engine.step()` is written nowhere else (the
    engine thread's loop, engine.core.service, steps between its commands instead)."""
    loops = [
        f"{where}:{node.lineno}"
        for where, tree in modules_of(*EVERYWHERE)
        for node in ast.walk(tree)
        if isinstance(node, ast.While)
        and any(isinstance(n, ast.Call) and _named(n.func) == "has_work" for n in ast.walk(node.test))
        and any(isinstance(n, ast.Call) and _named(n.func) == "step" for s in node.body for n in ast.walk(s))
    ]
    assert [where.split(":")[0] for where in loops] == ["engine/core/llm_engine.py"], loops


RATE = re.compile(r"(^|_)(tokens?_per_s(ec(ond)?)?|tok_s|tps)$")


def _divides(node: ast.AST | None) -> bool:
    """`node` is a division or picks between divisions (a rate written out by hand)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return True
    if isinstance(node, ast.IfExp):
        return _divides(node.body) or _divides(node.orelse)
    return False


def test_tokens_per_second_are_counted_in_one_place():
    """engine.units.tokens_per_s: no other figure, field, key or function named a tokens/s rate
    is a division written out by hand."""
    by_hand = []
    for where, tree in modules_of(*EVERYWHERE):
        if where == "engine/units.py":
            continue
        for node in ast.walk(tree):
            pairs: list[tuple[str, ast.AST | None]] = []
            if isinstance(node, ast.Assign):
                pairs = [(_named(target), node.value) for target in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                pairs = [(_named(node.target), node.value)]
            elif isinstance(node, ast.keyword) and node.arg:
                pairs = [(node.arg, node.value)]
            elif isinstance(node, ast.Dict):
                pairs = [
                    (key.value, value)
                    for key, value in zip(node.keys, node.values)
                    if isinstance(key, ast.Constant) and isinstance(key.value, str)
                ]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                pairs = [(node.name, n.value) for n in ast.walk(node) if isinstance(n, ast.Return)]
            by_hand += [
                f"{where}:{node.lineno}: {name}"
                for name, value in pairs
                if RATE.search(name) and _divides(value)
            ]
    assert by_hand == [], "\n".join(by_hand)


def _built(tree: ast.AST, names: set[str]) -> bool:
    """Whether `tree` calls one of `names` (plain or as an attribute), other libraries' classes
    of the same name (httpx.Limits) aside."""
    return any(
        isinstance(n, ast.Call) and _named(n.func) in names and not _of_another_library(n.func)
        for n in ast.walk(tree)
    )


def _of_another_library(func: ast.expr) -> bool:
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in {"httpx"}


def test_what_fits_is_decided_in_one_place():
    """engine.limits: a refusal and a conversation's fit are made there only; the engine builds
    its Limits from its config and pool, and every front end (the server, the group driver, the
    chat) reads them."""
    refusing = [where for where, tree in modules_of(*EVERYWHERE) if _built(tree, {"Refusal", "ContextFit"})]
    assert refusing == ["engine/limits.py"]
    limits = [where for where, tree in modules_of(*EVERYWHERE) if _built(tree, {"Limits"})]
    assert limits == ["engine/core/llm_engine.py"]


def test_a_speedup_is_measured_in_one_place():
    """engine.core.speedup times the runs (the app's "Measure speedup" through EngineClient,
    `engine bench --speculation` through its timed_request); nothing else times a SpeedRun."""
    timers = {"SpeedRun", "timed_run", "timed_request"}
    timing = [where for where, tree in modules_of(*EVERYWHERE) if _built(tree, timers)]
    assert timing == ["engine/bench/bench_speculative.py", "engine/core/speedup.py"]
    bench = ast.parse((ROOT / "engine/bench/bench_speculative.py").read_text())
    assert not _built(bench, {"SpeedRun"}), "the bench reuses timed_request's runs"


def _ops_followed(function: ast.AST) -> set[str]:
    """The block-event ops a function tells apart (the strings it compares something with)."""
    ops: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Compare):
            for side in node.comparators:
                for c in ast.walk(side):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        ops.add(c.value)
    return ops


def test_the_page_map_is_replayed_in_one_place():
    """live.page_map folds the block events into the pool's picture (a replay follows every
    allocate to its free); the server's snapshot reads the pool's own blocks instead (the pool
    notes on each block what its events told), and nothing else replays them."""
    replaying = sorted(
        {
            where
            for where, tree in modules_of(*EVERYWHERE)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and {"allocate", "free"} <= _ops_followed(node)
        }
    )
    assert replaying == ["live/page_map.py"], replaying
