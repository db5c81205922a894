"""What the chat does at the context limit, and how it says so.

A request must fit the model's context window and the whole KV pool (the engine refuses one that
does not), with room left for the reply. At the limit the user's setting decides, never a silent
cut: "drop" leaves the oldest turns out of the prompt (the chat marks them), "refuse" sends
nothing and says why. The arithmetic is the engine's (engine.limits: `fit`, counted by the
engine's own prompt rendering through EngineClient.fit_context); the words are the chat's.
"""

from __future__ import annotations

from engine.api import POLICIES, ContextFit

DEFAULT_POLICY = "drop"
POLICY_LABELS = {
    "drop": "Drop the oldest turns (marked in the chat)",
    "refuse": "Refuse to send, with a message",
}
assert tuple(POLICY_LABELS) == POLICIES, "a label for every policy the engine fits by"


def refusal(fit: ContextFit) -> str:
    """The one-line message when a conversation cannot be sent."""
    what = fit.limited_by
    need = fit.full_tokens + fit.reply_room
    if fit.policy == "refuse":
        advice = (
            "start a new conversation, branch from an earlier message, or choose "
            "Chat › At the context limit › Drop the oldest turns"
        )
    else:
        advice = "even the last message alone is too long: shorten it"
        if what == "KV pool":
            advice += " or raise the KV budget"
    return (
        f"This turn needs {need:,} tokens ({fit.full_tokens:,} of prompt and {fit.reply_room:,} for the "
        f"reply) but the {what} holds {fit.limit:,}: {advice}."
    )
