"""The model picker shows inspect_model's estimate before loading, and why it cannot."""

from __future__ import annotations

from app.models.picker import ModelPicker, describe_estimate
from app.settings import ModelChoice
from engine.units import MIB

ESTIMATE = {
    "architecture": "LlamaForCausalLM",
    "params": 134_515_008,
    "num_layers": 30,
    "num_kv_heads": 3,
    "head_dim": 64,
    "dtype": "float32",
    "weight_bytes": 538_060_032,
    "budget_bytes": 8 * 1024 * MIB,
    "budget_source": "available RAM now",
    "weights_fit_in_budget": True,
    "kv_bytes_per_token": 46_080,
    "context": 8192,
    "kv_bytes_for_context": 46_080 * 8192,
}


def test_describe_estimate_states_weights_kv_and_the_pool():
    text = describe_estimate(ESTIMATE, kv_budget_bytes=64 * MIB, block_size=16)
    assert "135 M parameters" in text and "30 layers, 3 KV heads × 64" in text
    assert "Weights ≈ 513 MiB in float32: fits in 8.0 GiB (available RAM now)" in text
    assert "45.0 KiB per token" in text and "8,192-token context needs 360 MiB" in text
    pages = 64 * MIB // (46_080 * 16)
    assert f"= {pages:,} pages of 16 = {pages * 16:,} tokens" in text


def test_the_packaged_default_is_estimated_from_its_metadata(qtbot):
    picker = ModelPicker(ModelChoice(), default_budget_bytes=256 * MIB)
    qtbot.addWidget(picker)
    picker.refresh_estimate()
    qtbot.waitUntil(
        lambda: "Weights" in picker.estimate.text() or "Cannot" in picker.estimate.text(), timeout=60_000
    )
    picker.wait_for_estimate()
    text = picker.estimate.text()
    assert "LlamaForCausalLM" in text and "30 layers" in text, text
    # the default loads at the GGUF's own bits, so that is what the estimate counts (~94 MiB)
    assert "MiB at the file's own bits" in text, text
    picker.kv_budget.setValue(128)  # the pool line follows the budget without re-reading the file
    assert "KV budget 128 MiB" in picker.estimate.text()
    picker.quantization.scheme.setCurrentIndex(picker.quantization.scheme.findData("none"))
    qtbot.waitUntil(lambda: "MiB in float32" in picker.estimate.text(), timeout=60_000)  # dequantized


def test_a_missing_model_says_why_it_cannot_be_estimated(qtbot, tmp_path):
    picker = ModelPicker(ModelChoice(source=str(tmp_path / "nowhere")), default_budget_bytes=256 * MIB)
    qtbot.addWidget(picker)
    picker.refresh_estimate()
    qtbot.waitUntil(lambda: picker.estimate.text().startswith("Cannot estimate"), timeout=60_000)
    picker.wait_for_estimate()
    assert "nowhere" in picker.estimate.text()
    assert picker.choice().source == str(tmp_path / "nowhere")


def test_load_emits_the_chosen_configuration(qtbot):
    picker = ModelPicker(ModelChoice(), default_budget_bytes=256 * MIB)
    qtbot.addWidget(picker)
    picker.dtype.setCurrentText("bfloat16")
    picker.block_size.setValue(8)
    picker.kv_budget.setValue(32)
    with qtbot.waitSignal(picker.load_requested) as loaded:
        picker.load_button.click()
    assert loaded.args[0] == ModelChoice(
        source="default", dtype="bfloat16", device="auto", block_size=8, kv_budget_mib=32
    )
    picker.wait_for_estimate()
