"""Chat view pieces on their own: streaming render budget, token view, edit mode."""

from __future__ import annotations

import math

import app.chat.bubble as chat_view
from app.chat.bubble import STREAM_RENDER_BUDGET, MessageBubble
from app.chat.rich_text import ReplyToken
from app.chat.view import ChatPane


class SteppingClock:
    """Each call returns the time, then advances it by `step` (a render 'costs' one step)."""

    def __init__(self, step: float):
        self.t, self.step = 100.0, step

    def __call__(self) -> float:
        now = self.t
        self.t += self.step
        return now


def tokens(start: int, texts: list[str]) -> list[ReplyToken]:
    return [ReplyToken(start + i, text, math.log(0.5)) for i, text in enumerate(texts)]


def test_a_costly_streaming_render_is_deferred_until_its_budget_allows(qtbot, monkeypatch):
    clock = SteppingClock(step=0.01)
    monkeypatch.setattr(chat_view, "_clock", clock)
    bubble = MessageBubble("assistant", "model")
    qtbot.addWidget(bubble)
    bubble.add_tokens(tokens(0, ["Hello"]), "Hello")  # first render: costs one step
    assert "Hello" in bubble.body_html()
    cost = 0.01
    bubble.add_tokens(tokens(1, [" world"]), "Hello world")  # too soon after a costly render
    assert "world" not in bubble.body_html() and bubble.text == "Hello world"
    clock.t += cost * STREAM_RENDER_BUDGET  # the budget has passed
    bubble.add_tokens(tokens(2, ["!"]), "Hello world!")
    assert "Hello world!" in bubble.body_html()
    bubble.set_text("Hello world!!")  # the final text always renders at once
    assert "Hello world!!" in bubble.body_html()


def test_token_view_toggle_and_selection(qtbot):
    bubble = MessageBubble("assistant", "model", request_id=7)
    qtbot.addWidget(bubble)
    bubble.add_tokens(tokens(0, ["a", "b"]), "ab")
    assert 'href="tok:0"' not in bubble.body_html()  # Markdown by default
    bubble.set_view(token_view=True, colour_by_probability=False)
    assert bubble.shows_tokens and 'href="tok:1"' in bubble.body_html()
    with qtbot.waitSignal(bubble.token_clicked) as clicked:
        bubble._body.linkActivated.emit("tok:1")
    assert clicked.args == [1]
    with qtbot.waitSignal(bubble.token_hovered) as hovered:
        bubble._body.linkHovered.emit("")
    assert hovered.args == [None]


def test_user_text_is_never_markdown(qtbot):
    bubble = MessageBubble("user", "You")
    qtbot.addWidget(bubble)
    bubble.set_text("**not bold** <b>")
    assert "<strong>" not in bubble.body_html() and "&lt;b&gt;" in bubble.body_html()


def test_pane_send_and_edit_states(qtbot):
    pane = ChatPane()
    qtbot.addWidget(pane)
    pane.set_state(model_ready=False, loading=True, generating=False, can_regenerate=False, can_edit=False)
    assert pane.send_button.text() == "Loading model…" and not pane.send_button.isEnabled()
    pane.set_state(model_ready=True, loading=False, generating=False, can_regenerate=True, can_edit=True)
    pane.input.setPlainText("  hi  ")
    with qtbot.waitSignal(pane.send_requested) as sent:
        pane.send_button.click()
    assert sent.args == ["hi"]
    pane.set_editing("old text")
    pane.set_state(model_ready=True, loading=False, generating=False, can_regenerate=True, can_edit=True)
    assert pane.send_button.text() == "Resend" and pane.input.toPlainText() == "old text"
    pane.set_state(model_ready=True, loading=False, generating=True, can_regenerate=True, can_edit=True)
    assert pane.stop_button.isEnabled() and not pane.send_button.isEnabled()
    assert not pane.regenerate_button.isEnabled() and not pane.edit_button.isEnabled()
