"""Speculative decoding in the window: Apply restarts the engine with n-gram speculation, the
reply's tokens carry draft marks, the panel shows the engine's own acceptance figures, a
selected token shows its round, and the speedup is measured both ways."""

import math

from app_windows import REPLY_TIMEOUT_MS, StepGate
from test_app_chat import send_and_wait, use_params

from engine.config import SpeculativeConfig

JOB_TIMEOUT_MS = 120_000


def apply_ngram(window, qtbot, num_draft: int = 4) -> None:
    controls = window.controls.speculation
    controls.set_method("ngram")
    controls.num_draft.setValue(num_draft)
    with qtbot.waitSignal(window.host.model_loaded, timeout=REPLY_TIMEOUT_MS):
        controls.apply_button.click()
    assert window.host.config.speculative == SpeculativeConfig("ngram", num_draft=num_draft)


def test_speculative_reply_is_marked_and_the_panel_shows_the_engines_figures(make_window, qtbot):
    window = make_window()
    apply_ngram(window, qtbot)
    use_params(window, max_new_tokens=24)
    finished = send_and_wait(qtbot, window, "Say it again and again")
    stats = finished.stats
    assert stats.spec_rounds > 0 and stats.spec_drafted > 0

    live = window.host.live
    marks = [live.token(finished.request_id, i).spec for i in range(stats.generated_tokens)]
    assert set(marks) - {""} and set(marks) <= {"", "accepted", "resampled", "bonus"}

    window.chat.token_view.setChecked(True)
    window.chat.spec_marks.setChecked(True)
    bubble = window.chat.transcript.bubbles[-1]
    first_marked = next(i for i, m in enumerate(marks) if m)
    link = bubble.body_html().split(f'href="tok:{first_marked}"')[1][:300]
    assert marks[first_marked] in link  # the tooltip names the mark
    window.chat.spec_marks.setChecked(False)
    assert "accepted" not in bubble.body_html() and "bonus" not in bubble.body_html()

    window.host.render_tick()
    a = window.panels.speculation.acceptance
    assert a is not None and a.final and a.request_id == finished.request_id
    assert a.acceptance_rate == stats.acceptance_rate
    assert a.mean_accepted_length == stats.mean_accepted_length
    assert a.forwards_per_token == stats.target_forwards / stats.generated_tokens
    assert a.accepted_by_position == stats.spec_accepted_by_position
    assert f"{stats.acceptance_rate:.0%}" in window.panels.speculation.summary.text()


def test_selecting_a_token_shows_its_rounds_p_q_and_acceptance(make_window, qtbot):
    window = make_window()
    apply_ngram(window, qtbot)
    use_params(window, max_new_tokens=16)
    finished = send_and_wait(qtbot, window, "Again and again")
    live = window.host.live
    index = next(
        i for i in range(len(finished.token_ids)) if live.token(finished.request_id, i).spec_round >= 0
    )
    spec_round = live.spec_round(finished.request_id, index)

    window.chat.token_view.setChecked(True)
    window.chat.transcript.bubbles[-1].token_clicked.emit(index)
    table = window.panels.speculation.round_table
    assert table.rowCount() == len(spec_round.draft_ids)
    for row in range(len(spec_round.p_probs)):
        q, p, accept = (float(table.item(row, c).text()) for c in (1, 2, 3))
        assert q == round(spec_round.q_probs[row], 3)
        assert p == round(spec_round.p_probs[row], 3)
        assert math.isclose(accept, round(min(1.0, spec_round.p_probs[row] / spec_round.q_probs[row]), 3))
    verdicts = [table.item(r, 4).text() for r in range(table.rowCount())]
    assert verdicts[: spec_round.accepted] == ["accepted"] * spec_round.accepted


def test_measure_speedup_reports_tokens_per_second_with_and_without(make_window, qtbot):
    window = make_window()
    panel = window.panels.speculation
    panel.measure_button.click()  # speculation off: said, not measured
    assert "speculation is off" in panel.speedup_label.text()
    apply_ngram(window, qtbot)
    use_params(window, max_new_tokens=8)
    send_and_wait(qtbot, window, "Repeat repeat repeat")
    with qtbot.waitSignal(window.speculation.measured, timeout=JOB_TIMEOUT_MS) as done:
        panel.measure_button.click()
    result = done.args[0]
    assert result.plain.tokens == result.speculative.tokens > 0
    assert result.plain.tokens_per_s > 0 and result.speculative.tokens_per_s > 0
    assert result.speculative.stats.spec_rounds > 0 and result.plain.stats.spec_rounds == 0
    text = panel.speedup_label.text()
    assert f"{result.plain.tokens_per_s:.1f} tokens/s" in text
    assert ("slows this down" in text) == (result.speedup < 1)
    assert panel.measure_button.isEnabled()


