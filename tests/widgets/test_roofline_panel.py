"""Roofline panel: steps placed at step_cost's intensity and FLOP/s, on the expected side of the
ridge for given limits; MFU/MBU with their formula in the tooltip; measuring the limits on a
worker thread; live points from the real engine running the tiny model."""

from __future__ import annotations

import pytest
from widget_events import model_info

from engine.config import EngineConfig
from engine.core.service import Engine
from engine.events import KVStats, ModelLoaded, StepStats, TokenGenerated
from engine.measure import device_limits
from engine.measure.device_limits import DeviceLimits
from engine.measure.roofline import mbu, mfu, step_cost
from engine.model.shapes import ModelShapes
from engine.request import Request
from live.state import LiveState
from widgets.roofline_panel import RooflinePanel

# A SmolLM2-135M-shaped config (30 layers, 9 query heads over 3 KV heads of 64, tied embedding).
SHAPES = ModelShapes(
    architecture="LlamaForCausalLM",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
BLOCK_SIZE = 16
KV_ELEMS_PER_TOKEN = 2 * 30 * 3 * 64
# Given limits: 73 GFLOP/s and 17 GB/s, a ridge at 4.3 FLOP/B (this machine's CPU in float32).
LIMITS = DeviceLimits(
    device="cpu",
    device_name="Test CPU (2 threads)",
    dtype="float32",
    peak_flops=73e9,
    matmul_size=2048,
    bandwidth=17e9,
    threads=2,
    measured_at="2026-01-01T00:00:00+00:00",
    measure_seconds=10.0,
)


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
    n: int, shapes: tuple[tuple[int, int], ...], forward_s: float, prefill: int, decode: int
) -> StepStats:
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
    )


