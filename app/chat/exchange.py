"""Conversations out of and into kvscope: Markdown of the visible path, JSON of the whole tree or
of the path, and the import of such JSON.

The JSON numbers its messages 1..n in creation order (parents before children) instead of using
database ids, so importing an export and exporting the import gives the same bytes. An export of
the first release's format (a flat list of messages) imports as one line. A reply that called
tools keeps its calls and their results in its `meta` ("tool_calls"), and the chat's structured
output and tools are the conversation's `settings`: both go out and come back with the rest.
"""

from __future__ import annotations

import json
import math
from typing import Any

from app.chat.conversations import ConversationStore, StorageError
from app.chat.tree import Conversation, StoredMessage

FORMAT = "kvscope-conversation"
VERSION = 2
SCOPES = ("tree", "path")
ROLES = ("user", "assistant")


class ImportFailed(StorageError):
    """The file is not a conversation kvscope can import; str() says why, in one line."""


# ---- export ----------------------------------------------------------------------------------
def export_markdown(conv: Conversation) -> str:
    """The visible path; at a fork, which of its alternatives this is."""
    parts = [f"# {conv.title}", ""]
    if conv.system_prompt:
        parts += ["**System**", "", conv.system_prompt, ""]
    for msg in conv.messages:
        label = "User" if msg.role == "user" else "Assistant"
        if msg.role == "assistant" and msg.finish_reason not in (None, "stop"):
            label += f" ({msg.finish_reason})"
        position, count = conv.fork_position(msg) if msg.id in conv.nodes else (1, 1)
        if count > 1:
            label += f" — version {position} of {count}"
        parts += [f"**{label}**", "", msg.content, ""]
        parts += _tool_calls_markdown(msg.meta)
    return "\n".join(parts).rstrip() + "\n"


def _tool_calls_markdown(meta: dict[str, Any] | None) -> list[str]:
    """A reply's tool calls and what came back, under it."""
    record = (meta or {}).get("tool_calls")
    if not isinstance(record, dict):
        return []
    lines: list[str] = []
    if record.get("error"):
        lines += [f"*Tool call that did not parse: {record['error']}*", ""]
    for call in record.get("calls") or []:
        if not isinstance(call, dict):
            continue
        lines += [
            f"**Tool call** `{call.get('name')}` {call.get('arguments', '')} — {call.get('status', '?')}",
            "",
        ]
        if call.get("result"):
            lines += ["```", str(call["result"]), "```", ""]
    return lines


def export_json(conv: Conversation, scope: str = "tree") -> str:
    """The whole tree ("tree") or only the visible path ("path") as kvscope's JSON."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if scope == "tree" and conv.nodes:
        chosen = sorted(conv.nodes.values(), key=lambda m: m.id)
    else:
        chosen = list(conv.messages)
    local = {m.id: i + 1 for i, m in enumerate(chosen)}
    leaf = conv.messages[-1].id if conv.messages else None
    data = {
        "format": FORMAT,
        "version": VERSION,
        "scope": scope,
        "title": conv.title,
        "system_prompt": conv.system_prompt,
        "created_at": conv.created_at,
        "updated_at": conv.updated_at,
        "current": local.get(leaf) if leaf is not None else None,
        "settings": conv.settings,
        "messages": [
            {
                "id": local[m.id],
                "parent": local.get(m.parent_id) if m.parent_id is not None else None,
                "role": m.role,
                "content": m.content,
                "finish_reason": m.finish_reason,
                "model": m.model,
                "created_at": m.created_at,
                "updated_at": m.updated_at,
                "meta": m.meta,
                "token_ids": list(m.token_ids),
            }
            for m in chosen
        ],
    }
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


# ---- import ----------------------------------------------------------------------------------
def import_json(store: ConversationStore, text: str) -> int:
    """Store an exported conversation as a new one; returns its id. ImportFailed says what is
    wrong with a file that is not one (nothing is stored then)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ImportFailed(f"Not a kvscope conversation: the file is not JSON ({exc}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ImportFailed("Not a kvscope conversation: no list of messages in it.")
    if "format" in data and (data.get("format") != FORMAT or not isinstance(data.get("version"), int)):
        raise ImportFailed(f"Not a kvscope conversation: its format is {data.get('format')!r}.")
    if isinstance(data.get("version"), int) and data["version"] > VERSION:
        raise ImportFailed(
            f"This export was written by a newer kvscope (version {data['version']}); update kvscope to import it."
        )
    linear = "format" not in data  # the first release's export: a flat list, each after the last
    messages: list[StoredMessage] = []
    previous: int | None = None
    for i, raw in enumerate(data["messages"]):
        message = _message(raw, i + 1, linear, previous, {m.id for m in messages})
        messages.append(message)
        previous = message.id
    current = data.get("current") if not linear else previous
    if current is not None and current not in {m.id for m in messages}:
        raise ImportFailed(f"Not a kvscope conversation: its current message {current!r} is not in it.")
    return store.insert_tree(
        _text(data, "title", "conversation") or "Imported conversation",
        _text(data, "system_prompt", "conversation"),
        _number(data, "created_at", "conversation"),
        _number(data, "updated_at", "conversation"),
        messages,
        current,
        data.get("settings") if isinstance(data.get("settings"), dict) else None,
    )


def _message(raw: Any, position: int, linear: bool, previous: int | None, seen: set[int]) -> StoredMessage:
    where = f"message {position}"
    if not isinstance(raw, dict):
        raise ImportFailed(f"Not a kvscope conversation: {where} is not an object.")
    role = raw.get("role")
    if role not in ROLES:
        raise ImportFailed(f"Not a kvscope conversation: {where} has role {role!r} (user or assistant).")
    if linear:
        message_id, parent = position, previous
    else:
        raw_id, parent = raw.get("id"), raw.get("parent")
        if not isinstance(raw_id, int) or raw_id in seen:
            raise ImportFailed(f"Not a kvscope conversation: {where} has a missing or repeated id.")
        message_id = raw_id
        if parent is not None and parent not in seen:
            raise ImportFailed(
                f"Not a kvscope conversation: {where} answers a message that comes later or not at all."
            )
    meta = raw.get("meta")
    token_ids = raw.get("token_ids") or []
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and t >= 0 for t in token_ids):
        raise ImportFailed(f"Not a kvscope conversation: {where} has token ids that are not token ids.")
    finish = raw.get("finish_reason")
    model = raw.get("model")
    created = _number(raw, "created_at", where)
    return StoredMessage(
        id=message_id,
        role=role,
        content=_text(raw, "content", where),
        finish_reason=finish if isinstance(finish, str) else None,
        model=model if isinstance(model, str) else None,
        created_at=created,
        meta=meta if isinstance(meta, dict) else None,
        parent_id=parent,
        token_ids=tuple(token_ids),
        updated_at=_number(raw, "updated_at", where) if "updated_at" in raw else created,
    )


def _text(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        raise ImportFailed(f"Not a kvscope conversation: the {key} of {where} is not text.")
    return value


def _number(data: dict[str, Any], key: str, where: str) -> float:
    value = data.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ImportFailed(f"Not a kvscope conversation: the {key} of {where} is not a time.")
    return value
