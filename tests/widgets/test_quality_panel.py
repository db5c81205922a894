"""The quality panel draws a run's per-token KL and figures exactly; the probability panel's
reference overlay and the memory graph's quantized-weights series show what they are given."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hand_events import finished, model_loaded, snapshot, token

from app.quality.compute import QualityResult, SpeedFigures
from app.quality.jobs import CONVERSATION, QUALITY_SOURCES, QualityJob
from engine.bench.quality import compare_logits
from engine.config import ModelSpec
from engine.events import MemorySample, RequestStarted
from live.state import LiveState
from widgets.memory_panel import MemoryPanel
from widgets.probability_panel import ProbabilityPanel
from widgets.quality_panel import QualityPanel
from widgets.reference import ReferenceDistribution

MIB = 1 << 20
IDS = [5, 1, 4, 1, 5, 9, 2, 6]


def logits_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A reference and a copy perturbed enough to flip the top-1 token at two positions."""
    torch.manual_seed(0)
    reference = torch.randn(len(IDS), 10)
    quantized = reference + 0.05 * torch.randn(len(IDS), 10)
    for row in (2, 5):  # swap the two best tokens there
        best = reference[row].topk(2).indices
        quantized[row, best[0]], quantized[row, best[1]] = reference[row, best[1]], reference[row, best[0]]
    return reference, quantized


def result_with(report, reply_start=None, q_speed=None, r_speed=None) -> QualityResult:
    job = QualityJob(ModelSpec("test", quantization="int8-weight-only"), "int8", CONVERSATION)
    texts = tuple(f"t{i}" for i in IDS)
    return QualityResult(job, report, tuple(IDS), texts, reply_start, 0, {}, q_speed, r_speed, 1.5)


@pytest.fixture
def panel(qtbot):
    panel = QualityPanel(LiveState(), QUALITY_SOURCES)
    qtbot.addWidget(panel)
    panel.resize(700, 300)
    return panel


def test_the_plot_is_the_report_kl_along_the_text_with_disagreements_marked(panel):
    reference, quantized = logits_pair()
    report = compare_logits(reference, quantized, IDS)
    panel.show_result(result_with(report, reply_start=5))
    x, kl = panel.kl_series()
    assert x.tolist() == list(range(1, len(IDS)))  # position p: the prediction of token p
    assert kl.tolist() == list(report.kl)
    assert panel.kl_curve.yData.tolist() == list(report.kl)
    # the two swapped rows are exactly the marked ones
    assert list(report.top1_agree).count(False) == 2
    assert panel.disagree_points.xData.tolist() == [3.0, 6.0]
    assert panel.mean_line.value() == pytest.approx(report.mean_kl)
    assert panel.reply_region.isVisible()
    assert panel.reply_region.getRegion() == pytest.approx((4.5, len(IDS) - 0.5))
    text = panel.figures_text()
    assert f"{report.mean_kl:.4g}" in text
    assert f"{report.top1_agreement:.1%}" in text
    assert f"{report.quantized_perplexity:.2f}" in text and f"{report.reference_perplexity:.2f}" in text
    assert "int8-weight-only + KV int8" in text and "full precision (float32)" in text


def test_identical_distributions_read_as_zero_kl_and_full_agreement(panel):
    reference, _ = logits_pair()
    panel.show_result(result_with(compare_logits(reference, reference.clone(), IDS)))
    assert panel.kl_series()[1].tolist() == [0.0] * (len(IDS) - 1)
    assert panel.disagree_points.xData is None  # pyqtgraph's empty data
    assert "top-1 agreement <b>100.0%</b>" in panel.figures_text()
    assert not panel.reply_region.isVisible()


def test_hover_names_the_token_and_its_figures(panel):
    reference, quantized = logits_pair()
    report = compare_logits(reference, quantized, IDS)
    panel.show_result(result_with(report, reply_start=5))
    line = panel.describe_position(3)
    assert line.startswith("token 3 't1': KL")
    assert f"{report.kl[2]:.4g}" in line and "top-1 differs" in line
    assert "reply token" not in line
    assert panel.describe_position(6).endswith("reply token 1")
    assert panel.describe_position(0) == "" and panel.describe_position(len(IDS)) == ""


