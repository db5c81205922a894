"""The speculation panel's figures: folded from rounds while a reply streams, equal to the
engine's RequestStats once it ends; round rows with their verdicts; a slowdown said plainly."""

import pytest

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import DraftLength, RequestFinished, RequestStats, SpecRound
from engine.request import Request
from engine.results import SpeedRun, SpeedupResult
from live.state import LiveState
from widgets.speculation_panel import Acceptance, SpeculationPanel, acceptance_of, round_rows, saving_text


@pytest.fixture(scope="module")
def ngram_events(tiny_loaded):
    events: list = []
    config = EngineConfig(block_size=4, num_blocks=200, speculative=SpeculativeConfig("ngram", num_draft=4))
    engine = LLMEngine(tiny_loaded, config, events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    engine.add_request(Request.chat("again and again and again", sampling=params))
    while engine.has_work():
        engine.step()
    return events


def test_live_fold_of_the_rounds_equals_the_finished_requests_stats(ngram_events):
    finished = next(e for e in ngram_events if isinstance(e, RequestFinished))
    live = LiveState()
    live.apply([e for e in ngram_events if e is not finished])
    running = acceptance_of(live, finished.request_id)
    live.apply([finished])
    final = acceptance_of(live, finished.request_id)
    stats = finished.stats
    assert stats.spec_rounds > 0
    assert not running.final and final.final
    for a in (running, final):
        assert (a.rounds, a.drafted, a.accepted) == (
            stats.spec_rounds,
            stats.spec_drafted,
            stats.spec_accepted,
        )
        assert a.accepted_by_position == stats.spec_accepted_by_position
        assert a.drafted_by_position == stats.spec_drafted_by_position
        assert a.target_forwards == stats.target_forwards
    assert final.acceptance_rate == stats.acceptance_rate


def test_panel_draws_a_bar_per_draft_position(qtbot, ngram_events):
    live = LiveState()
    panel = SpeculationPanel(live)
    qtbot.addWidget(panel)
    panel.refresh(live.apply(ngram_events))
    a = panel.acceptance
    heights = panel.bars.opts["height"]
    assert len(heights) == len(a.drafted_by_position)
    assert list(heights) == [acc / d for acc, d in zip(a.accepted_by_position, a.drafted_by_position)]


def _round(accepted: int, bonus: bool) -> SpecRound:
    return SpecRound(
        request_id=1,
        round=0,
        proposer="draft",
        draft_ids=(10, 11, 12),
        q_probs=(0.5, 0.8, 0.4),
        p_probs=(0.6, 0.2) if not bonus else (0.6, 0.9, 0.5),
        accept_probs=(1.0, 0.25) if not bonus else (1.0, 1.0, 1.0),
        accepted=accepted,
        emitted=(10, 99) if not bonus else (10, 11, 12, 13),
        bonus=bonus,
    )


def test_round_rows_give_q_p_min_and_each_drafts_verdict():
    rows = round_rows(_round(1, False), lambda token_id: f"t{token_id}")
    assert rows == [
        ("'t10'", "0.500", "0.600", "1.000", "accepted"),
        ("'t11'", "0.800", "0.200", "0.250", "rejected"),
        ("'t12'", "0.400", "—", "—", "not examined"),
    ]
    assert [r[4] for r in round_rows(_round(3, True), str)] == ["accepted"] * 3


def _result(spec_tps: float, plain_tps: float) -> SpeedupResult:
    stats = RequestStats(0, 32, 0, 0.0, (), 0.0, 0, 0, spec_drafted=10, spec_accepted=4, spec_rounds=5)
    return SpeedupResult("ngram", SpeedRun(32, 32 / spec_tps, stats), SpeedRun(32, 32 / plain_tps, stats))


def test_a_slowdown_is_said_plainly_and_a_speedup_as_such(qtbot):
    panel = SpeculationPanel(LiveState())
    qtbot.addWidget(panel)
    panel.show_speedup(_result(20.0, 40.0))
    text = panel.speedup_label.text()
    assert "slows this down" in text and "0.50×" in text and "40.0 tokens/s" in text
    panel.show_speedup(_result(60.0, 40.0))
    assert "1.50× faster" in panel.speedup_label.text()


def test_the_draft_length_and_the_measured_saving_are_shown(qtbot, ngram_events):
    """The summary says the request's current draft length (the engine's last DraftLength, else
    its latest round's) and the time saved or lost per token: the rounds' sum while streaming,
    RequestStats.spec_saved_s once finished."""
    finished = next(e for e in ngram_events if isinstance(e, RequestFinished))
    rounds = [e for e in ngram_events if isinstance(e, SpecRound)]
    changes = [e for e in ngram_events if isinstance(e, DraftLength)]
    live = LiveState()
    live.apply([e for e in ngram_events if e is not finished])
    running = acceptance_of(live, finished.request_id)
    assert running.saved_s == pytest.approx(sum(r.saved_s for r in rounds))
    want_length = changes[-1].draft_length if changes else rounds[-1].draft_length
    assert running.draft_length == want_length
    live.apply([finished])
    final = acceptance_of(live, finished.request_id)
    assert final.saved_s == finished.stats.spec_saved_s
    assert final.saved_ms_per_token == pytest.approx(1e3 * finished.stats.spec_saved_s / 24)
    panel = SpeculationPanel(live)
    qtbot.addWidget(panel)
    panel.refresh({"speculation"})
    assert f"draft length now <b>{want_length}</b>" in panel.summary.text()
    assert f"{abs(final.saved_ms_per_token):.2f} ms" in panel.summary.text()


def test_a_loss_and_a_draft_length_of_zero_are_said_as_such():
    base = dict(request_id=1, rounds=4, drafted=8, accepted=0, generated=10, target_forwards=10)
    lost = Acceptance(
        **base, accepted_by_position=(), drafted_by_position=(), final=True, draft_length=0, saved_s=-0.02
    )
    text = saving_text(lost)
    assert "draft length now <b>0</b>" in text and "lost <b>2.00 ms</b> per token" in text
    live = LiveState()
    live.apply([DraftLength(7, 0, 0.1)])
    assert live.draft_lengths == {7: 0}
