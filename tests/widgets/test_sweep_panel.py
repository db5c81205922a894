"""Sweep view: the explanation follows the measured ratios, lengths are parsed with reasons, and the
panel asks for a sweep with its settings and draws the report it is handed (the real sweep of the
tiny model, run by the shell with progress and cancel: tests/app/test_app_sweep.py)."""

from __future__ import annotations

import html

import pytest

from widgets.sweep_panel import SweepPanel, SweepSettings, parse_lengths, progress_steps
from widgets.sweep_summary import bound_from_dtype_change, change, explain, explain_parts


def report(prefill_ratio: float, decode_ratio: float, byte_ratio: float = 0.5, device: str = "cpu") -> dict:
    """A compare_dtypes-shaped report: float32 rows, and bfloat16 rows at the given time ratios
    (new / baseline) moving `byte_ratio` of the bytes."""
    prompt, context = [], []
    for n, ttft in ((32, 0.02), (128, 0.08), (512, 0.32)):
        nbytes = 5.4e8 + n * 1e4
        prompt += [
            {"dtype": "float32", "prompt_tokens": n, "ttft_s": ttft, "bytes": nbytes},
            {
                "dtype": "bfloat16",
                "prompt_tokens": n,
                "ttft_s": ttft * prefill_ratio,
                "bytes": nbytes * byte_ratio,
            },
        ]
    for n, itl in ((128, 0.030), (1024, 0.036)):
        kv = n * 1.8e4
        per_token = 5.4e8 + kv
        context += [
            {"dtype": "float32", "context_tokens": n, "median_itl_s": itl, "bytes_per_token": per_token,
             "kv_read_bytes": kv},
            {"dtype": "bfloat16", "context_tokens": n, "median_itl_s": itl * decode_ratio,
             "bytes_per_token": per_token * byte_ratio, "kv_read_bytes": kv * byte_ratio},
        ]  # fmt: skip
    return {
        "model": "m",
        "device": device,
        "baseline_dtype": "float32",
        "prompt_lengths": prompt,
        "context_lengths": context,
    }


def test_cpu_bf16_story_prefill_compute_bound_decode_memory_bound():
    text = explain(report(prefill_ratio=2.9, decode_ratio=1 / 1.7))
    assert text.startswith(
        "bfloat16 against float32: prefill 2.9x slower (512-token prompt), decode 1.7x faster (128 tokens "
        "of context), with 2.0x fewer bytes per step: prefill is compute-bound, decode memory-bound on this CPU."
    )
    # The scaling sentences, per dtype: 16x the prompt took 16x the time.
    assert "In float32: TTFT 20.0 ms → 320 ms (16.0x) from 32 to 512 prompt tokens (16x the tokens; " in text
    assert "prefill computes every prompt token" in text
    assert "ITL 30.0 ms → 36.0 ms (1.20x) from 128 to 1024 tokens of context" in text
    assert "In bfloat16: TTFT 58.0 ms → 928 ms (16.0x)" in text


def test_both_phases_following_the_bytes_are_memory_bound():
    assert "both phases are memory-bound on this GPU" in explain(report(0.55, 0.52, device="cuda:0"))


def test_faster_than_the_bytes_explain_is_compute_bound():
    # 4x faster with half the bytes: faster arithmetic (tensor cores), not the bytes.
    assert bound_from_dtype_change(0.25, 0.5) == "compute-bound"
    assert bound_from_dtype_change(0.55, 0.5) == "memory-bound"
    assert bound_from_dtype_change(1.2, 0.5) == "compute-bound"
    assert bound_from_dtype_change(0.5, 1.0) is None  # same bytes: nothing to tell them apart
    # Half the bytes and the same time: neither memory nor arithmetic, per-step overhead.
    assert bound_from_dtype_change(1.02, 0.5) == "overhead-bound"
    assert change(1.04) == "about as fast" and change(0.5) == "2.0x faster" and change(3.0) == "3.0x slower"


def test_a_small_model_on_a_fast_gpu_is_overhead_bound_in_decode():
    text = explain(report(0.2, 0.98, device="cuda:0"))
    assert "prefill is compute-bound, decode overhead-bound on this GPU." in text
    assert "fixed per-step costs such as kernel launches and Python" in text