def token(request_id: int, index: int) -> TokenGenerated:
    return TokenGenerated(request_id, index, 5, "a", "a", -0.5, t=0.0)


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    """No test reads or writes the user's cached device limits."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def panel(qtbot):
    state = LiveState()
    state.apply([loaded_event()])
    widget = RooflinePanel(state)
    qtbot.addWidget(widget)
    widget.set_model_shapes(SHAPES)
    yield widget
    assert widget.shutdown(30)


def feed(panel: RooflinePanel, events) -> None:
    panel.refresh(panel.state.apply(events))
    panel.flush()


def test_prefill_and_decode_land_at_step_cost_on_their_sides_of_the_ridge(panel):
    panel.set_limits(LIMITS)
    # A 128-token prompt prefilled and sampled in one step, then one decode step at context 129.
    feed(panel, [token(1, 0), step(1, ((128, 128),), 0.2, 128, 0)])
    feed(panel, [token(1, 1), step(2, ((1, 129),), 0.03, 0, 1)])

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


def test_a_prefill_chunk_that_samples_nothing_has_no_lm_head(panel):
    """Logit rows come from the tokens the step sampled: none for an unfinished prompt chunk."""
    feed(panel, [step(1, ((64, 64),), 0.1, 64, 0)])
    (x,), _ = panel.plotted("prefill")
    assert x == pytest.approx(step_cost(SHAPES, [(64, 64)], 4, 4, logit_rows=0).intensity)
    assert x != pytest.approx(step_cost(SHAPES, [(64, 64)], 4, 4, logit_rows=1).intensity)


def test_batch_size_and_chunk_size_move_the_points_right(panel):
    feed(panel, [token(1, 5), step(1, ((1, 100),), 0.03, 0, 1)])
    feed(panel, [*(token(r, 5) for r in range(4)), step(2, tuple((1, 100) for _ in range(4)), 0.04, 0, 4)])
    feed(panel, [step(3, ((32, 32),), 0.05, 32, 0)])
    feed(panel, [step(4, ((128, 128),), 0.2, 128, 0)])
    decode_x, _ = panel.plotted("decode")
    prefill_x, _ = panel.plotted("prefill")
    assert decode_x[1] > 3 * decode_x[0]  # four sequences share one read of the weights
    assert prefill_x[1] > 3 * prefill_x[0]  # a 4x longer chunk reuses each weight 4x as often


def test_mixed_steps_are_their_own_colour(panel):
    feed(panel, [token(2, 3), step(1, ((16, 16), (1, 40)), 0.05, 16, 1)])
    assert len(panel.plotted("mixed")[0]) == 1
    assert len(panel.plotted("prefill")[0]) == len(panel.plotted("decode")[0]) == 0


def test_mfu_and_mbu_with_their_formula_in_the_tooltip(panel):
    feed(panel, [token(1, 0), step(1, ((128, 128),), 0.2, 128, 0)])
    feed(
        panel, [token(1, 1), step(2, ((1, 129),), 0.05, 0, 1), token(1, 2), step(3, ((1, 130),), 0.04, 0, 1)]
    )
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


def test_measuring_runs_off_the_gui_thread_and_is_cached(panel, qtbot, monkeypatch):
    """The button measures the loaded model's device in its dtype (small matmuls here: the
    wiring is under test, not the figures) and a later load reads the cached result."""
    monkeypatch.setattr(device_limits, "MATMUL_SIZES", (32, 64))
    monkeypatch.setattr(device_limits, "BANDWIDTH_BYTES", 2**20)
    with qtbot.waitSignal(panel.job.succeeded, timeout=60_000):
        panel.measure_button.click()
    limits = panel.limits
    assert limits is not None and limits.device == "cpu" and limits.dtype == "float32"
    assert limits.device_name in panel.device_label.text()
    assert device_limits.cache_path(device_limits.resolve_device("cpu"), "float32").exists()

    panel.set_limits(None)
    with qtbot.waitSignal(panel.job.succeeded, timeout=60_000):
        panel.set_model_shapes(SHAPES)  # a model loaded again: its limits come from the cache
    assert panel.limits == limits


def test_a_failed_measurement_says_why(panel, qtbot, monkeypatch):
    panel.state.apply([loaded_event(dtype="int8")])  # no matmul dtype: device_limits refuses it
    with qtbot.waitSignal(panel.job.failed, timeout=30_000):
        panel.measure_button.click()
    assert "dtype must be one of" in panel.device_label.text()


def test_points_from_the_real_engine_running_the_tiny_model(tiny_loaded, qtbot):
    state = LiveState()
    panel = RooflinePanel(state)
    qtbot.addWidget(panel)
    events = []

    def sink(event):
        events.append(event)

    engine = Engine(
        EngineConfig(block_size=4, num_blocks=128, max_model_len=512), sink=sink, loaded=tiny_loaded
    )
    engine.start()
    try:
        assert engine.wait_until_loaded(60) is not None, engine.load_error
        panel.refresh(state.apply(list(events)))
        panel.set_model_shapes(ModelShapes.from_config(tiny_loaded.model.config))
        seen = len(events)
        params = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        ids = [engine.submit(Request.chat(f"Count to {n}.", **params)) for n in (3, 5)]

        def done() -> bool:
            nonlocal seen
            batch = events[seen:]
            seen += len(batch)
            panel.refresh(state.apply(batch))
            return all(state.requests.get(i) is not None and state.requests[i].done for i in ids)

        qtbot.waitUntil(done, timeout=120_000)
    finally:
        engine.shutdown(30)
    panel.flush()
    steps = [e for e in events if isinstance(e, StepStats)]
    shown = sum(len(panel.plotted(phase)[0]) for phase in ("prefill", "decode", "mixed"))
    assert shown == len(steps) == len(panel.points)
    assert len(panel.plotted("decode")[0]) >= 1
    assert len(panel.plotted("prefill")[0]) + len(panel.plotted("mixed")[0]) >= 1
    # Every point is step_cost of its step over its forward time.
    shapes = ModelShapes.from_config(tiny_loaded.model.config)
    per_param = tiny_loaded.info.weight_bytes / tiny_loaded.info.params
    for point, stats in zip(panel.points, steps):
        assert point.step == stats.step
        cost = step_cost(shapes, stats.seq_shapes, per_param, 4, point.logit_rows)
        assert point.intensity == pytest.approx(cost.intensity)
        assert point.flops_per_s == pytest.approx(cost.flops / stats.forward_s)
    assert sum(p.logit_rows for p in panel.points) == 12  # one row per generated token
