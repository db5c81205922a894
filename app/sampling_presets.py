"""Named sampling presets: a few built in, each with the one-line reason it exists, and the user's
own (save, load, delete), kept in the settings file.

A preset sets the sampler's settings (temperature, truncations, penalties, DRY, XTC, groups,
logit bias and bans as typed, tokenized again by the model in use) and leaves the reply's
length, stop strings, seed and the recorded candidates as they are: choosing "Code" does not
cut a long answer short. A user's preset keeps everything it was saved with except the
recorded candidates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QInputDialog, QLabel, QPushButton, QVBoxLayout, QWidget

from app.settings import DEFAULT_SAMPLING, AppSettings
from engine.config import ConfigError, SamplingParams

PRESETS_KEY = "sampling/presets"
CUSTOM_LABEL = "(custom settings)"
# What a built-in preset decides; everything else stays as the user set it.
SAMPLER_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "xtc_threshold", "xtc_probability", "n", "num_beams", "length_penalty",
    "early_stopping",
)  # fmt: skip
# Not kept as values: the recorded candidates are a display setting, and the logit bias and bans
# are kept as typed (`token_texts`), their ids belonging to whichever model tokenizes them.
NOT_SAVED = ("snapshot_top_n", "logit_bias", "banned_token_ids", "grammar")  # a grammar is the chat's


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    reason: str
    values: dict  # SamplingParams fields it sets
    token_texts: dict = field(default_factory=dict)  # the logit bias / bans as typed
    builtin: bool = False

    def apply_to(self, current: SamplingParams) -> SamplingParams:
        return dataclasses.replace(current, **self.values)

    def matches(self, params: SamplingParams, token_texts: dict) -> bool:
        """The settings are this preset's (values compared after validation: lists = tuples)."""
        try:
            same = self.apply_to(params) == params
        except (ConfigError, TypeError, ValueError):
            return False
        return same and all(token_texts.get(k, "") == v for k, v in (self.token_texts or _NO_TEXTS).items())


_NO_TEXTS = {"logit_bias": "", "banned": ""}


def _builtin(name: str, reason: str, **overrides) -> Preset:
    """Every sampler field at the engine's neutral value except `overrides`."""
    neutral = SamplingParams()
    values = {f: getattr(neutral, f) for f in SAMPLER_FIELDS}
    values.update(overrides)
    SamplingParams(**values)  # a built-in preset must be valid
    return Preset(name, reason, values, dict(_NO_TEXTS), builtin=True)


BUILTIN_PRESETS = (
    _builtin(
        "kvscope default",
        "Keeps a small model like SmolLM2 coherent yet varied; each setting shows as a stage in the panel.",
        temperature=DEFAULT_SAMPLING.temperature,
        top_p=DEFAULT_SAMPLING.top_p,
        repetition_penalty=DEFAULT_SAMPLING.repetition_penalty,
    ),
    _builtin(
        "Deterministic (greedy)",
        "Always the likeliest token: the same reply every time, for facts, comparisons and debugging.",
        temperature=0.0,
    ),
    _builtin(
        "Code",
        "Little randomness and no repetition penalty: code repeats names and brackets on purpose.",
        temperature=0.2,
        top_p=0.95,
    ),
    _builtin(
        "Creative writing",
        "Full temperature with a min-p floor against nonsense; XTC skips the most obvious word, DRY stops loops.",
        temperature=1.0,
        min_p=0.05,
        xtc_threshold=0.1,
        xtc_probability=0.5,
        dry_multiplier=0.8,
    ),
    _builtin(
        "Typical sampling",
        "Keeps the tokens about as surprising as the model expects (Meister et al.): neither dull nor odd.",
        temperature=1.0,
        typical_p=0.9,
    ),
    _builtin(
        "No loops (DRY)",
        "Small models fall into repeating phrases; DRY penalises continuing any sequence the text already has.",
        temperature=0.7,
        min_p=0.05,
        dry_multiplier=0.8,
    ),
)


