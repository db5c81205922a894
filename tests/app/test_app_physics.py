"""The physics views in the window: docked and reachable from the Physics menu; the roofline fed by
the real engine's steps as the engine counted them; its device limits measured on the engine
thread and read back from their cache; the calculator following the loaded model (memory asked
of the engine) and reading other models' configs on a worker; the sweep pointed at its source;
and no worker left after close."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from app_windows import REPLY_TIMEOUT_MS

from app.physics.limits import roof_of
from app.physics.sweep import sweep_device
from engine.config import SamplingParams
from engine.events import StepStats
from engine.measure import device_limits
from engine.measure.memory import AVAILABLE_MEMORY_ENV
from engine.model.kv_storage import PagedKVStorage
from engine.units import GIB

# The engine tests' hand-written model folders (tests/engine is on the path only when its tests run).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from model_folders import LLAMA_8B_CONFIG, write_config  # noqa: E402

JOB_TIMEOUT_MS = 60_000


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    """Device limits neither read from nor written to the user's cache."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def small_measurement(monkeypatch):
    """Small matmuls and copies: the wiring is under test, not the figures."""
    monkeypatch.setattr(device_limits, "MATMUL_SIZES", (32, 64))
    monkeypatch.setattr(device_limits, "BANDWIDTH_BYTES", 2**20)


def test_physics_docks_and_menu(make_window):
    window = make_window(start=False)
    for key in ("roofline", "kv_calculator", "sweep"):
        assert key in window.docks
    menus = {a.text(): a.menu() for a in window.menuBar().actions()}
    physics = [a.text() for a in menus["&Physics"].actions() if a.text()]
    assert physics == ["&Roofline", "&KV memory calculator", "Latency &sweeps", "&Measure device limits"]
    window.docks["sweep"].hide()
    menus["&Physics"].actions()[2].trigger()
    assert window.docks["sweep"].isVisible()
    # Before a model: nothing to sweep or measure.
    assert not window.physics.sweep.run_button.isEnabled()
    assert not window.panels.roofline.measure_button.isEnabled()


def test_roofline_follows_a_chat_reply_as_the_engine_counted_it(make_window, qtbot, tiny_loaded):
    window = make_window()
    roofline = window.panels.roofline
    assert roofline.measure_button.isEnabled()
    # A short greedy reply: the random tiny model would otherwise talk to max_new_tokens.
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        window.controller.send("Say hello.")
    window.host.render_tick()
    steps = [s for s in window.host.live.steps if isinstance(s, StepStats)]
    assert steps
    # The calculator shows the loaded model; the sweep will load the same source.
    info = tiny_loaded.info
    calculator = window.physics.kv_calculator
    qtbot.waitUntil(lambda: calculator.config.weight_bytes > 0)  # the memory answer arrived
    c = calculator.config
    assert c.weight_bytes == pytest.approx(info.weight_bytes, abs=GIB / 1000)  # a 3-decimal GiB field
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.dtype) == (
        info.num_layers,
        info.num_kv_heads,
        info.head_dim,
        info.dtype,
    )
    assert window.physics.sweep.source == info.source
    assert window.physics.sweep.device == sweep_device(info.device) == "cpu"
    assert all(s.cost is not None for s in steps)  # the engine prices every step it runs
    roofline.refresh({"roofline"})
    assert [p.step for p in roofline.points] == [s.step for s in steps]
    for point, stats in zip(roofline.points, steps):
        assert (point.flops, point.bytes) == (stats.cost.flops, stats.cost.bytes_total)
        assert point.logit_rows == stats.logit_rows and point.forward_s == stats.forward_s
    assert sum(p.logit_rows for p in roofline.points) == 12  # one row per generated token
    assert len(roofline.phase_points("decode")) == 11  # the first token comes from the prefill


def test_limits_are_measured_on_the_engine_thread_and_read_back_from_the_cache(
    make_window, qtbot, small_measurement, monkeypatch, tiny_loaded
):
    window = make_window()
    panel, limits = window.panels.roofline, window.physics.limits
    measured_on = []
    original = device_limits.load_or_measure

    def spy(*args, **kwargs):
        measured_on.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(device_limits, "load_or_measure", spy)
    panel.measure_button.click()
    assert not panel.measure_button.isEnabled()  # measuring
    qtbot.waitUntil(lambda: panel.limits is not None, timeout=JOB_TIMEOUT_MS)
    assert measured_on == ["kvscope-engine"]
    measured = limits.limits
    assert measured.device == "cpu" and measured.dtype == "float32"
    assert panel.limits == roof_of(measured)  # what the panel draws is the measurement's
    assert (panel.limits.peak_flops, panel.limits.bandwidth) == (measured.peak_flops, measured.bandwidth)
    assert f"{measured.device_name} float32" in panel.device_label.text() and panel.measure_button.isEnabled()
    assert f"with {measured.threads} threads" in panel.device_label.toolTip()
    assert device_limits.cache_path(device_limits.resolve_device("cpu"), "float32").exists()

    # Forgotten (as by a model on another device), they come back from the cache at the next load.
    limits.limits = None
    panel.set_limits(None)
    with qtbot.waitSignal(window.host.model_loaded, timeout=JOB_TIMEOUT_MS):
        window.start_engine(window.host.config, loaded=tiny_loaded)
    qtbot.waitUntil(lambda: panel.limits is not None, timeout=JOB_TIMEOUT_MS)
    assert limits.limits == measured and panel.limits == roof_of(measured) and len(measured_on) == 2