def test_same_sized_dtypes_are_put_down_to_arithmetic():
    text = explain(report(1.5, 1.0, byte_ratio=1.0))
    assert "moving about the same bytes: the difference is the speed of their arithmetic" in text


def test_lengths_are_parsed_with_reasons():
    assert parse_lengths(" 512, 32,128 ,32", "prompt lengths") == [32, 128, 512]
    with pytest.raises(ValueError, match="whole numbers"):
        parse_lengths("32, many", "prompt lengths")
    with pytest.raises(ValueError, match="at least one length"):
        parse_lengths("0", "context lengths")
    assert progress_steps(dtypes=2, prompts=3, contexts=3, repeats=2) == 2 + 2 * 2 * 6


@pytest.fixture
def panel(qtbot):
    widget = SweepPanel()
    qtbot.addWidget(widget)
    return widget


def test_no_model_no_run_and_bad_input_says_why(panel, qtbot):
    assert not panel.run_button.isEnabled()
    panel.set_model("default", "cpu")
    panel.prompt_lengths.setText("eight")
    with qtbot.assertNotEmitted(panel.run_requested):
        panel.run()
    assert "whole numbers" in panel.status.text() and not panel.running
    for box in panel.dtype_boxes.values():
        box.setChecked(False)
    panel.prompt_lengths.setText("8")
    with qtbot.assertNotEmitted(panel.run_requested):
        panel.run()
    assert "choose at least one dtype" in panel.status.text()


def test_the_panel_asks_then_draws_the_report_it_is_handed(panel, qtbot):
    panel.set_model("some/model", "cpu", "tiny")
    panel.prompt_lengths.setText("512, 32,128")
    panel.context_lengths.setText("1024,128")
    with qtbot.waitSignal(panel.run_requested) as asked:
        panel.run_button.click()
    settings = asked.args[0]
    assert settings == SweepSettings(("float32", "bfloat16"), 8, 2, (32, 128, 512), (128, 1024))
    assert panel.running and panel.cancel_button.isEnabled() and not panel.run_button.isEnabled()
    assert panel.progress.maximum() == settings.progress_steps == progress_steps(2, 3, 2, 2)
    panel.show_progress("loading float32")
    assert panel.progress.value() == 1 and "loading float32" in panel.status.text()
    with qtbot.waitSignal(panel.cancel_requested):
        panel.cancel_button.click()
    measured = report(prefill_ratio=2.9, decode_ratio=1 / 1.7)
    panel.show_report(measured, "The machine was busy")
    assert not panel.running and panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()
    assert "Measured m on cpu. The machine was busy" in panel.status.text()
    for dtype in ("float32", "bfloat16"):
        x, y = panel.curve("ttft", dtype)
        assert x == [32, 128, 512]
        assert y == [1000 * r["ttft_s"] for r in measured["prompt_lengths"] if r["dtype"] == dtype]
        assert panel.curve("itl", dtype)[0] == [128, 1024]
    comparisons, scaling = explain_parts(measured)
    assert f"<b>{html.escape(comparisons[0])}</b>" in panel.explanation.text()
    assert all(html.escape(line) in panel.explanation.text() for line in scaling)
    panel.run()
    panel.show_failed("float16 is not offered on the CPU")
    assert "The sweep failed: float16 is not offered on the CPU" in panel.status.text() and not panel.running
    panel.run()
    panel.show_cancelled()
    assert "Sweep cancelled." in panel.status.text() and panel.run_button.isEnabled()


def test_growth_beyond_what_the_bytes_or_tokens_explain_is_called_out():
    r = report(1.0, 1.0)
    for row in r["context_lengths"]:
        if row["dtype"] == "bfloat16" and row["context_tokens"] == 1024:
            row["median_itl_s"] *= 3  # a slow attention path at long context
    for row in r["prompt_lengths"]:
        if row["dtype"] == "bfloat16":
            row["ttft_s"] = 0.05  # flat: overhead, not the tokens
    text = explain(r)
    assert "In bfloat16: TTFT 50.0 ms → 50.0 ms (1.0x)" in text
    assert "far less: fixed per-step costs still dominate prefill at these lengths" in text
    assert "more than its 1.03x bytes explain: attention over the long context costs beyond its reads" in text
