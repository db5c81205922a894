"""Editors for every SamplingParams field, each with a one-line explanation, plus the what-if
toggle that lets the probability panel re-view past tokens under the edited settings. Logit
bias and banned tokens are typed as text and shown as the model's tokens (app.sampling_tokens);
named presets sit above (app.sampling_presets)."""

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

from app.sampling_fields import (  # noqa: F401 - the controls' vocabulary, importable from here
    EARLY_STOPPING_CHOICES,
    EXPLANATIONS,
    format_stop_strings,
    parse_stop_strings,
)
from app.sampling_tokens import TokenTextEditors
from engine.config import ConfigError, SamplingParams


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
        self.typical_p = _double(0.01, 1.0, 0.01)
        self.dry_multiplier = _double(0.0, 5.0, 0.05)
        self.dry_base = _double(1.0, 5.0, 0.05)
        self.dry_allowed_length = _int(1, 50)
        self.dry_penalty_last_n = _int(0, 1_000_000)
        self.dry_sequence_breakers = QLineEdit()
        self.xtc_threshold = _double(0.01, 0.5, 0.01)
        self.xtc_probability = _double(0.0, 1.0, 0.05)
        self.tokens = TokenTextEditors(self)
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
            "typical_p": self.typical_p,
            "dry_multiplier": self.dry_multiplier,
            "dry_base": self.dry_base,
            "dry_allowed_length": self.dry_allowed_length,
            "dry_penalty_last_n": self.dry_penalty_last_n,
            "dry_sequence_breakers": self.dry_sequence_breakers,
            "xtc_threshold": self.xtc_threshold,
            "xtc_probability": self.xtc_probability,
            "logit_bias": self.tokens.bias,
            "banned_token_ids": self.tokens.banned,
        }
        # Under their field: what the typed entries became as the model's tokens.
        shown_under = {"logit_bias": self.tokens.bias_tokens, "banned_token_ids": self.tokens.banned_tokens}
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        # a field under its label where the column is too narrow for both side by side
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
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
            if name in shown_under:
                form.addRow(shown_under[name])
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
            self.typical_p,
            self.dry_multiplier,
            self.dry_base,
            self.xtc_threshold,
            self.xtc_probability,
        ):
            box.valueChanged.connect(self._on_edited)
        for box in (
            self.top_k,
            self.seed,
            self.max_new_tokens,
            self.snapshot_top_n,
            self.n,
            self.num_beams,
            self.dry_allowed_length,
            self.dry_penalty_last_n,
        ):
            box.valueChanged.connect(self._on_edited)
        self.early_stopping.currentIndexChanged.connect(self._on_edited)
        self.stop.textChanged.connect(self._on_edited)
        self.dry_sequence_breakers.textChanged.connect(self._on_edited)
        self.tokens.changed.connect(self._on_edited)
        for check in (self.seed_fixed, self.ignore_eos):
            check.toggled.connect(self._on_edited)
        self.what_if.toggled.connect(self._on_what_if_toggled)

    # ---- values ----------------------------------------------------------------------------
    def set_params(self, p: SamplingParams, token_texts: dict | None = None) -> None:
        """Show `p`; its logit bias and bans as `token_texts` when given (what the user typed),
        else as #id entries."""
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
        self.typical_p.setValue(p.typical_p)
        self.dry_multiplier.setValue(p.dry_multiplier)
        self.dry_base.setValue(p.dry_base)
        self.dry_allowed_length.setValue(p.dry_allowed_length)
        self.dry_penalty_last_n.setValue(p.dry_penalty_last_n)
        self.dry_sequence_breakers.setText(format_stop_strings(p.dry_sequence_breakers))
        self.xtc_threshold.setValue(p.xtc_threshold)
        self.xtc_probability.setValue(p.xtc_probability)
        self.tokens.set_texts(token_texts, p.logit_bias, p.banned_token_ids)
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
            typical_p=self.typical_p.value(),
            dry_multiplier=self.dry_multiplier.value(),
            dry_base=self.dry_base.value(),
            dry_allowed_length=self.dry_allowed_length.value(),
            dry_penalty_last_n=self.dry_penalty_last_n.value(),
            dry_sequence_breakers=parse_stop_strings(self.dry_sequence_breakers.text()),
            xtc_threshold=self.xtc_threshold.value(),
            xtc_probability=self.xtc_probability.value(),
            logit_bias=self.tokens.logit_bias,
            banned_token_ids=self.tokens.banned_token_ids,
        )

    def _sync_beam_only(self) -> None:
        # Length penalty and early stopping only shape a beam search: idle without one; DRY's
        # and XTC's other settings only matter once they are on.
        beams = self.num_beams.value() > 1
        self.length_penalty.setEnabled(beams)
        self.early_stopping.setEnabled(beams)
        dry = self.dry_multiplier.value() > 0
        for box in (
            self.dry_base,
            self.dry_allowed_length,
            self.dry_penalty_last_n,
            self.dry_sequence_breakers,
        ):
            box.setEnabled(dry)
        self.xtc_threshold.setEnabled(self.xtc_probability.value() > 0)

    def token_texts(self) -> dict[str, str]:
        """The logit bias and bans as typed (kept in settings and presets beside the ids)."""
        return self.tokens.texts()

    def set_token_resolver(self, resolver) -> None:
        """How typed entries become tokens (the running engine's tokenizer); resolves them now."""
        self.tokens.resolver = resolver
        self.tokens.resolve_now()

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
