"""The context limit's arithmetic on its own: what fits, what is dropped under "drop" (fewest
oldest turns, cut before a user turn), what "refuse" says, and the room kept for the reply."""

from __future__ import annotations

import pytest

from app.chat.context_fit import refusal
from engine.api import fit, reply_room
from engine.request import ChatMessage

SYSTEM = [ChatMessage("system", "s" * 10)]


def turns(*lengths: int) -> list[ChatMessage]:
    roles = ["user", "assistant"]
    return [ChatMessage(roles[i % 2], "x" * n) for i, n in enumerate(lengths)]


def count(messages) -> int:
    """One token per character plus 3 per message: the shape of a chat template."""
    return sum(len(m.content) + 3 for m in messages)


def test_a_conversation_that_fits_is_sent_whole():
    result = fit(count, SYSTEM, turns(20, 30), [ChatMessage("user", "y" * 5)], 200, 500, 40, "drop")
    assert (
        result.fits and result.dropped == 0 and result.prompt_tokens == result.full_tokens == 13 + 23 + 33 + 8
    )
    assert result.sent_tokens == 13 + 23 + 33  # the typed message apart from the sent ones
    assert result.limit == 200 and result.reply_room == 40


def test_drop_leaves_out_the_fewest_oldest_turns_and_cuts_before_a_user_turn():
    history = turns(40, 40, 40, 40, 40, 40)  # u a u a u a, 43 tokens each
    tail = [ChatMessage("user", "z" * 17)]  # 20 tokens
    # 13 + 6 * 43 + 20 = 291 with 30 of reply room: over a limit of 200.
    result = fit(count, SYSTEM, history, tail, 200, 1000, 30, "drop")
    assert result.fits and result.over
    assert result.dropped == 4  # two whole exchanges; cutting 3 would start on a reply
    assert result.prompt_tokens == 13 + 2 * 43 + 20 and result.prompt_tokens + 30 <= 200
    tighter = fit(count, SYSTEM, history, tail, 140, 1000, 30, "drop")
    assert tighter.dropped == 6 and tighter.prompt_tokens == 13 + 20  # only the new message is left


def test_refuse_sends_nothing_and_says_what_to_do():
    history = turns(40, 40, 40, 40)
    result = fit(count, SYSTEM, history, [ChatMessage("user", "q")], 120, 1000, 20, "refuse")
    assert not result.fits and result.dropped == 0
    message = refusal(result)
    assert "context window holds 120" in message and "Drop the oldest turns" in message


def test_a_message_too_long_on_its_own_is_refused_under_either_setting():
    long = [ChatMessage("user", "w" * 300)]
    for policy in ("drop", "refuse"):
        result = fit(count, SYSTEM, turns(10, 10), long, 200, 1000, 20, policy)
        assert not result.fits
    assert "shorten it" in refusal(fit(count, SYSTEM, [], long, 200, 1000, 20, "drop"))


def test_the_kv_pool_can_be_the_tighter_limit():
    result = fit(count, SYSTEM, turns(50, 50), [ChatMessage("user", "q")], 2048, 100, 20, "refuse")
    assert result.limit == 100 and not result.fits and "KV pool holds 100" in refusal(result)


@pytest.mark.parametrize("max_new, limit, room", [(256, 8192, 256), (4096, 8192, 2048), (0, 100, 1)])
def test_the_reply_room_is_its_token_limit_up_to_a_quarter_of_the_context(max_new, limit, room):
    assert reply_room(max_new, limit) == room
