"""The context meter and the context limit in the app, on the tiny model with a small KV pool:
the meter counts the conversation and the draft with the engine's own tokenizer while typing
and follows the reply while it streams; at the limit "drop" leaves the oldest turns out of the
prompt and marks them, "refuse" sends nothing, says why and keeps what was typed."""

from __future__ import annotations

from app_windows import REPLY_TIMEOUT_MS, StepGate, start_tiny

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.request import ChatMessage, Request

POOL_BLOCKS = 12  # 12 blocks of 16: 192 token slots, far below the tiny model's 2048 context
LONG = "Tell me everything about rivers, lakes, mountains, valleys, glaciers and the sea. " * 2


def small_pool_window(make_window, qtbot, tiny_loaded, policy: str):
    window = make_window(start=False)
    window.chat_actions.set_context_policy(policy)
    start_tiny(qtbot, window, tiny_loaded, EngineConfig(num_blocks=POOL_BLOCKS))
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=8))
    return window


def engine_count(tiny_loaded, messages) -> int:
    return len(
        LLMEngine(tiny_loaded, EngineConfig(num_blocks=4)).prompt_ids(Request(messages=tuple(messages)))
    )


def send(qtbot, window, text: str):
    """Send; returns the finished event, or the refusal message."""
    started, refused = [], []
    window.controller.reply_started.connect(started.append)
    window.controller.reply_refused.connect(refused.append)
    window.controller.send(text)
    qtbot.waitUntil(lambda: bool(started or refused), timeout=REPLY_TIMEOUT_MS)
    if refused:
        return refused[0]
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        pass
    return finished.args[0]


def test_the_meter_counts_the_draft_with_the_engines_tokenizer_and_follows_the_reply(
    make_window, qtbot, tiny_loaded
):
    window = small_pool_window(make_window, qtbot, tiny_loaded, "drop")
    meter = window.chat.meter
    window.chat.input.setPlainText("How long is this message?")
    qtbot.waitUntil(lambda: meter.fit is not None and meter.fit.full_tokens > 0, timeout=REPLY_TIMEOUT_MS)
    expected = engine_count(tiny_loaded, [ChatMessage("user", "How long is this message?")])
    assert meter.fit.full_tokens == expected and meter.fit.sent_tokens == 0
    assert meter.fit.pool_tokens == POOL_BLOCKS * 16 and meter.fit.limit == POOL_BLOCKS * 16
    assert f"{expected:,} / {POOL_BLOCKS * 16:,} tokens" in meter.context_label.text()
    assert f"/ {POOL_BLOCKS * 16:,} slots" in meter.pool_label.text()

    gate = StepGate(window.host.engine.core, after_steps=4)  # prefill + 3 decode steps
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        window.chat.send_button.click()
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        window.host.render_tick()
        live_generated, live_text = meter.generated, meter.context_label.text()
        used_slots = window.host.live.kv_stats.used_slots
        pool_text = meter.pool_label.text()
        gate.release()
    assert live_generated == 4 and f"{expected + 4:,} / " in live_text  # the prompt plus the reply so far
    assert pool_text.startswith(f"KV pool {used_slots:,} / ") and used_slots > 0

    window.chat.input.setPlainText("And now?")  # after the reply: the conversation is the sent part
    qtbot.waitUntil(lambda: meter.fit.full_tokens > expected + 8, timeout=REPLY_TIMEOUT_MS)
    history = [ChatMessage(m.role, m.content) for m in window.controller.conversation.messages]
    assert meter.fit.sent_tokens == engine_count(tiny_loaded, history)
    assert meter.fit.full_tokens == engine_count(tiny_loaded, [*history, ChatMessage("user", "And now?")])


def test_at_the_limit_drop_leaves_the_oldest_turns_out_and_marks_them(
    make_window, qtbot, tiny_loaded, monkeypatch
):
    window = small_pool_window(make_window, qtbot, tiny_loaded, "drop")
    submitted = []
    original = window.host.submit
    monkeypatch.setattr(window.host, "submit", lambda request: submitted.append(request) or original(request))
    failed = []
    window.host.request_failed.connect(failed.append)
    for _ in range(6):
        event = send(qtbot, window, LONG)
        assert not isinstance(event, str), event
        if window.controller.conversation.messages[-1].meta.get("context"):
            break
    assert not failed  # the engine never saw a prompt too long for it
    reply = window.controller.conversation.messages[-1]
    first_kept = reply.meta["context"]["first_kept"]
    assert first_kept >= 2 and first_kept % 2 == 0  # whole exchanges, from the oldest
    path = window.controller.conversation.messages
    sent = submitted[-1].messages
    assert [m.content for m in sent] == [m.content for m in path[first_kept:-1]]  # no system prompt here
    assert reply.meta["context"]["prompt_tokens"] + 8 <= POOL_BLOCKS * 16
    bubbles = window.chat.transcript.bubbles
    assert [b.outside_context for b in bubbles] == [i < first_kept for i in range(len(bubbles))]
    assert bubbles[0]._context_note.isVisibleTo(bubbles[0])
    conv_id = window.controller.conversation.id
    window.close()
    again = make_window(start=False)
    again.controller.open_conversation(conv_id)  # the mark is stored with the reply
    assert [b.outside_context for b in again.chat.transcript.bubbles][:first_kept] == [True] * first_kept


def test_at_the_limit_refuse_sends_nothing_and_keeps_what_was_typed(make_window, qtbot, tiny_loaded):
    window = small_pool_window(make_window, qtbot, tiny_loaded, "refuse")
    refusal = None
    for _ in range(6):
        window.chat.input.setPlainText(LONG)
        stored_before = (
            len(window.conversations.load(window.controller.conversation.id).nodes)
            if window.controller.conversation
            else 0
        )
        outcome = send(qtbot, window, LONG)
        if isinstance(outcome, str):
            refusal = outcome
            break
    assert refusal is not None and "Drop the oldest turns" in refusal and "holds 192" in refusal
    assert window.status.error.text() == refusal or refusal in window.status.error.toolTip()
    assert window.chat.input.toPlainText() == LONG  # nothing the user wrote is lost
    assert len(window.conversations.load(window.controller.conversation.id).nodes) == stored_before
    assert window.chat.send_button.isEnabled() and window.controller.active is None
    assert "⚠" in window.chat.meter.note.text()  # the meter says so too, before any click

    window.chat_actions.set_context_policy("drop")  # the other choice, from the Chat menu
    assert not isinstance(send(qtbot, window, LONG), str)
