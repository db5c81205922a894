"""engine/ is Qt-free and knows nothing of app/ or widgets/ (one-way arrows)."""

import ast
from pathlib import Path

FORBIDDEN = ("PySide6", "PyQt5", "PyQt6", "pyqtgraph", "app", "widgets", "shiboken6")


def test_engine_imports_no_qt_app_or_widgets():
    root = Path(__file__).resolve().parents[2] / "engine"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert len(list(root.rglob("*.py"))) > 10, "the check must actually see the engine's modules"
    assert offenders == []


def test_widgets_do_not_talk_to_the_engine_thread():
    root = Path(__file__).resolve().parents[2] / "widgets"
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module not in ("engine.service", "engine.llm_engine", "app.engine_host"), (
                    path.name
                )
