"""The physics views in the window: docked and reachable from the Physics menu, the roofline fed
by the real engine's steps with the loaded model's shapes, the calculator following the loaded
model, the sweep pointed at its source, and no worker left after close."""

from __future__ import annotations

import threading

import pytest
from app_windows import REPLY_TIMEOUT_MS

from app.physics_views import loaded_model_shapes, sweep_device
from engine.config import SamplingParams
from engine.model.shapes import ModelShapes

PHYSICS_THREADS = ("kvscope-measure", "kvscope-sweep", "kvscope-kv-calculator")


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    """Device limits neither read from nor written to the user's cache."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))


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


def test_roofline_follows_a_chat_reply(make_window, qtbot, tiny_loaded):
    window = make_window()
    assert loaded_model_shapes(window.host) == ModelShapes.from_config(tiny_loaded.model.config)
    roofline = window.panels.roofline
    assert roofline.costs is not None and roofline.measure_button.isEnabled()
    # A short greedy reply: the random tiny model would otherwise talk to max_new_tokens.
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        window.controller.send("Say hello.")
    window.host.render_tick()
    roofline.flush()
    steps = [stats for stats, _ in window.host.live.step_logit_rows]
    assert steps and len(roofline.points) == len(steps)
    assert [p.step for p in roofline.points] == [s.step for s in steps]
    assert len(roofline.phase_points("decode")) == 11  # the first token comes from the prefill
    # The calculator shows the loaded model; the sweep will load the same source.
    info = tiny_loaded.info
    c = window.physics.kv_calculator.config
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (info.num_layers, info.num_kv_heads, info.head_dim)
    assert window.physics.sweep.source == info.source
    assert window.physics.sweep.device == sweep_device(info.device) == "cpu"


def test_closing_leaves_no_physics_worker(make_window, qtbot):
    window = make_window()
    window.physics.kv_calculator.source.setText("no/such/model/folder")
    window.physics.kv_calculator.from_model.click()
    window.close()
    left = [t.name for t in threading.enumerate() if t.name in PHYSICS_THREADS and t.is_alive()]
    assert not left