class PresetStore:
    """The built-in presets and the user's, the latter in the settings file."""

    def __init__(self, settings: AppSettings):
        self.settings = settings

    def presets(self) -> list[Preset]:
        return [*BUILTIN_PRESETS, *self._user()]

    def get(self, name: str) -> Preset | None:
        return next((p for p in self.presets() if p.name == name), None)

    def save(self, name: str, params: SamplingParams, token_texts: dict) -> Preset:
        name = " ".join(name.split())
        if not name:
            raise ValueError("A preset needs a name.")
        if any(p.name == name for p in BUILTIN_PRESETS):
            raise ValueError(f"“{name}” is a built-in preset: choose another name.")
        values = {k: v for k, v in dataclasses.asdict(params).items() if k not in NOT_SAVED}
        preset = Preset(name, "Your preset.", values, dict(token_texts))
        kept = [p for p in self._raw() if p.get("name") != name]
        self.settings.set(
            PRESETS_KEY, [*kept, {"name": name, "values": values, "token_texts": preset.token_texts}]
        )
        return preset

    def delete(self, name: str) -> bool:
        raw = self._raw()
        kept = [p for p in raw if p.get("name") != name]
        self.settings.set(PRESETS_KEY, kept)
        return len(kept) != len(raw)

    def _raw(self) -> list[dict]:
        raw = self.settings.get(PRESETS_KEY, [])
        return [p for p in raw if isinstance(p, dict)] if isinstance(raw, list) else []

    def _user(self) -> list[Preset]:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        out = []
        for raw in self._raw():
            values = {k: v for k, v in (raw.get("values") or {}).items() if k in names}
            try:
                SamplingParams(**values)  # a preset from another version that no longer validates is skipped
            except (ConfigError, TypeError, ValueError):
                continue
            texts = raw.get("token_texts") if isinstance(raw.get("token_texts"), dict) else {}
            out.append(Preset(str(raw.get("name", "")), "Your preset.", values, texts))
        return out


class PresetBar(QWidget):
    """Choose a preset (applied at once), save the current settings as one, delete one."""

    applied = Signal(object, object)  # SamplingParams, token texts

    def __init__(self, store: PresetStore, controls, parent: QWidget | None = None):
        super().__init__(parent)
        self.store, self.controls = store, controls
        self.combo = QComboBox()
        self.combo.setToolTip("Named sampling settings: choosing one applies it")
        self.save_button = QPushButton("Save…")
        self.save_button.setToolTip("Save the current sampling settings as a preset")
        self.delete_button = QPushButton("Delete")
        self.reason = QLabel("")
        self.reason.setObjectName("hint")
        self.reason.setWordWrap(True)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.combo, 1)
        row.addWidget(self.save_button)
        row.addWidget(self.delete_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addLayout(row)
        layout.addWidget(self.reason)
        self._filling = False
        self.combo.currentIndexChanged.connect(self._on_chosen)
        self.save_button.clicked.connect(self._on_save)
        self.delete_button.clicked.connect(self._on_delete)
        controls.changed.connect(self.sync)
        self.fill()

    def fill(self) -> None:
        self._filling = True
        try:
            self.combo.clear()
            self.combo.addItem(CUSTOM_LABEL, None)
            for preset in self.store.presets():
                self.combo.addItem(preset.name + ("" if preset.builtin else "  (yours)"), preset.name)
                self.combo.setItemData(self.combo.count() - 1, preset.reason, Qt.ItemDataRole.ToolTipRole)
        finally:
            self._filling = False
        self.sync()

    @Slot()
    def sync(self, _params=None) -> None:
        """Show which preset the current settings are (or "custom")."""
        params, texts = self.controls.params(), self.controls.token_texts()
        match = next((p for p in self.store.presets() if p.matches(params, texts)), None)
        self._filling = True
        try:
            self.combo.setCurrentIndex(self.combo.findData(match.name) if match else 0)
        finally:
            self._filling = False
        self.reason.setText(match.reason if match else "Settings of your own: Save… keeps them as a preset.")
        self.delete_button.setEnabled(match is not None and not match.builtin)
        self.delete_button.setToolTip(
            "Delete this preset" if match is not None and not match.builtin else "Built-in presets stay"
        )

    def apply(self, name: str) -> bool:
        preset = self.store.get(name)
        if preset is None:
            return False
        try:
            params = preset.apply_to(self.controls.params())
        except (ConfigError, TypeError, ValueError) as exc:
            self.reason.setText(f"“{name}” does not apply here: {exc}")
            return False
        texts = preset.token_texts or dict(_NO_TEXTS)
        self.controls.set_params(params, texts)
        self.controls.tokens.resolve_now()
        self.applied.emit(params, texts)
        self.sync()
        return True

    @Slot(int)
    def _on_chosen(self, index: int) -> None:
        name = self.combo.itemData(index)
        if not self._filling and name is not None:
            self.apply(name)

    @Slot()
    def _on_save(self) -> None:
        name, ok = QInputDialog.getText(self, "Save sampling preset", "Name:")
        if ok:
            self.save_as(name)

    def save_as(self, name: str) -> Preset | None:
        try:
            preset = self.store.save(name, self.controls.params(), self.controls.token_texts())
        except ValueError as exc:
            self.reason.setText(str(exc))
            return None
        self.fill()
        return preset

    @Slot()
    def _on_delete(self) -> None:
        name = self.combo.currentData()
        if name is not None and self.store.delete(name):
            self.fill()