def test_an_extra_chat_tab_shows_draft_marks_and_selects_rounds(make_window, qtbot):
    window = make_window()
    apply_ngram(window, qtbot)
    use_params(window, max_new_tokens=12)
    controller = window.chat_tabs.add_tab()
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as done:
        controller.send("Again and again")
    finished = done.args[0]
    live = window.host.live
    index = next(i for i in range(len(finished.token_ids)) if live.token(finished.request_id, i).spec)
    controller.pane.token_view.setChecked(True)
    controller.pane.spec_marks.setChecked(True)
    assert controller.pane.spec_marks.isEnabled()
    bubble = controller.pane.transcript.bubbles[-1]
    assert (
        live.token(finished.request_id, index).spec
        in bubble.body_html().split(f'href="tok:{index}"')[1][:300]
    )
    bubble.token_clicked.emit(index)
    assert window.panels.speculation.round_table.rowCount() == len(
        live.spec_round(finished.request_id, index).draft_ids
    )


def test_self_draft_applies_with_its_layer_count(make_window, qtbot):
    window = make_window()
    controls = window.controls.speculation
    controls.set_method("self")
    controls.self_layers.setValue(1)
    assert controls.self_layers.isEnabled() and not controls.draft_model.isEnabled()
    with qtbot.waitSignal(window.host.model_loaded, timeout=REPLY_TIMEOUT_MS):
        controls.apply_button.click()
    assert window.host.config.speculative == SpeculativeConfig("self", num_draft=4, self_draft_layers=1)
    use_params(window, max_new_tokens=8)
    finished = send_and_wait(qtbot, window, "Hello")
    rounds = [r for (rid, _), r in window.host.live.spec_rounds.items() if rid == finished.request_id]
    assert rounds and all(r.proposer.startswith("self (first 1 layers + a fitted head") for r in rounds)


def test_a_self_drafts_cache_shows_in_the_memory_graph_mid_reply(make_window, qtbot):
    """Held mid-reply, the engine's memory sample counts the self-draft's KV cache and its own
    weights (the fitted head; its layers are the target's), and the memory graph draws the
    cache's series with its value."""
    window = make_window()
    controls = window.controls.speculation
    controls.set_method("self")
    controls.self_layers.setValue(1)
    with qtbot.waitSignal(window.host.model_loaded, timeout=REPLY_TIMEOUT_MS):
        controls.apply_button.click()
    use_params(window, max_new_tokens=24)
    gate = StepGate(window.host.engine.core, after_steps=4)
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        window.controller.send("Hello there")
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        # runs once the step ends (a look inside the engine: the app has no such question)
        call = window.host.ask(lambda engine: engine._call(lambda core: core.sample_memory()))
        gate.release()
        with qtbot.waitSignal(call.returned, timeout=REPLY_TIMEOUT_MS) as sampled:
            pass
    sample = sampled.args[0]
    head = window.host.engine.core.proposer.draft.weight_bytes
    assert sample.draft_cache_bytes > 0 and sample.draft_weights_bytes == head > 0
    window.host.render_tick()
    memory = window.panels.memory
    memory.refresh({"memory"})
    _, cache = memory.series("draft_cache")
    assert (cache * memory.unit[1] == sample.draft_cache_bytes).any()  # that sample, drawn
    assert "draft KV cache" in memory.legend.text()


def test_a_draft_model_without_a_path_is_refused_in_words(make_window, qtbot):
    window = make_window(start=False)
    controls = window.controls.speculation
    controls.set_method("draft")
    with qtbot.assertNotEmitted(controls.apply_requested):
        controls.apply_button.click()
    assert "draft model" in controls.error.text()


def test_marks_colour_tokens_and_name_them():
    from app.chat.rich_text import ReplyToken
    from app.chat.spec_marks import SPEC_MARK_COLOURS, spec_token_html

    tokens = [ReplyToken(i, f"w{i}", -0.1) for i in range(4)]
    marks = ["", "accepted", "resampled", "bonus"]
    html = spec_token_html(tokens, marks.__getitem__)
    for i, mark in enumerate(marks):
        link = html.split(f'href="tok:{i}"')[1].split("</a>")[0]
        coloured = [m for m, colour in SPEC_MARK_COLOURS.items() if f"color: {colour}" in link]
        assert coloured == ([mark] if mark else [])
        assert (mark or "plain step") in link
