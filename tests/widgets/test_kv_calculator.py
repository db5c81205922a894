"""KV memory calculator: the formula's figures (GQA/MQA, context x batch, tokens in a budget),
the 8B-class example, the chart, and filling the fields from the loaded model or a model folder."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from widget_events import model_info

from engine.events import ModelLoaded
from engine.model.shapes import ModelShapes
from live.state import LiveState
from widgets.kv_calculator import GIB, KVCalculator
from widgets.kv_memory import KVConfig, chart_batches

# The engine tests' hand-written model folders (tests/engine is on the path only when its tests run).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from model_folders import LLAMA_8B_CONFIG, write_config  # noqa: E402

LLAMA_8B = KVConfig(
    num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", context=131072, num_heads=32
)


def test_8b_class_config_at_128k_context_takes_16_gib_per_sequence():
    assert LLAMA_8B.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert LLAMA_8B.bytes_per_sequence == 16 * GIB
    # GQA: 32 query heads over 8 KV heads store a quarter of what multi-head attention would.
    assert LLAMA_8B.mha_bytes_per_token == 4 * LLAMA_8B.bytes_per_token


def test_formula_agrees_with_model_shapes():
    shapes = ModelShapes.from_config(type("Cfg", (), LLAMA_8B_CONFIG)())
    for dtype in ("float32", "bfloat16", "int8"):
        config = KVConfig(num_layers=32, num_kv_heads=8, head_dim=128, dtype=dtype, context=1)
        assert config.bytes_per_token == shapes.kv_bytes_per_token(dtype)


def test_mqa_batch_and_budget():
    mqa = KVConfig(
        num_layers=24,
        num_kv_heads=1,
        head_dim=64,
        dtype="bfloat16",
        context=4096,
        batch=8,
        num_heads=16,
        weight_bytes=3 * GIB,
        budget_bytes=4 * GIB,
    )
    assert mqa.bytes_per_token == 2 * 24 * 1 * 64 * 2 == 6144
    assert mqa.mha_bytes_per_token == 16 * 6144
    assert mqa.total_bytes == 6144 * 4096 * 8
    assert mqa.bytes_beside_weights == GIB
    assert mqa.tokens_in_budget == GIB // 6144 == 174_762
    assert mqa.tokens_per_sequence_in_budget == 174_762 // 8
    assert mqa.fits  # 192 MiB of KV in 1 GiB
    over = KVConfig(num_layers=24, num_kv_heads=1, head_dim=64, dtype="bfloat16", context=4096,
                    weight_bytes=5 * GIB, budget_bytes=4 * GIB)  # fmt: skip
    assert over.tokens_in_budget == 0 and not over.fits


def test_bad_configs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="cannot be shared evenly"):
        KVConfig(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float32", context=8, num_heads=8)
    with pytest.raises(ValueError, match="KV dtype must be one of"):
        KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, dtype="int4", context=8)


def test_chart_batches():
    assert chart_batches(1) == [1, 4, 16, 64]
    assert chart_batches(8) == [1, 4, 8, 16, 64]


@pytest.fixture
def calculator(qtbot):
    widget = KVCalculator(LiveState())
    qtbot.addWidget(widget)
    yield widget
    assert widget.shutdown(30)


def test_widget_shows_16_gib_for_the_8b_config_and_draws_each_batch(calculator):
    calculator.set_config(LLAMA_8B)
    text = calculator.results.text()
    assert "Per token <b>128 KiB</b>" in text
    assert "Per sequence at 131,072 tokens <b>16.0 GiB</b>" in text
    assert "GQA: 4 query heads share each KV head" in text
    # Typing a batch of 4 multiplies the total and adds the chosen batch to the chart.
    calculator.batch.setValue(4)
    assert "= <b>64.0 GiB</b>" in calculator.results.text()
    assert calculator.follows_loaded is False  # a typed value stops following the loaded model
    x, y = calculator.curve(4)
    assert x[-1] == 131072 and y[-1] == pytest.approx(64.0)  # GiB axis
    assert set(calculator.curves) == {1, 4, 16, 64}
    # The y axis ends above the chosen batch: batch 16 and 64 run off the top, not batch 4 flat.
    assert calculator.plot.getPlotItem().viewRange()[1][1] == pytest.approx(1.3 * 64.0)
    np.testing.assert_allclose(calculator.curve(16)[1], 4 * calculator.curve(4)[1])


def test_widget_budget_line_and_tokens_that_fit(calculator):
    calculator.set_config(
        KVConfig(
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            dtype="float16",
            context=8192,
            batch=2,
            weight_bytes=15 * GIB,
            budget_bytes=24 * GIB,
        )  # fmt: skip
    )
    text = calculator.results.text()
    assert "leaves <b>9.0 GiB</b> for KV = <b>73,728 tokens</b> (36,864 per sequence at batch 2)" in text
    assert "this batch fits" in text
    assert calculator.budget_line.value() == pytest.approx(9.0)


def test_widget_follows_the_loaded_model(qtbot):
    state = LiveState()
    calculator = KVCalculator(state)
    qtbot.addWidget(calculator)
    info = model_info(num_layers=30, num_kv_heads=3, num_heads=9, head_dim=64, max_position_embeddings=8192)
    state.apply([ModelLoaded(info, 16, 16, 16 * 16 * 512)])
    calculator.model_loaded()
    c = calculator.config
    assert (c.num_layers, c.num_kv_heads, c.num_heads, c.head_dim, c.dtype, c.context) == (
        30,
        3,
        9,
        64,
        "float32",
        8192,
    )
    assert c.weight_bytes == pytest.approx(info.weight_bytes, abs=GIB / 1000)
    assert "Per token <b>45.0 KiB</b>" in calculator.results.text()  # 2 x 30 x 3 x 64 x 4 B


def test_from_model_reads_a_folder_config_off_the_gui_thread(calculator, qtbot, tmp_path):
    folder = write_config(tmp_path / "llama8b", LLAMA_8B_CONFIG)
    calculator.dtype.setCurrentText("float16")
    calculator.source.setText(str(folder))
    with qtbot.waitSignal(calculator.job.succeeded, timeout=30_000):
        calculator.from_model.click()
    c = calculator.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.context) == (32, 8, 128, 131072)
    assert "<b>16.0 GiB</b>" in calculator.results.text()


def test_from_model_with_a_bad_source_says_why(calculator, qtbot, tmp_path):
    calculator.source.setText(str(tmp_path / "missing"))
    with qtbot.waitSignal(calculator.job.failed, timeout=30_000):
        calculator.from_model.click()
    assert "Cannot read that model" in calculator.results.text()
    assert calculator.from_model.isEnabled()
