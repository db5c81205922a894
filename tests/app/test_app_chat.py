"""The chat through the whole app on the tiny model: streaming, panels, stop, regenerate,
edit-and-resend, persistence, errors and shutdown."""

from __future__ import annotations

import threading

from app_windows import REPLY_TIMEOUT_MS, StepGate, start_tiny, stop_on_first_tokens

from engine.config import SamplingParams


def use_params(window, **kw) -> SamplingParams:
    params = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "snapshot_top_n": 8, **kw})
    window.controls.sampling.set_params(params)
    return params


def send_and_wait(qtbot, window, text: str):
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send(text)
    return finished.args[0]


def stored_messages(window):
    conv = window.conversations.load(window.controller.conversation.id)
    return [(m.role, m.content, m.finish_reason) for m in conv.messages]


def test_a_message_gets_a_streamed_reply_saved_as_it_grows(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=24)
    gate = StepGate(window.host.engine.core, after_steps=6)  # prefill + 5 decode steps
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send("Hello there")
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        window.host.render_tick()  # the frame the render timer would draw now
        partial = window.controller.active.bubble.text
        tokens_so_far = len(window.controller.active.record.tokens)
        used_blocks = window.host.live.page_map.used_blocks
        stored = window.conversations.load(window.controller.conversation.id).messages[-1]
        gate.release()
    event = finished.args[0]

    assert event.finish_reason == "length" and len(event.token_ids) == 24
    assert 0 < tokens_so_far < 24 and partial and event.text.startswith(partial)  # shown as it grows
    assert stored.role == "assistant" and stored.finish_reason is None  # the row exists mid-reply
    assert partial.startswith(stored.content)  # storage lags the screen by at most a checkpoint
    assert used_blocks > 0  # the page map shows the sequence's blocks while it generates...
    assert window.host.live.page_map.used_blocks == 0  # ...and they are freed afterwards
    assert window.chat.transcript.bubbles[-1].text == event.text
    assert stored_messages(window) == [("user", "Hello there", None), ("assistant", event.text, "length")]
    window.panels.latency.refresh({"latency"})  # plots redraw once a second: draw the last frame now
    assert window.panels.latency.point_count() == 24  # one ITL/TTFT point per generated token
    bubble = window.chat.transcript.bubbles[-1]
    assert len(bubble.tokens) == 24 and "".join(t.text_delta for t in bubble.tokens) == event.text


def test_selecting_a_reply_token_shows_its_snapshot_in_the_probability_panel(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=6, snapshot_top_n=5)
    event = send_and_wait(qtbot, window, "Pick a word")
    window.chat.token_view.setChecked(True)
    bubble = window.chat.transcript.bubbles[-1]
    assert bubble.shows_tokens and 'href="tok:3"' in bubble.body_html()

    bubble.token_clicked.emit(3)  # as a click on the token's link does
    token = window.host.live.token(event.request_id, 3)
    rows = window.panels.probabilities.rows
    assert [r.token_id for r in rows] == list(token.snapshot.candidate_ids)
    assert [r.prob for r in rows] == list(token.snapshot.stages[-1].probs)
    assert [r.drawn for r in rows].count(True) == 1
    assert (
        'href="tok:3"' in bubble.body_html()
        and "background-color" in bubble.body_html().split('href="tok:3"')[1][:120]
    )

    bubble.token_clicked.emit(3)  # clicking it again returns to following the latest token
    assert window.panels.probabilities.following


def test_stop_ends_the_reply_early_and_keeps_what_was_generated(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=2000)
    stop_on_first_tokens(window)
    assert not window.chat.stop_button.isEnabled()
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send("Count to a million")
        assert window.chat.stop_button.isEnabled()
    event = finished.args[0]
    assert event.finish_reason == "cancelled" and 0 < len(event.token_ids) < 2000
    assert stored_messages(window)[-1] == ("assistant", event.text, "cancelled")
    assert window.chat.send_button.isEnabled() and not window.chat.stop_button.isEnabled()
    assert "stopped" in window.chat.transcript.bubbles[-1]._meta.text()


