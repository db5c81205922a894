"""The sweep the shell runs for the sweep view (app.physics.sweep): a real per-dtype sweep of the
tiny model on a worker with progress, plot and cancel, a dtype the device refuses said in words,
and a busy machine pointed out."""

from __future__ import annotations

import html
import sys
from pathlib import Path

import pytest

from app.physics.sweep import SweepController, busy_machine_note
from widgets.sweep_panel import SweepPanel, progress_steps
from widgets.sweep_summary import explain_parts

# The engine tests' hand-written model folders (tests/engine is on the path only when its tests run).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

SWEEP_TIMEOUT_MS = 300_000


@pytest.fixture
def panel(qtbot):
    widget = SweepPanel()
    qtbot.addWidget(widget)
    controller = SweepController(widget, parent=widget)  # owned by the panel, as in the window
    widget.controller = controller
    yield widget
    assert controller.shutdown(120)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    from model_folders import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("sweep") / "tiny", default_tokenizer)


def configure(panel: SweepPanel, folder: Path) -> None:
    panel.set_model(str(folder), "cpu", "tiny")
    panel.prompt_lengths.setText("8,32")
    panel.context_lengths.setText("16,48")
    panel.decode_tokens.setValue(2)
    panel.repeats.setValue(1)


def test_a_busy_cpu_is_pointed_out():
    assert busy_machine_note("cpu", load=2.2, cores=2) == ""  # the sweep's own threads
    note = busy_machine_note("cpu", load=7.9, cores=2)
    assert "load average 7.9 on 2 cores" in note and "Run again when it is idle" in note
    assert busy_machine_note("cuda", load=7.9, cores=2) == ""


def test_real_sweep_of_the_tiny_model_in_two_dtypes(panel, qtbot, tiny_folder):
    configure(panel, tiny_folder)
    panel.run_button.click()
    worker = panel.controller.worker
    messages = []
    worker.progress.connect(messages.append)
    assert panel.cancel_button.isEnabled() and not panel.run_button.isEnabled()
    with qtbot.waitSignal(worker.returned, timeout=SWEEP_TIMEOUT_MS):
        pass
    assert panel.progress.value() == panel.progress.maximum()
    assert len(messages) == panel.progress.maximum() == progress_steps(2, 2, 2, 1)
    rows = panel.report["prompt_lengths"]
    for dtype in ("float32", "bfloat16"):
        x, y = panel.curve("ttft", dtype)
        assert x == [8, 32]
        assert y == [1000 * r["ttft_s"] for r in rows if r["dtype"] == dtype]
        assert panel.curve("itl", dtype)[0] == [16, 48]
    comparisons, scaling = explain_parts(panel.report)
    assert comparisons[0].startswith("bfloat16 against float32: prefill ")
    assert f"<b>{html.escape(comparisons[0])}</b>" in panel.explanation.text()
    assert all(html.escape(line) in panel.explanation.text() for line in scaling)
    assert panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()


def test_cancel_stops_the_sweep_between_runs(panel, qtbot, tiny_folder):
    configure(panel, tiny_folder)
    panel.repeats.setValue(3)
    panel.run_button.click()
    worker = panel.controller.worker
    worker.progress.connect(lambda _message: panel.cancel())
    with qtbot.waitSignal(worker.cancelled, timeout=SWEEP_TIMEOUT_MS):
        pass
    assert "cancelled" in panel.status.text()
    assert panel.report is None and panel.run_button.isEnabled()


def test_a_dtype_the_device_refuses_fails_with_the_loaders_reason(panel, qtbot, tiny_folder):
    configure(panel, tiny_folder)
    for dtype, box in panel.dtype_boxes.items():
        box.setChecked(dtype == "float16")
    panel.run_button.click()
    with qtbot.waitSignal(panel.controller.worker.errored, timeout=120_000):
        pass
    assert "The sweep failed" in panel.status.text() and "float16" in panel.status.text()
