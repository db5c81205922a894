"""Settings round-trip through the INI file and fall back to defaults when stale or invalid."""

from __future__ import annotations

from PySide6.QtCore import QByteArray

from app.settings import DEFAULT_SAMPLING, AppSettings, ModelChoice
from engine.config import SamplingParams
from engine.units import MIB


def test_sampling_and_model_choice_round_trip(tmp_path):
    path = tmp_path / "settings.ini"
    params = SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, seed=3, stop=("###", "\n\n"), snapshot_top_n=12
    )
    choice = ModelChoice(
        source="/models/x.gguf", dtype="bfloat16", device="cpu", block_size=8, kv_budget_mib=64
    )
    first = AppSettings(path)
    first.set_sampling(params)
    first.set_model_choice(choice)
    first.set_window_layout(QByteArray(b"geo\x00metry"), QByteArray(b"\x01state"))
    first.sync()

    second = AppSettings(path)
    assert second.sampling() == params
    assert second.model_choice() == choice
    geometry, state = second.window_layout()
    assert bytes(geometry) == b"geo\x00metry" and bytes(state) == b"\x01state"


def test_defaults_when_nothing_is_saved(tmp_path):
    settings = AppSettings(tmp_path / "settings.ini")
    assert settings.sampling() == DEFAULT_SAMPLING
    assert settings.model_choice() == ModelChoice()
    assert settings.window_layout() == (None, None)


def test_invalid_saved_values_fall_back(tmp_path):
    settings = AppSettings(tmp_path / "settings.ini")
    settings.set("sampling/params", {"temperature": -3, "unknown_field": 1})
    settings.set("model/choice", {"block_size": 0})
    assert settings.sampling() == DEFAULT_SAMPLING
    assert settings.model_choice() == ModelChoice()


def test_model_choice_builds_the_engine_config():
    config = ModelChoice(source="default", dtype="float32", block_size=32, kv_budget_mib=10).engine_config()
    assert config.block_size == 32 and config.kv_budget_bytes == 10 * MIB and config.model.source == "default"
    assert ModelChoice(kv_budget_mib=0).engine_config().kv_budget_bytes is None
