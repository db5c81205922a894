"""Editors for every SamplingParams field, each with a one-line explanation, plus the what-if
toggle that lets the probability panel re-view past tokens under the edited settings."""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.config import ConfigError, SamplingParams

# field -> (label, one-line explanation). Every SamplingParams field must appear here: a test
# compares this table with the dataclass, so a new engine setting cannot go missing in the GUI.
EXPLANATIONS: dict[str, tuple[str, str]] = {
    "temperature": (
        "Temperature",
        "Divides the logits: < 1 sharpens, > 1 flattens; 0 always takes the top token.",
    ),
    "top_k": ("Top-k", "Keep only the k likeliest tokens (0 = off)."),
    "top_p": ("Top-p", "Keep the smallest set of tokens whose probability adds up to p (1 = off)."),
    "min_p": ("Min-p", "Drop tokens below min-p × the top token's probability (0 = off)."),
    "repetition_penalty": (
        "Repetition penalty",
        "Divides logits of tokens already in the text (> 1 avoids repeats).",
    ),
    "presence_penalty": ("Presence penalty", "Subtracted once from every token that has appeared."),
    "frequency_penalty": ("Frequency penalty", "Subtracted for each time a token has appeared."),
    "seed": ("Seed", "Fix it to make a reply reproducible; unchecked draws a new seed each time."),
    "max_new_tokens": ("Max new tokens", "The reply stops after this many tokens."),
    "stop": ("Stop strings", "The reply ends before the first of these; separate with |, \\n is a newline."),
    "ignore_eos": ("Ignore EOS", "Keep generating past the model's end-of-reply token."),
    "snapshot_top_n": (
        "Recorded candidates",
        "Candidates kept per token for the Probabilities panel (0 = none).",
    ),
    "n": (
        "Samples (n)",
        "Draw n replies to one prompt side by side; they share the prompt's KV pages (temperature > 0).",
    ),
    "num_beams": (
        "Beams",
        "Beam search: keep the k best-scoring continuations each step, return them ranked "
        "(1 = off; temperature 0).",
    ),
    "length_penalty": (
        "Length penalty",
        "Beams: a finished beam scores sum(log p) / length^penalty; above 0 favours longer replies.",
    ),
    "early_stopping": (
        "Early stopping",
        "Beams: stop once k beams finished (yes), when none running can still win (heuristic), "
        "or only when exactly none can (never).",
    ),
}

# The early-stopping choices in the order the combo box lists them, with transformers' values.
EARLY_STOPPING_CHOICES: tuple[tuple[str, bool | str], ...] = (
    ("heuristic (False)", False),
    ("yes (True)", True),
    ("never", "never"),
)

_ESCAPES = {"n": "\n", "t": "\t", "|": "|", "\\": "\\"}