def test_regenerate_replaces_the_last_reply(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=5)
    first = send_and_wait(qtbot, window, "Say something")
    first_id = window.controller.conversation.messages[-1].id
    use_params(window, max_new_tokens=7)
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.chat.regenerate_button.click()
    second = finished.args[0]
    assert second.request_id != first.request_id and len(second.token_ids) == 7
    messages = window.controller.conversation.messages
    assert [m.role for m in messages] == ["user", "assistant"] and messages[-1].id != first_id
    assert stored_messages(window) == [("user", "Say something", None), ("assistant", second.text, "length")]
    assert len(window.chat.transcript.bubbles) == 2


def test_edit_and_resend_replaces_the_last_exchange(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=4)
    send_and_wait(qtbot, window, "First question")
    send_and_wait(qtbot, window, "Second question")
    window.chat.edit_button.click()
    assert window.chat.editing and window.chat.input.toPlainText() == "Second question"
    assert window.chat.send_button.text() == "Resend"
    window.chat.input.setPlainText("Second question, rephrased")
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.chat.send_button.click()
    rows = stored_messages(window)
    assert [(role, content) for role, content, _ in rows] == [
        ("user", "First question"),
        ("assistant", rows[1][1]),
        ("user", "Second question, rephrased"),
        ("assistant", finished.args[0].text),
    ]
    assert "Second question" not in [content for _, content, _ in rows]
    assert not window.chat.editing and len(window.chat.transcript.bubbles) == 4


def test_the_request_carries_history_and_system_prompt(make_window, qtbot, monkeypatch):
    window = make_window()
    use_params(window, max_new_tokens=3)
    window.chat.system_prompt.setPlainText("Answer in French.")
    send_and_wait(qtbot, window, "One")
    submitted = []
    original = window.host.submit
    monkeypatch.setattr(window.host, "submit", lambda request: submitted.append(request) or original(request))
    reply = send_and_wait(qtbot, window, "Two")
    roles = [(m.role, m.content) for m in submitted[0].messages]
    assert roles[0] == ("system", "Answer in French.")
    assert (
        roles[1][0] == "user"
        and roles[1][1] == "One"
        and roles[2][0] == "assistant"
        and roles[3] == ("user", "Two")
    )
    assert submitted[0].sampling.max_new_tokens == 3 and reply.finish_reason == "length"
    assert window.conversations.load(window.controller.conversation.id).system_prompt == "Answer in French."


def test_conversations_and_layout_survive_a_restart(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=5)
    reply = send_and_wait(qtbot, window, "Remember me")
    window.controller.new_conversation()
    send_and_wait(qtbot, window, "A second chat")
    window.docks["latency"].hide()
    window.chat.token_view.setChecked(True)
    window.close()

    again = make_window(start=False)
    assert [item.split("\n")[0] for item in _sidebar_titles(again)] == ["A second chat", "Remember me"]
    assert again.controller.conversation.title == "A second chat"  # the latest is reopened
    assert not again.docks["latency"].isVisible() and again.docks["memory"].isVisible()
    assert again.chat.token_view.isChecked()
    assert again.controls.sampling.params().max_new_tokens == 5
    again.sidebar.list.setCurrentRow(1)
    texts = [b.text for b in again.chat.transcript.bubbles]
    assert texts == ["Remember me", reply.text]


def _sidebar_titles(window):
    return [window.sidebar.list.item(i).text() for i in range(window.sidebar.list.count())]


def test_closing_mid_generation_stops_the_engine_and_saves_the_partial_reply(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=5000)
    with qtbot.waitSignal(window.host.tokens_generated, timeout=REPLY_TIMEOUT_MS):
        window.controller.send("Go on forever")
    conv_id = window.controller.conversation.id
    window.close()
    assert not window.host.threads_alive()
    assert not [t for t in threading.enumerate() if t.name == "kvscope-engine"]
    saved = window.conversations.load(conv_id).messages[-1]
    assert saved.role == "assistant" and saved.finish_reason == "cancelled" and saved.content


def test_an_engine_error_shows_in_the_status_bar_and_the_app_keeps_working(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=4)
    core = window.host.engine.core

    def failing_step():
        raise RuntimeError("injected step failure")

    core.step = failing_step  # the engine thread looks the method up each iteration
    with qtbot.waitSignal(window.host.request_failed, timeout=REPLY_TIMEOUT_MS):
        window.controller.send("This will fail")
    qtbot.waitUntil(lambda: "injected step failure" in window.status.error.text())
    assert window.status.error.isVisible()
    assert stored_messages(window)[-1][2] == "failed"
    assert "failed" in window.chat.transcript.bubbles[-1]._meta.text()

    del core.step  # the class's own step again
    reply = send_and_wait(qtbot, window, "And now?")
    assert reply.finish_reason == "length"


