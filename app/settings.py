"""User settings: a thin typed layer over an INI-backed QSettings.

An explicit file (not the platform registry) keeps tests isolated through KVSCOPE_CONFIG_DIR and
lets a user see and delete what kvscope remembers. Values are stored as JSON text because an INI
QSettings hands every scalar back as a string.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings

from app.paths import settings_path
from engine.config import ConfigError, EngineConfig, ModelSpec, SamplingParams
from engine.units import MIB

# The probability panel needs per-token snapshots; 20 candidates show the shape of a
# distribution without making each token event heavy.
DEFAULT_SNAPSHOT_TOP_N = 20
# The app's starting point for chat. Small models ramble at temperature 1 (the engine's neutral
# default); these keep SmolLM2-135M coherent, and each setting is a visible stage in the
# probability panel, so a new user sees penalties, temperature and a top-p cut at work.
DEFAULT_SAMPLING = SamplingParams(
    temperature=0.6, top_p=0.9, repetition_penalty=1.1, snapshot_top_n=DEFAULT_SNAPSHOT_TOP_N
)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelChoice:
    """What the model picker last loaded: enough to rebuild an EngineConfig."""

    source: str = "default"
    dtype: str = "float32"
    device: str = "auto"
    block_size: int = 16
    kv_budget_mib: int = 0  # 0 = let the engine size the pool
    quantization: str = "auto"  # weight scheme (engine.quant.schemes), applied at load time
    kv_dtype: str = "auto"  # KV cache storage: "auto" (the model's dtype) or "int8"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelSpec(self.source, self.dtype, self.device, quantization=self.quantization),
            block_size=self.block_size,
            kv_budget_bytes=self.kv_budget_mib * MIB if self.kv_budget_mib else None,
            kv_dtype=self.kv_dtype,
        )


class AppSettings:
    def __init__(self, path: Path | str | None = None):
        self._qs = QSettings(str(path or settings_path()), QSettings.Format.IniFormat)

    def sync(self) -> None:
        self._qs.sync()

    # ---- generic JSON values ---------------------------------------------------------------
    def get(self, key: str, default=None):
        raw = self._qs.value(key)
        if raw is None:
            return default
        try:
            return json.loads(raw)
        except (TypeError, ValueError):
            return default

    def set(self, key: str, value) -> None:
        self._qs.setValue(key, json.dumps(value))

    # ---- window layout ---------------------------------------------------------------------
    def window_layout(self) -> tuple[QByteArray | None, QByteArray | None]:
        return self._bytes("window/geometry"), self._bytes("window/state")

    def set_window_layout(self, geometry: QByteArray, state: QByteArray) -> None:
        self._qs.setValue("window/geometry", bytes(geometry.toBase64().data()).decode())
        self._qs.setValue("window/state", bytes(state.toBase64().data()).decode())

    def _bytes(self, key: str) -> QByteArray | None:
        raw = self._qs.value(key)
        return QByteArray.fromBase64(raw.encode()) if isinstance(raw, str) and raw else None

    # ---- sampling and model ----------------------------------------------------------------
    def sampling(self) -> SamplingParams:
        """The last sampling settings; a stale or invalid entry falls back to the defaults."""
        saved = self.get("sampling/params", {})
        if not isinstance(saved, dict):
            return DEFAULT_SAMPLING
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        values = dataclasses.asdict(DEFAULT_SAMPLING)
        values.update({k: v for k, v in saved.items() if k in names})
        try:
            return SamplingParams(**values)
        except (ConfigError, TypeError):
            return DEFAULT_SAMPLING

    def set_sampling(self, params: SamplingParams, token_texts: dict | None = None) -> None:
        self.set("sampling/params", dataclasses.asdict(params))
        if token_texts is not None:
            self.set("sampling/token_texts", token_texts)

    def token_texts(self) -> dict | None:
        """The logit bias and banned tokens as the user typed them (the params hold their ids)."""
        saved = self.get("sampling/token_texts")
        if not isinstance(saved, dict):
            return None
        return {k: str(saved.get(k, "")) for k in ("logit_bias", "banned")}

    def model_choice(self) -> ModelChoice:
        saved = self.get("model/choice", {})
        names = {f.name for f in dataclasses.fields(ModelChoice)}
        try:
            choice = ModelChoice(**{k: v for k, v in (saved or {}).items() if k in names})
            choice.engine_config()  # validates
            return choice
        except (ConfigError, TypeError):
            return ModelChoice()

    def set_model_choice(self, choice: ModelChoice) -> None:
        self.set("model/choice", dataclasses.asdict(choice))

    # ---- the chat --------------------------------------------------------------------------
    def context_policy(self) -> str:
        """What a send does at the context limit: "drop" the oldest turns, or "refuse"."""
        from app.chat.context_fit import DEFAULT_POLICY
        from engine.api import POLICIES

        value = self.get("chat/context_policy", DEFAULT_POLICY)
        return value if value in POLICIES else DEFAULT_POLICY

    def set_context_policy(self, policy: str) -> None:
        self.set("chat/context_policy", policy)