def test_a_slower_scheme_says_so(panel):
    reference, quantized = logits_pair()
    report = compare_logits(reference, quantized, IDS)
    panel.show_result(
        result_with(report, q_speed=SpeedFigures(12.0, 300.0, 32), r_speed=SpeedFigures(40.0, 900.0, 32))
    )
    assert "decode | <b>12.0</b> tok/s" in panel.figures_text() and "0.30×, slower" in panel.figures_text()
    panel.show_result(
        result_with(report, q_speed=SpeedFigures(50.0, 900.0, 32), r_speed=SpeedFigures(40.0, 900.0, 32))
    )
    assert "1.25×, faster" in panel.figures_text()


def test_errors_and_progress_are_shown_and_the_button_comes_back(panel):
    panel.set_running("loading int8-weight-only")
    assert not panel.run_button.isEnabled()
    assert "loading int8-weight-only" in panel.status.text()
    panel.show_error("Not enough memory to run the full-precision reference")
    assert panel.run_button.isEnabled()
    assert panel.status.text().startswith("Not enough memory")


def test_run_button_asks_for_the_chosen_text(panel, qtbot):
    panel.source.setCurrentIndex(1)
    with qtbot.waitSignal(panel.run_requested) as signal:
        panel.run_button.click()
    assert signal.args == [QUALITY_SOURCES[1][0]]


def test_live_line_counts_only_the_running_engines_replies(panel):
    state = panel.state
    reply = finished(1, "stop", 0.1, (0.05, 0.05, 0.05), t=5.0)
    panel.refresh(state.apply([RequestStarted(1, 3, t=4.0), reply]))
    assert f"last reply | {reply.stats.tokens_per_s:.1f} tok/s" in panel.figures_text()
    panel.set_engine_label("int8-weight-only")
    panel.refresh(state.apply([dataclasses.replace(model_loaded(), t=10.0)]))
    assert "last reply" not in panel.figures_text()  # an earlier engine's reply is not this scheme's


# ---- the reference overlay in the probability panel --------------------------------------------
def test_probability_rows_carry_the_reference_where_the_run_has_it(qtbot):
    state = LiveState()
    texts = [" the", " a", "\n", " an"]
    snap = snapshot([2.0, 1.5, 0.5, -1.0], texts, drawn=1)
    state.apply([RequestStarted(1, 4, t=0.0), token(1, 0, 0.1, " a", snap)])
    panel = ProbabilityPanel(state)
    qtbot.addWidget(panel)
    panel.show_token(1, 0)
    assert all(row.reference_prob is None for row in panel.rows)
    ref = ReferenceDistribution("full precision (float32)", {0: 0.5, 1: 0.3, 3: 0.01}, 0, " the", 0.5, 0.0123)
    asked = []

    def source(request_id, index):
        asked.append((request_id, index))
        return ref if (request_id, index) == (1, 0) else None

    panel.set_reference_source(source)
    assert asked[-1] == (1, 0)
    by_id = {row.token_id: row.reference_prob for row in panel.rows}
    assert by_id == {0: 0.5, 1: 0.3, 2: None, 3: 0.01}
    assert not panel.reference_note.isHidden()
    assert "KL 0.0123 nats" in panel.reference_note.text()
    row = next(i for i, r in enumerate(panel.rows) if r.token_id == 1)
    assert "full-precision reference (raw): 30.0%" in panel.bars.tooltip_for(row)
    panel.set_reference_source(None)
    assert all(row.reference_prob is None for row in panel.rows)
    assert panel.reference_note.isHidden()


# ---- the memory graph's quantized weights ------------------------------------------------------
def test_memory_graph_names_the_scheme_and_marks_full_precision(qtbot):
    state = LiveState()
    panel = MemoryPanel(state)
    qtbot.addWidget(panel)
    panel.refresh(
        state.apply(
            [MemorySample(140 * MIB, 100 * MIB, 0, 900 * MIB, 900 * MIB, 24 << 30, "psutil RSS", t=1.0)]
        )
    )
    assert "weights (tensor sizes)" in panel.legend.text()
    assert not panel.full_precision_line.isVisible()
    panel.set_weights_scheme("int8-weight-only", 513 * MIB, "float32")
    assert panel.series("weights")[1].tolist() == [140.0]
    assert panel.full_precision_line.value() == pytest.approx(513.0)
    text = panel.legend.text()
    assert "weights, int8-weight-only (tensor sizes)" in text and "unquantized (float32)" in text
    assert "513 MiB" in text and "140 MiB" in text
    panel.set_weights_scheme("none")
    assert panel.full_precision is None and "int8" not in panel.legend.text()
    assert math.isfinite(float(np.nanmax(panel.series("weights")[1])))
