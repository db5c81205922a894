"""The memory graph grows one point per MemorySample, in a binary unit, each series sourced."""

from __future__ import annotations

import numpy as np
import pytest

from engine.events import MemorySample
from live.state import LiveState
from widgets.memory_panel import MemoryPanel

MIB = 1 << 20


def sample(i: int, process: int, reserved: int | None = None, source: str = "psutil RSS") -> MemorySample:
    reserved = process if reserved is None else reserved
    return MemorySample(
        540 * MIB, 180 * MIB, i * 4 * MIB, process, reserved, 24 << 30, source, t=100.0 + 0.25 * i
    )


@pytest.fixture
def panel(qtbot):
    panel = MemoryPanel(LiveState())
    qtbot.addWidget(panel)
    panel.resize(400, 300)
    return panel


def test_series_grow_with_samples(panel):
    state = panel.state
    panel.refresh(state.apply([sample(i, (900 + i) * MIB) for i in range(3)]))
    x, y = panel.series("process")
    assert x.tolist() == [0.0, 0.25, 0.5]
    assert y.tolist() == [900.0, 901.0, 902.0]  # MiB
    panel.refresh(state.apply([sample(i, (900 + i) * MIB) for i in range(3, 5)]))
    for key in ("weights", "kv_pool", "kv_used", "process"):
        assert len(panel.series(key)[0]) == 5
    assert panel.series("kv_used")[1].tolist() == [0, 4, 8, 12, 16]
    assert panel.series("weights")[1].tolist() == [540.0] * 5


def test_every_series_is_labelled_with_its_source_and_latest_value(panel):
    panel.refresh(panel.state.apply([sample(0, 900 * MIB)]))
    legend = panel.legend.text()
    for label in (
        "weights (tensor sizes)",
        "KV pool allocated",
        "KV in use (used blocks)",
        "process total (psutil RSS)",
    ):
        assert label in legend
    assert "900 MiB" in legend and "of 24.0 GiB total" in legend
    assert "reserved" not in legend  # on CPU the probe has no separate reserved figure
    assert len(panel.series("reserved")[0]) == 0


def test_cuda_reserved_is_drawn_when_it_differs(panel):
    samples = [sample(i, 3 << 30, 4 << 30, "torch.cuda counters") for i in range(2)]
    panel.refresh(panel.state.apply(samples))
    assert panel.unit == ("GiB", 1 << 30)
    assert panel.series("reserved")[1].tolist() == [4.0, 4.0]
    assert "reserved (torch.cuda counters)" in panel.legend.text()


def test_redraws_only_for_memory(panel):
    state = panel.state
    state.apply([sample(0, 900 * MIB)])
    panel.refresh({"kv", "tokens"})
    assert len(panel.series("process")[0]) == 0
    panel.refresh({"memory"})
    assert np.array_equal(panel.series("process")[1], [900.0])


def test_a_draft_models_weights_and_cache_are_drawn_while_there_is_one(panel):
    from dataclasses import replace

    plain = [sample(i, 900 * MIB) for i in range(2)]
    panel.refresh(panel.state.apply(plain))
    assert "draft" not in panel.legend.text()
    assert len(panel.series("draft_weights")[0]) == len(panel.series("draft_cache")[0]) == 0
    drafted = [
        replace(sample(i, 1000 * MIB), draft_weights_bytes=270 * MIB, draft_cache_bytes=(20 + i) * MIB)
        for i in range(2, 4)
    ]
    panel.refresh(panel.state.apply(drafted))
    assert panel.series("draft_weights")[1].tolist() == [0.0, 0.0, 270.0, 270.0]
    assert panel.series("draft_cache")[1].tolist() == [0.0, 0.0, 22.0, 23.0]
    legend = panel.legend.text()
    assert "draft model weights (tensor sizes)" in legend and "<b>270 MiB</b>" in legend
    assert "draft KV cache" in legend and "<b>23.0 MiB</b>" in legend


def test_a_self_draft_shows_only_its_cache(panel):
    from dataclasses import replace

    panel.refresh(panel.state.apply([replace(sample(0, 900 * MIB), draft_cache_bytes=12 * MIB)]))
    legend = panel.legend.text()
    assert "draft KV cache" in legend and "draft model weights" not in legend
