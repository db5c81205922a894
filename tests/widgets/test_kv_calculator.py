"""KV memory calculator: the formula's figures (GQA/MQA, int8 with its scales, context x batch,
tokens in a budget), the 8B-class example, the chart, and what the widget shows of the configs
the shell hands it (the shell's side: tests/app/test_app_physics.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import DTYPES
from engine.model.kv_storage import PagedKVStorage
from engine.shapes import ModelShapes
from engine.units import GIB
from live.state import LiveState
from widgets.kv_calculator import KVCalculator
from widgets.kv_memory import KV_DTYPES, KVConfig, chart_batches, kv_storage

# The engine tests' hand-written model folders (tests/engine is on the path only when its tests run).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from model_folders import LLAMA_8B_CONFIG  # noqa: E402

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
    for dtype in ("float32", "bfloat16"):
        config = KVConfig(num_layers=32, num_kv_heads=8, head_dim=128, dtype=dtype, context=1)
        assert config.bytes_per_token == shapes.kv_bytes_per_token(dtype)
    int8 = KVConfig(num_layers=32, num_kv_heads=8, head_dim=128, dtype="int8", context=1)
    assert int8.bytes_per_token == shapes.kv_bytes_per_token(kv_dtype="int8")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kv_dtype_is_what_the_engines_pool_stores(dtype):
    """Per token, exactly what a block of the engine's own pool takes over its block size, for
    the model dtypes (kv_dtype auto) and int8 (its float16 scales counted)."""
    import torch

    for kv_dtype in ("auto", "int8"):
        config = KVConfig(
            num_layers=30, num_kv_heads=3, head_dim=64, dtype=kv_storage(dtype, kv_dtype), context=1
        )
        block = PagedKVStorage.block_bytes(30, 16, 3, 64, getattr(torch, dtype), kv_dtype)
        assert config.bytes_per_token * 16 == block, (dtype, kv_dtype)
    # int8: 2 x 30 layers x 3 heads x (64 codes + a 2-byte scale), not 64 bytes a head
    assert KVConfig(30, 3, 64, "int8", 1).bytes_per_token == 2 * 30 * 3 * 66


def test_only_the_kv_dtypes_the_engine_has_are_offered(qtbot):
    assert KV_DTYPES == ("float32", "bfloat16", "float16", "int8")
    calculator = KVCalculator(LiveState())
    qtbot.addWidget(calculator)
    assert [calculator.dtype.itemText(i) for i in range(calculator.dtype.count())] == list(KV_DTYPES)


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
    return widget


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


def test_the_widget_shows_what_the_shell_hands_it(calculator, qtbot):
    loaded = KVConfig(30, 3, 64, "int8", 8192, num_heads=9, weight_bytes=GIB // 2, budget_bytes=4 * GIB)
    calculator.follows_loaded = False
    calculator.show_loaded(loaded)
    assert calculator.config == loaded and calculator.follows_loaded
    text = calculator.results.text()
    assert "Per token <b>11.6 KiB</b>" in text  # 2 x 30 x 3 x (64 + 2) B = 11,880 B
    assert "(64 × 1 B + 2 B float16 scale)" in text
    # "From model": the widget asks, the shell answers (or says why not).
    calculator.source.setText("some/model")
    with qtbot.waitSignal(calculator.inspect_requested) as asked:
        calculator.from_model.click()
    assert asked.args == ["some/model", "int8"] and not calculator.from_model.isEnabled()
    calculator.show_error("Cannot read that model: no such folder")
    assert calculator.from_model.isEnabled() and "no such folder" in calculator.results.text()
    inspected = KVConfig(32, 8, 128, "float16", 131072, num_heads=32)
    calculator.show_inspected(inspected)
    assert calculator.config == inspected and not calculator.follows_loaded
    with qtbot.waitSignal(calculator.loaded_requested):
        calculator.from_loaded.click()