def parse_stop_strings(text: str) -> tuple[str, ...]:
    """'###|\\n\\n|User:' -> ('###', '\\n\\n', 'User:'). Backslash escapes \\n \\t \\| \\\\."""
    parts, current, i = [], [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            current.append(_ESCAPES[text[i + 1]])
            i += 2
            continue
        if ch == "|":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return tuple(p for p in (s.strip(" ") for s in parts) if p)


def format_stop_strings(stops: tuple[str, ...]) -> str:
    def escape(s: str) -> str:
        return s.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n").replace("\t", "\\t")

    return " | ".join(escape(s) for s in stops)


def _double(minimum: float, maximum: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(minimum, maximum)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    return box


def _int(minimum: int, maximum: int) -> QSpinBox:
    box = QSpinBox()
    box.setRange(minimum, maximum)
    return box


class SamplingControls(QWidget):
    """Emits `changed(SamplingParams)` on every valid edit and `what_if_changed(params | None)`."""

    changed = Signal(object)
    what_if_changed = Signal(object)

    def __init__(self, params: SamplingParams, parent: QWidget | None = None):
        super().__init__(parent)
        self.temperature = _double(0.0, 5.0, 0.05)
        self.top_k = _int(0, 10_000)
        self.top_p = _double(0.01, 1.0, 0.01)
        self.min_p = _double(0.0, 0.99, 0.01)
        self.repetition_penalty = _double(0.05, 5.0, 0.05)
        self.presence_penalty = _double(-2.0, 2.0, 0.1)
        self.frequency_penalty = _double(-2.0, 2.0, 0.1)
        self.seed_fixed = QCheckBox("fixed")
        self.seed = _int(0, 2**31 - 1)
        self.max_new_tokens = _int(1, 32_768)
        self.stop = QLineEdit()
        self.stop.setPlaceholderText("none")
        self.ignore_eos = QCheckBox()
        self.snapshot_top_n = _int(0, 200)
        # The engine refuses a group larger than its max_num_seqs (8 by default) with a message.
        self.n = _int(1, 16)
        self.num_beams = _int(1, 16)
        self.length_penalty = _double(-5.0, 5.0, 0.1)
        self.early_stopping = QComboBox()
        for label, _value in EARLY_STOPPING_CHOICES:
            self.early_stopping.addItem(label)
        self.what_if = QCheckBox("What-if view")
        what_if_text = (
            "The Probabilities panel recomputes the selected token exactly under the settings above: "
            "its full logits from one forward over its context on the engine, then the sampler's "
            "own stages; labelled as a what-if (the reply itself is unchanged)."
        )
        self.what_if.setToolTip(what_if_text)
        what_if_hint = QLabel(what_if_text)
        what_if_hint.setObjectName("hint")
        what_if_hint.setWordWrap(True)
        self.error = QLabel()
        self.error.setObjectName("fieldError")
        self.error.setWordWrap(True)
        self.error.hide()

        seed_row = QWidget()
        seed_layout = QHBoxLayout(seed_row)
        seed_layout.setContentsMargins(0, 0, 0, 0)
        seed_layout.addWidget(self.seed_fixed)
        seed_layout.addWidget(self.seed, 1)
        editors = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": seed_row,
            "max_new_tokens": self.max_new_tokens,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "snapshot_top_n": self.snapshot_top_n,
            "n": self.n,
            "num_beams": self.num_beams,
            "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping,
        }
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.setVerticalSpacing(2)
        for name, editor in editors.items():
            label, explanation = EXPLANATIONS[name]
            caption = QLabel(label)
            caption.setToolTip(explanation)
            editor.setToolTip(explanation)
            hint = QLabel(explanation)
            hint.setObjectName("hint")
            hint.setWordWrap(True)
            form.addRow(caption, editor)
            form.addRow(hint)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(form)
        layout.addWidget(self.error)
        layout.addWidget(self.what_if)
        layout.addWidget(what_if_hint)

        self._quiet = False
        self.set_params(params)
        for box in (
            self.temperature,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.presence_penalty,
            self.frequency_penalty,
            self.length_penalty,
        ):
            box.valueChanged.connect(self._on_edited)
        for box in (self.top_k, self.seed, self.max_new_tokens, self.snapshot_top_n, self.n, self.num_beams):
            box.valueChanged.connect(self._on_edited)
        self.early_stopping.currentIndexChanged.connect(self._on_edited)
        self.stop.textChanged.connect(self._on_edited)
        for check in (self.seed_fixed, self.ignore_eos):
            check.toggled.connect(self._on_edited)
        self.what_if.toggled.connect(self._on_what_if_toggled)

    # ---- values ----------------------------------------------------------------------------
    def set_params(self, p: SamplingParams) -> None:
        self._quiet = True  # the editors' own signals fire below; they are not user edits
        self.temperature.setValue(p.temperature)
        self.top_k.setValue(p.top_k)
        self.top_p.setValue(p.top_p)
        self.min_p.setValue(p.min_p)
        self.repetition_penalty.setValue(p.repetition_penalty)
        self.presence_penalty.setValue(p.presence_penalty)
        self.frequency_penalty.setValue(p.frequency_penalty)
        self.seed_fixed.setChecked(p.seed is not None)
        self.seed.setValue(p.seed if p.seed is not None else 0)
        self.seed.setEnabled(p.seed is not None)
        self.max_new_tokens.setValue(p.max_new_tokens)
        self.stop.setText(format_stop_strings(p.stop))
        self.ignore_eos.setChecked(p.ignore_eos)
        self.snapshot_top_n.setValue(p.snapshot_top_n)
        self.n.setValue(p.n)
        self.num_beams.setValue(p.num_beams)
        self.length_penalty.setValue(p.length_penalty)
        self.early_stopping.setCurrentIndex(
            next(
                i
                for i, (_, v) in enumerate(EARLY_STOPPING_CHOICES)
                if v == p.early_stopping and type(v) is type(p.early_stopping)
            )
        )
        self._sync_beam_only()
        self.error.hide()
        self._quiet = False
        self._params = p

    def params(self) -> SamplingParams:
        """The last valid settings (an invalid edit is shown and not applied)."""
        return self._params

    def _read(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature.value(),
            top_k=self.top_k.value(),
            top_p=self.top_p.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition_penalty.value(),
            presence_penalty=self.presence_penalty.value(),
            frequency_penalty=self.frequency_penalty.value(),
            seed=self.seed.value() if self.seed_fixed.isChecked() else None,
            max_new_tokens=self.max_new_tokens.value(),
            stop=parse_stop_strings(self.stop.text()),
            ignore_eos=self.ignore_eos.isChecked(),
            snapshot_top_n=self.snapshot_top_n.value(),
            n=self.n.value(),
            num_beams=self.num_beams.value(),
            length_penalty=self.length_penalty.value(),
            early_stopping=EARLY_STOPPING_CHOICES[self.early_stopping.currentIndex()][1],
        )

    def _sync_beam_only(self) -> None:
        # Length penalty and early stopping only shape a beam search: idle without one.
        beams = self.num_beams.value() > 1
        self.length_penalty.setEnabled(beams)
        self.early_stopping.setEnabled(beams)

    # ---- slots -----------------------------------------------------------------------------
    @Slot()
    def _on_edited(self) -> None:
        if self._quiet:
            return
        self.seed.setEnabled(self.seed_fixed.isChecked())
        self._sync_beam_only()
        try:
            params = self._read()
        except ConfigError as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        self.error.hide()
        if params == self._params:
            return
        self._params = params
        self.changed.emit(params)
        if self.what_if.isChecked():
            self.what_if_changed.emit(params)

    @Slot(bool)
    def _on_what_if_toggled(self, on: bool) -> None:
        self.what_if_changed.emit(self._params if on else None)


def sampling_field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)}