def test_a_failed_measurement_says_why(make_window, qtbot, monkeypatch):
    window = make_window()
    panel = window.panels.roofline

    def refuse(*_args, **_kwargs):
        raise device_limits.ConfigError("dtype must be one of float32, bfloat16, float16, got 'int8'")

    monkeypatch.setattr(device_limits, "load_or_measure", refuse)
    panel.measure_button.click()
    qtbot.waitUntil(lambda: "Measuring failed" in panel.device_label.text(), timeout=JOB_TIMEOUT_MS)
    assert "dtype must be one of" in panel.device_label.text() and panel.measure_button.isEnabled()


def test_calculator_counts_the_int8_pool_as_the_engine_sizes_it(make_window, qtbot, tiny_loaded, test_config):
    """With an int8 KV cache the loaded model's per-token bytes include the float16 scales: the
    figure the engine's own pool divides its budget by."""
    from dataclasses import replace

    window = make_window(start=False)
    with qtbot.waitSignal(window.host.model_loaded, timeout=JOB_TIMEOUT_MS):
        window.start_engine(replace(test_config, kv_dtype="int8"), loaded=tiny_loaded)
    calculator = window.physics.kv_calculator
    qtbot.waitUntil(lambda: calculator.config is not None and calculator.config.dtype == "int8")
    info = tiny_loaded.info
    block = PagedKVStorage.block_bytes(
        info.num_layers, 16, info.num_kv_heads, info.head_dim, tiny_loaded.dtype, "int8"
    )
    assert calculator.config.bytes_per_token * 16 == block
    assert "float16 scale" in calculator.results.text()


def test_calculator_from_model_reads_a_config_off_the_gui_thread(make_window, qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(64 * GIB))
    window = make_window(start=False)
    calculator = window.physics.kv_calculator
    folder = write_config(tmp_path / "llama8b", LLAMA_8B_CONFIG)
    calculator.dtype.setCurrentText("float16")
    calculator.source.setText(str(folder))
    calculator.from_model.click()
    assert not calculator.from_model.isEnabled() and "Reading the config" in calculator.results.text()
    qtbot.waitUntil(lambda: calculator.from_model.isEnabled(), timeout=JOB_TIMEOUT_MS)
    c = calculator.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.context, c.dtype) == (32, 8, 128, 131072, "float16")
    assert c.budget_bytes == 64 * GIB and not calculator.follows_loaded
    assert "<b>16.0 GiB</b>" in calculator.results.text()


def test_calculator_from_a_bad_source_says_why(make_window, qtbot, tmp_path):
    window = make_window(start=False)
    calculator = window.physics.kv_calculator
    calculator.source.setText(str(tmp_path / "missing"))
    calculator.from_model.click()
    qtbot.waitUntil(lambda: calculator.from_model.isEnabled(), timeout=JOB_TIMEOUT_MS)
    assert "Cannot read that model" in calculator.results.text()


def test_calculator_loaded_model_button_before_any_model(make_window):
    window = make_window(start=False)
    calculator = window.physics.kv_calculator
    calculator.from_loaded.click()
    assert "No model is loaded yet." in calculator.results.text()


def test_closing_leaves_no_physics_worker(make_window, qtbot):
    window = make_window()
    window.physics.kv_calculator.source.setText("no/such/model/folder")
    window.physics.kv_calculator.from_model.click()
    window.close()
    physics = ("kvscope-engine", "kvscope-kv-calculator", "kvscope-sweep")  # (the picker: conftest)
    left = [t.name for t in threading.enumerate() if t.name in physics and t.is_alive()]
    assert not left


def test_a_pools_kv_dtype_is_read_from_its_size():
    """Attached to a remote engine there is no local config: the pool's own bytes per token tell
    whether it stores int8 (with its scales) or the model's dtype."""
    from hand_events import model_info

    from app.physics.calculator import pool_kv_dtype
    from engine.events import ModelLoaded
    from engine.shapes import kv_bytes_per_token

    info = model_info(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    for kv_dtype in ("auto", "int8"):
        per_token = kv_bytes_per_token(2, 2, 16, "float32", kv_dtype)
        assert pool_kv_dtype(ModelLoaded(info, 10, 16, 10 * 16 * per_token)) == kv_dtype
