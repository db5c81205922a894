"""Roofline panel: each step placed at the intensity and FLOP/s of the cost the engine computed for
it, on the expected side of the ridge for given limits; MFU/MBU with their formula in the
tooltip; a step without a cost is not placed; the panel asks for a measurement and only draws."""

from __future__ import annotations

import pytest
from hand_events import model_info

from engine.events import KVStats, ModelLoaded, StepStats
from engine.measure.roofline import step_cost
from engine.shapes import ModelShapes
from engine.units import mbu, mfu
from live.state import LiveState
from widgets.roofline_panel import Roof, RooflinePanel

# A SmolLM2-135M-shaped config: 30 layers of hidden 576 and MLP 1536, 9 query heads over 3 KV
# heads of 64, a 49,152-token vocabulary, 8k context, the embedding tied to the LM head.
SHAPES = ModelShapes("LlamaForCausalLM", 30, 576, 1536, 9, 3, 64, 49152, 8192, True)
BLOCK_SIZE = 16
KV_ELEMS_PER_TOKEN = 2 * 30 * 3 * 64
# Given limits: 73 GFLOP/s and 17 GB/s, a ridge at 4.3 FLOP/B (this machine's CPU in float32).
LIMITS = Roof(73e9, 17e9, "Test CPU (2 threads) float32", "measured by hand for the test")


def loaded_event(shapes: ModelShapes = SHAPES, dtype: str = "float32") -> ModelLoaded:
    info = model_info(
        dtype=dtype,
        num_layers=shapes.num_layers,
        num_heads=shapes.num_heads,
        num_kv_heads=shapes.num_kv_heads,
        head_dim=shapes.head_dim,
        hidden_size=shapes.hidden_size,
        vocab_size=shapes.vocab_size,
        params=shapes.params,
        weight_bytes=shapes.weight_bytes(dtype),
        kv_bytes_per_token=shapes.kv_bytes_per_token(dtype),
    )
    return ModelLoaded(info, 64, BLOCK_SIZE, 64 * BLOCK_SIZE * shapes.kv_bytes_per_token(dtype), t=0.0)


def kv_stats(elem_bytes: int = 4) -> KVStats:
    per_block = BLOCK_SIZE * KV_ELEMS_PER_TOKEN * elem_bytes
    return KVStats(64, BLOCK_SIZE, 1, 0, 63, 1, per_block, 64 * per_block)


def step(
    n: int,
    shapes: tuple[tuple[int, int], ...],
    forward_s: float,
    prefill: int,
    decode: int,
    rows: int | None = None,
    priced: bool = True,
) -> StepStats:
    """A step as the engine reports it: its LM-head rows (one per sequence unless given) and the
    cost the engine computed for what it ran (here: step_cost over the same shapes)."""
    rows = len(shapes) if rows is None else rows
    cost = step_cost(SHAPES, shapes, 4, 4, logit_rows=rows) if priced else None
    return StepStats(
        step=n,
        prefill_tokens=prefill,
        decode_tokens=decode,
        num_seqs=len(shapes),
        running=len(shapes),
        waiting=0,
        duration_s=forward_s * 1.1,
        forward_s=forward_s,
        sample_s=forward_s * 0.1,
        kv=kv_stats(),
        seq_shapes=shapes,
        t=float(n),
        logit_rows=rows,
        kernel="fp32",
        cost=cost,
    )


@pytest.fixture
def panel(qtbot):
    state = LiveState()
    state.apply([loaded_event()])
    widget = RooflinePanel(state)
    qtbot.addWidget(widget)
    return widget


def feed(panel: RooflinePanel, events) -> None:
    panel.refresh(panel.state.apply(events))


def test_prefill_and_decode_land_at_step_cost_on_their_sides_of_the_ridge(panel):
    panel.set_limits(LIMITS)
    # A 128-token prompt prefilled and sampled in one step, then one decode step at context 129.
    feed(panel, [step(1, ((128, 128),), 0.2, 128, 0)])
    feed(panel, [step(2, ((1, 129),), 0.03, 0, 1)])

    prefill_cost = step_cost(SHAPES, [(128, 128)], 4, 4, logit_rows=1)
    decode_cost = step_cost(SHAPES, [(1, 129)], 4, 4, logit_rows=1)
    (px,), (py,) = panel.plotted("prefill")
    (dx,), (dy,) = panel.plotted("decode")
    assert px == pytest.approx(prefill_cost.intensity, rel=1e-9)
    assert py == pytest.approx(prefill_cost.flops / 0.2, rel=1e-9)
    assert dx == pytest.approx(decode_cost.intensity, rel=1e-9)
    assert dy == pytest.approx(decode_cost.flops / 0.03, rel=1e-9)
    assert dx < LIMITS.ridge < px  # decode memory-bound, prefill compute-bound
    # The roof: the bandwidth slope up to the ridge, flat at the peak after it.
    rx, ry = panel.roof.getData()
    assert 10 ** rx[1] == pytest.approx(LIMITS.ridge) and 10 ** ry[1] == pytest.approx(LIMITS.peak_flops)
    assert 10 ** ry[0] == pytest.approx(10 ** rx[0] * LIMITS.bandwidth)
    assert "Test CPU (2 threads)" in panel.device_label.text()


