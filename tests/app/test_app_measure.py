"""The measure command produces both figures (their values are for the benchmark, not tests)."""

from __future__ import annotations

import math

from app_windows import TEST_NUM_BLOCKS

import tools.measure_app as measure_app
from engine.config import EngineConfig
from tools.measure_app import TARGET_THROUGHPUT_RATIO, TARGET_WORST_DELAY_MS, run_measurement


def test_measurement_reports_probe_delay_and_throughput_ratio(qtbot, tiny_loaded, monkeypatch):
    order: list[str] = []
    for name, side in (("headless_run", "headless"), ("app_run", "app")):
        real = getattr(measure_app, name)
        monkeypatch.setattr(
            measure_app, name, lambda *a, real=real, side=side: order.append(side) or real(*a)
        )
    result = run_measurement(
        tiny_loaded, prompt="Hi", max_new_tokens=8, repeats=2, config=EngineConfig(num_blocks=TEST_NUM_BLOCKS)
    )
    assert result["generated_tokens"] == 8 and result["repeats"] == 2
    assert len(result["headless_runs"]) == 2 and len(result["app_runs"]) == 2
    assert len(result["pair_ratios"]) == 2
    # the pairs' order alternates, so a drift within the measurement favours neither side
    assert order == ["headless", "headless", "app", "app", "headless"]  # the warm-up first
    for key in ("headless_tokens_per_s", "app_tokens_per_s", "throughput_ratio", "probe_worst_delay_ms"):
        assert math.isfinite(result[key]) and result[key] >= 0
    assert result["headless_tokens_per_s"] > 0 and result["app_tokens_per_s"] > 0
    assert result["throughput_ratio"] == result["app_tokens_per_s"] / result["headless_tokens_per_s"]
    assert result["probe_samples"] > 0
    assert result["probe_p99_delay_ms"] <= result["probe_worst_delay_ms"]
    assert result["targets"] == {
        "probe_worst_delay_ms": TARGET_WORST_DELAY_MS,
        "throughput_ratio": TARGET_THROUGHPUT_RATIO,
    }
    expected = (
        result["probe_worst_delay_ms"] < TARGET_WORST_DELAY_MS
        and result["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO
    )
    assert result["meets_targets"] == expected
