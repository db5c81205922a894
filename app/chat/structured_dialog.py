"""The chat's structured output: a schema or grammar typed or loaded from a file, checked as it
is typed by the library that will apply it (engine.api.check_grammar), so a reply never starts
under one that cannot compile. Choices are typed one per line."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from engine.api import check_grammar
from engine.config import GRAMMAR_KIND_LABELS, ConfigError, GrammarSpec

# Checked this long after the last keystroke: a check compiles the grammar (a millisecond or
# so), but not on every key of a long paste.
CHECK_DELAY_MS = 250
KINDS = ("off", "json_schema", "json_object", "regex", "lark", "gbnf", "choice")
KIND_LABELS = {
    "off": "Off (free text)",
    **GRAMMAR_KIND_LABELS,
    "choice": "One of these choices (one per line)",
}
PLACEHOLDERS = {
    "json_schema": '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}',
    "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}",
    "lark": 'start: "yes" | "no"',
    "gbnf": 'root ::= "yes" | "no"',
    "choice": "red\ngreen\nblue",
}
KIND_BY_SUFFIX = {".json": "json_schema", ".lark": "lark", ".gbnf": "gbnf", ".txt": "choice"}
VALID = "✓ valid: replies in this chat will follow it"


def spec_of(kind: str, text: str) -> GrammarSpec | None:
    """The setting as the engine takes it (choices typed one per line become a JSON list);
    ConfigError for an empty text."""
    if kind == "off":
        return None
    if kind == "choice":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return GrammarSpec("choice", json.dumps(lines) if lines else "")
    return GrammarSpec(kind, text)


def text_of(spec: GrammarSpec | None) -> str:
    if spec is None:
        return ""
    if spec.kind == "choice":
        try:
            return "\n".join(str(c) for c in json.loads(spec.text))
        except ValueError:
            return spec.text
    return spec.text


def problem_of(kind: str, text: str) -> str:
    """Why the setting cannot be used ("" when it can)."""
    try:
        spec = spec_of(kind, text)
    except ConfigError as exc:
        return str(exc)
    return "" if spec is None else check_grammar(spec)


class StructuredOutputDialog(QDialog):
    def __init__(self, current: GrammarSpec | None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Structured output for this chat")
        self.resize(560, 420)
        self.kind = QComboBox()
        for kind in KINDS:
            self.kind.addItem(KIND_LABELS[kind], kind)
        self.editor = QPlainTextEdit()
        self.editor.setObjectName("grammarEditor")
        self.editor.setTabChangesFocus(False)
        self.load_button = QPushButton("Load from file…")
        self.load_button.clicked.connect(self._on_load)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        explain = QLabel(
            "Every reply in this chat is held to it: its token mask is the sampler's first stage "
            "(the Probabilities panel shows it as “grammar”)."
        )
        explain.setWordWrap(True)
        explain.setObjectName("hint")
        top = QHBoxLayout()
        top.addWidget(QLabel("Kind"))
        top.addWidget(self.kind, 1)
        top.addWidget(self.load_button)
        layout = QVBoxLayout(self)
        layout.addWidget(explain)
        layout.addLayout(top)
        layout.addWidget(self.editor, 1)
        layout.addWidget(self.status)
        layout.addWidget(self.buttons)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(CHECK_DELAY_MS)
        self._timer.timeout.connect(self.check_now)
        kind = current.kind if current is not None else "off"
        self.kind.setCurrentIndex(KINDS.index(kind))
        self.editor.setPlainText(text_of(current))
        self.kind.currentIndexChanged.connect(self._on_kind)
        self.editor.textChanged.connect(self._timer.start)
        self._on_kind()

    @property
    def chosen_kind(self) -> str:
        return str(self.kind.currentData())

    def spec(self) -> GrammarSpec | None:
        """The setting as typed (call once it is valid: OK is enabled only then)."""
        return spec_of(self.chosen_kind, self.editor.toPlainText())

    @Slot()
    def check_now(self) -> str:
        self._timer.stop()
        problem = problem_of(self.chosen_kind, self.editor.toPlainText())
        ok = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        ok.setEnabled(not problem)
        if self.chosen_kind == "off":
            self.status.setText("Replies are free text.")
            self.status.setStyleSheet("")
        elif problem:
            self.status.setText(f"✗ {problem}")
            self.status.setStyleSheet("color: #ff6b6b;")
        else:
            self.status.setText(VALID)
            self.status.setStyleSheet("color: #50fa7b;")
        return problem

    @Slot()
    def _on_kind(self) -> None:
        kind = self.chosen_kind
        self.editor.setEnabled(kind not in ("off", "json_object"))
        self.load_button.setEnabled(kind not in ("off", "json_object"))
        self.editor.setPlaceholderText(PLACEHOLDERS.get(kind, ""))
        self.check_now()

    @Slot()
    def _on_load(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self,
            "Load a schema or grammar",
            "",
            "Schemas and grammars (*.json *.lark *.gbnf *.txt);;All files (*)",
        )
        if path:
            self.load_file(path)

    def load_file(self, path: str) -> bool:
        """Put a file's text in the editor (its kind from its name when it says); a file that
        cannot be read says so and leaves the editor as it was."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.status.setText(f"✗ cannot read {Path(path).name}: {reason}")
            self.status.setStyleSheet("color: #ff6b6b;")
            return False
        kind = KIND_BY_SUFFIX.get(Path(path).suffix.lower())
        if kind is not None:
            self.kind.setCurrentIndex(KINDS.index(kind))
        self.editor.setPlainText(text)
        self.check_now()
        return True