def test_points_are_the_engines_counts_whatever_the_tokens(panel):
    """The rows and cost are the engine's: a prefill chunk that samples nothing (0 rows) and a
    speculative round (1 + 4 drafts = 5 rows for one sequence) are placed as the engine counted
    them; the point's tooltip names the rows and the engine's terms."""
    feed(panel, [step(1, ((64, 64),), 0.1, 64, 0, rows=0)])
    feed(panel, [step(2, ((5, 69),), 0.04, 0, 5, rows=5)])
    (x,), _ = panel.plotted("prefill")
    assert x == pytest.approx(step_cost(SHAPES, [(64, 64)], 4, 4, logit_rows=0).intensity)
    assert x != pytest.approx(step_cost(SHAPES, [(64, 64)], 4, 4, logit_rows=1).intensity)
    spec = panel.points[-1]
    assert spec.logit_rows == 5 and spec.flops == step_cost(SHAPES, [(5, 69)], 4, 4, logit_rows=5).flops
    tip = panel._point_tip(0.0, 0.0, spec)
    assert "5 LM-head rows, fp32 kernels" in tip and "flops_lm_head" in tip


def test_a_step_without_an_engine_cost_is_not_placed(panel):
    feed(panel, [step(1, ((1, 100),), 0.03, 0, 1, priced=False)])
    assert panel.points == [] and sum(len(panel.plotted(p)[0]) for p in ("prefill", "decode", "mixed")) == 0
    assert "carry no FLOP and byte counts" in panel.device_label.text()


def test_batch_size_and_chunk_size_move_the_points_right(panel):
    feed(panel, [step(1, ((1, 100),), 0.03, 0, 1)])
    feed(panel, [step(2, tuple((1, 100) for _ in range(4)), 0.04, 0, 4)])
    feed(panel, [step(3, ((32, 32),), 0.05, 32, 0)])
    feed(panel, [step(4, ((128, 128),), 0.2, 128, 0)])
    decode_x, _ = panel.plotted("decode")
    prefill_x, _ = panel.plotted("prefill")
    assert decode_x[1] > 3 * decode_x[0]  # four sequences share one read of the weights
    assert prefill_x[1] > 3 * prefill_x[0]  # a 4x longer chunk reuses each weight 4x as often


def test_mixed_steps_are_their_own_colour(panel):
    feed(panel, [step(1, ((16, 16), (1, 40)), 0.05, 16, 1, rows=1)])
    assert len(panel.plotted("mixed")[0]) == 1
    assert len(panel.plotted("prefill")[0]) == len(panel.plotted("decode")[0]) == 0


def test_mfu_and_mbu_with_their_formula_in_the_tooltip(panel):
    feed(panel, [step(1, ((128, 128),), 0.2, 128, 0)])
    feed(panel, [step(2, ((1, 129),), 0.05, 0, 1), step(3, ((1, 130),), 0.04, 0, 1)])
    label = panel.utilisation["decode"]
    assert "MFU <b>" not in label.text()  # no limits measured yet: no utilisation to show
    panel.set_limits(LIMITS)

    costs = [step_cost(SHAPES, [(1, c)], 4, 4, logit_rows=1) for c in (129, 130)]
    flops, nbytes = sum(c.flops for c in costs), sum(c.bytes_total for c in costs)
    expected_mfu = mfu(flops, 0.09, LIMITS.peak_flops)
    expected_mbu = mbu(nbytes, 0.09, LIMITS.bandwidth)
    assert f"MFU <b>{expected_mfu.value:.1%}</b>" in label.text()
    assert f"MBU <b>{expected_mbu.value:.1%}</b>" in label.text()
    assert expected_mfu.how in label.toolTip() and expected_mbu.how in label.toolTip()
    assert "the last 2:" in label.toolTip()
    # Decode moves bytes, not FLOPs: its MBU is far above its MFU on any sane device.
    assert expected_mbu.value > 5 * expected_mfu.value


def test_the_panel_asks_for_a_measurement_and_shows_its_state(panel, qtbot):
    with qtbot.waitSignal(panel.measure_requested):
        panel.measure_button.click()
    panel.set_measuring(True)
    assert not panel.measure_button.isEnabled() and "Measuring cpu in float32" in panel.device_label.text()
    panel.set_limits_error("dtype must be one of float32, bfloat16, float16")
    assert (
        panel.measure_button.isEnabled()
        and "Measuring failed: dtype must be one of" in panel.device_label.text()
    )
    panel.set_limits(LIMITS)
    assert (
        panel.measure_button.text() == "Re-measure limits"
        and "Measuring failed" not in panel.device_label.text()
    )


def test_a_new_model_starts_its_points_afresh(panel):
    feed(panel, [step(1, ((1, 100),), 0.03, 0, 1), step(2, ((1, 101),), 0.03, 0, 1)])
    assert len(panel.points) == 2
    feed(panel, [loaded_event()])
    assert panel.points == [] and len(panel.plotted("decode")[0]) == 0
