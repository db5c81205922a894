"""A reply's tool calls as the conversation keeps them and as the model reads them again.

A reply that called tools keeps its calls and their outcomes in its meta ("tool_calls"): the
format the model wrote them in, the text around them, the raw call text with its token range,
a parse error when they did not parse, and each call (id, name, arguments, status, result,
server, and the KV blocks its result took once the next reply read it). In a prompt such a
reply is two kinds of turn: the assistant's call, then one tool turn per result, as the model's
chat template takes them (engine.tools.render)."""

from __future__ import annotations

from typing import Any

from app.chat.tree import StoredMessage
from engine.events import ToolCall, ToolCallsParsed
from engine.request import ChatMessage

# A call still waiting for its outcome (the user's approval, or the tool itself).
UNRESOLVED = ("pending", "running")


def tool_record(event: ToolCallsParsed, server_of: dict[str, str] | None = None) -> dict[str, Any]:
    """What a reply keeps of its calls (its meta's "tool_calls"), every call pending."""
    servers = server_of or {}
    return {
        "format": event.format,
        "content": event.content,
        "raw": event.raw,
        "token_start": event.token_start,
        "token_end": event.token_end,
        "error": event.error,
        "calls": [
            {
                "id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "pending",
                "server": servers.get(c.name, ""),
            }
            for c in event.calls
        ],
    }


def calls_of(message: StoredMessage) -> dict[str, Any] | None:
    """The reply's record of its calls, or None (a user message, a reply without calls)."""
    record = (message.meta or {}).get("tool_calls") if message.role == "assistant" else None
    return record if isinstance(record, dict) else None


def call_list(record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The calls of a record (what another version stored that is no call is left out)."""
    calls = (record or {}).get("calls") or []
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def find_call(message: StoredMessage, call_id: str) -> dict[str, Any] | None:
    return next((c for c in call_list(calls_of(message)) if c.get("id") == call_id), None)


def result_for_model(call: dict[str, Any]) -> str:
    """What the model reads as the answer to a call."""
    status = call.get("status")
    if status == "done":
        return str(call.get("result", ""))
    if status == "error":
        return f"error: {call.get('result') or 'the tool failed'}"
    if status == "timeout":
        return "error: the tool did not answer in time"
    if status == "denied":
        return "error: the user did not allow this call"
    return "error: the call was not run"


def expand(message: StoredMessage) -> list[ChatMessage]:
    """A stored message as the model's turns: a reply that called tools is its call (the text
    around the calls, and the calls) and then each call's result as a tool turn."""
    record = calls_of(message)
    calls = call_list(record)
    if record is None or record.get("error") or not calls:
        return [ChatMessage(message.role, message.content)]
    made = tuple(
        ToolCall(str(c.get("name")), str(c.get("arguments", "{}")), str(c.get("id", ""))) for c in calls
    )
    turns = [ChatMessage("assistant", str(record.get("content", "")), tool_calls=made)]
    for call in calls:
        turns.append(
            ChatMessage(
                "tool",
                result_for_model(call),
                tool_call_id=str(call.get("id", "")),
                name=str(call.get("name")),
            )
        )
    return turns