def test_a_model_that_fails_to_load_is_reported_and_another_can_be_loaded(
    make_window, qtbot, tiny_loaded, test_config, tmp_path
):
    from app.settings import ModelChoice

    window = make_window(start=False)
    with qtbot.waitSignal(window.host.model_load_failed, timeout=REPLY_TIMEOUT_MS) as failed:
        window.load_model(ModelChoice(source=str(tmp_path / "no-such-model")))
    assert "no-such-model" in failed.args[0]
    window.refresh_status()
    assert "no-such-model" in window.status.error.toolTip()
    assert window.status.model.text() == "No model (loading failed)"
    assert not window.chat.send_button.isEnabled() and window.chat.send_button.text() == "No model loaded"

    start_tiny(qtbot, window, tiny_loaded, test_config)
    assert window.chat.send_button.isEnabled()
    use_params(window, max_new_tokens=3)
    assert send_and_wait(qtbot, window, "Hi").finish_reason == "length"


def test_a_load_failure_opens_a_dialog_in_interactive_use(make_window, qtbot, tmp_path):
    from PySide6.QtWidgets import QMessageBox

    from app.settings import ModelChoice

    window = make_window(start=False, interactive=True)
    with qtbot.waitSignal(window.host.model_load_failed, timeout=REPLY_TIMEOUT_MS):
        window.load_model(ModelChoice(source=str(tmp_path / "missing.gguf")))
    boxes = [b for b in window.findChildren(QMessageBox) if b.isVisible()]
    assert len(boxes) == 1 and "missing.gguf" in boxes[0].text()
    boxes[0].close()


def test_the_send_button_says_loading_while_the_model_loads(make_window, qtbot, tiny_loaded, test_config):
    window = make_window(start=False)
    window.start_engine(test_config, loaded=tiny_loaded)
    assert window.chat.send_button.text() == "Loading model…" and not window.chat.send_button.isEnabled()
    qtbot.waitUntil(lambda: window.chat.send_button.isEnabled(), timeout=REPLY_TIMEOUT_MS)
    assert window.chat.send_button.text() == "Send"


def test_export_writes_markdown_and_json(make_window, qtbot, tmp_path):
    import json

    window = make_window()
    use_params(window, max_new_tokens=3)
    reply = send_and_wait(qtbot, window, "Export me")
    conv_id = window.controller.conversation.id
    window.controller.export_to(conv_id, "markdown", tmp_path / "c.md")
    window.controller.export_to(conv_id, "json", tmp_path / "c.json")
    assert "**User**\n\nExport me" in (tmp_path / "c.md").read_text()
    data = json.loads((tmp_path / "c.json").read_text())
    assert [m["content"] for m in data["messages"]] == ["Export me", reply.text]


def test_hovering_a_token_shows_it_until_the_pointer_leaves(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=5)
    event = send_and_wait(qtbot, window, "Hover")
    window.chat.token_view.setChecked(True)
    bubble = window.chat.transcript.bubbles[-1]
    panel = window.panels.probabilities
    bubble.token_hovered.emit(2)
    assert not panel.following
    assert (
        panel.rows
        and panel.rows[0].token_id == window.host.live.token(event.request_id, 2).snapshot.candidate_ids[0]
    )
    bubble.token_hovered.emit(None)  # left the tokens: back to following the latest token
    assert panel.following
    bubble.token_clicked.emit(1)
    bubble.token_hovered.emit(3)
    bubble.token_hovered.emit(None)  # with a token pinned, leaving returns to the pinned one
    assert not panel.following and window.controller.pinning.pinned == (event.request_id, 1)


def test_rename_and_delete_conversations(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=2)
    send_and_wait(qtbot, window, "Keep me")
    kept = window.controller.conversation.id
    window.controller.new_conversation()
    send_and_wait(qtbot, window, "Delete me")
    doomed = window.controller.conversation.id
    window.controller.rename(kept, "  Renamed   chat ")
    assert window.conversations.load(kept).title == "Renamed chat"
    window.controller.delete(doomed)
    assert window.conversations.load(doomed) is None
    assert window.controller.conversation is None and not window.chat.transcript.bubbles
    assert window.sidebar.ids() == [kept]
