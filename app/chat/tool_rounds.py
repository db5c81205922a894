"""The chat controller's tool calls: the model's calls read by the engine (ToolCallsParsed) become
cards under its reply, each runs once the user approves it (or at once for a tool allowed in
this chat) on its MCP server (app.tools.registry), and when every call has its outcome the
results go back to the model in the next reply, which answers the call message in the
conversation tree. The calls and their results are kept in the reply's metadata ("tool_calls"),
so the tree, its branches and its exports hold them; the next reply's prompt spells them out as
the model's chat template takes tool turns (engine.tools.render).

A mixin of ChatController (app.chat.controller).
"""

from __future__ import annotations

import dataclasses
import json

from app.chat.chat_settings import ChatSettings
from app.chat.reply_state import ReplyPlan
from app.chat.tool_card import ToolCallCard, raw_tokens_html
from app.chat.tree import StoredMessage
from app.chat.view import MessageBubble
from app.tools.mcp_hub import ToolOutcome
from engine.events import ToolCall, ToolCallsParsed
from engine.request import ChatMessage, ToolSpec

# Replies in a row that may call tools before the chat waits for the user: a model that calls a
# tool again after every result would otherwise run on without end.
MAX_TOOL_ROUNDS = 6
UNRESOLVED = ("pending", "running")


def tool_record(event: ToolCallsParsed, server_of: dict[str, str] | None = None) -> dict:
    """What a reply keeps of its calls (its meta's "tool_calls")."""
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


def calls_of(message: StoredMessage) -> dict | None:
    record = (message.meta or {}).get("tool_calls") if message.role == "assistant" else None
    return record if isinstance(record, dict) else None


def result_for_model(call: dict) -> str:
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
    calls = [c for c in (record or {}).get("calls") or () if isinstance(c, dict)]
    if record is None or record.get("error") or not calls:
        return [ChatMessage(message.role, message.content)]
    made = tuple(ToolCall(str(c["name"]), str(c.get("arguments", "{}")), str(c.get("id", ""))) for c in calls)
    turns = [ChatMessage("assistant", str(record.get("content", "")), tool_calls=made)]
    for call in calls:
        turns.append(
            ChatMessage(
                "tool", result_for_model(call), tool_call_id=str(call.get("id", "")), name=str(call["name"])
            )
        )
    return turns


class ToolRounds:
    # ---- the chat's settings ----------------------------------------------------------------
    @property
    def chat_settings(self) -> ChatSettings:
        return self._chat_settings

    def set_chat_settings(self, settings: ChatSettings) -> None:
        """The chat's structured output and tools (kept with its conversation once there is one)."""
        self._chat_settings = settings
        self._save_chat_settings()
        self.pane.show_chat_settings(settings, self._tool_summary(), self._tool_names())
        self.schedule_measure()

    def _save_chat_settings(self) -> None:
        if self.conversation is not None:
            data = self._chat_settings.to_dict()
            self._write(lambda: self.store.set_settings(self.conversation.id, data))
            self.conversation.settings = data

    def _load_chat_settings(self) -> None:
        """An opened conversation's own settings (a new one keeps what the pane shows)."""
        if self.conversation is not None and self.conversation.settings is not None:
            self._chat_settings = ChatSettings.from_dict(self.conversation.settings)
        self.pane.show_chat_settings(self._chat_settings, self._tool_summary(), self._tool_names())

    def _tool_summary(self) -> str:
        if self.tools is None:
            return "no MCP servers"
        specs = self.tools.tool_specs()
        servers = len(self.tools.servers)
        return f"{len(specs)} tools from {servers} MCP server{'s' if servers != 1 else ''}"

    def _tool_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.tools.tool_specs()) if self.tools is not None else ()

    def refresh_tools(self) -> None:
        """The MCP servers changed (connected, failed, added): the pane's row says so."""
        self.pane.show_chat_settings(self._chat_settings, self._tool_summary(), self._tool_names())

    def _chat_sampling(self):
        """The sampling controls' settings under this chat's structured output."""
        return dataclasses.replace(self._base_sampling(), grammar=self._chat_settings.grammar)

    def _tool_offer(self, plan: ReplyPlan) -> tuple[tuple[ToolSpec, ...], str, str]:
        """(tools, tool_choice, tool name) the reply's request offers. The chat's choice holds
        for the reply to a message; a reply that reads results decides for itself."""
        settings = self._chat_settings
        if not settings.tools or self.tools is None:
            return (), "auto", ""
        specs = self.tools.tool_specs()
        if not specs:
            return (), "auto", ""
        answers_results = plan.kind == "tool_results" or (
            plan.kind != "send" and plan.history and plan.history[-1].role == "assistant"
        )
        choice = "auto" if answers_results else settings.tool_choice
        if choice in ("auto", "required"):
            return specs, choice, ""
        if choice in {s.name for s in specs}:
            return specs, "named", choice
        return specs, "auto", ""

    # ---- the calls of a finished reply ---------------------------------------------------------
    def _on_tool_calls_parsed(self, event: ToolCallsParsed) -> None:
        a = self.active
        if a is not None and self._is_active(event.request_id) and event.branch == 0 and a.group is None:
            a.tool_calls = event

    def _with_tool_calls(self, a, meta: dict | None) -> dict | None:
        """A finished reply's meta with the calls it made (when it made any, or tried to)."""
        event = a.tool_calls
        if event is None or (not event.calls and not event.error):
            return meta
        servers = {name: tool.server for name, tool in self.tools.tools()} if self.tools is not None else {}
        out = dict(meta or {})
        out["tool_calls"] = tool_record(event, servers)
        return out

    def _show_tool_cards(self, bubble: MessageBubble, message: StoredMessage) -> None:
        """The cards of a reply's calls under its bubble (again from its meta when reloaded)."""
        record = calls_of(message)
        bubble.clear_cards()
        if record is None:
            return
        raw = raw_tokens_html(self._call_tokens(message, record), str(record.get("raw", "")))
        if record.get("error"):
            bubble.add_card(ToolCallCard(None, raw, error=str(record["error"])))
            return
        for i, call in enumerate(record.get("calls") or []):
            card = ToolCallCard(call, raw if i == 0 else "")
            if i:
                card.raw.hide()
            card.run_requested.connect(lambda cid, m=message: self.run_tool_call(m.id, cid))
            card.allow_requested.connect(lambda cid, m=message: self.run_tool_call(m.id, cid, always=True))
            card.deny_requested.connect(lambda cid, m=message: self.deny_tool_call(m.id, cid))
            bubble.add_card(card)

    def _call_tokens(self, message: StoredMessage, record: dict) -> list[str]:
        """The calls' tokens as this session streamed them (none after a restart)."""
        kept = self._records.get(message.id)
        if kept is None or kept.generation != self.host.generation:
            return []
        start, end = int(record.get("token_start", 0)), int(record.get("token_end", 0))
        return [
            t.text_delta
            for t in kept.tokens
            if t.request_id == kept.request_id and start <= t.index < end and t.text_delta
        ]

    def _card_of(self, message_id: int, call_id: str) -> ToolCallCard | None:
        for bubble in self.pane.transcript.bubbles:
            if bubble.message_id == message_id:
                return next((c for c in bubble.cards if getattr(c, "call_id", None) == call_id), None)
        return None

    def _update_call(self, message: StoredMessage, call_id: str, **fields) -> dict | None:
        record = calls_of(message)
        call = next((c for c in (record or {}).get("calls") or [] if c.get("id") == call_id), None)
        if call is None:
            return None
        call.update(fields)
        self._write(
            lambda: self.store.update_message(
                message.id, message.content, message.finish_reason, message.meta
            )
        )
        card = self._card_of(message.id, call_id)
        if card is not None:
            card.show_call(call)
        return call

    # ---- approval and running -----------------------------------------------------------------
    def _start_tool_round(self, message: StoredMessage) -> None:
        """A reply with calls ended: run those the chat allows, ask about the others."""
        record = calls_of(message)
        if record is None:
            return
        if record.get("error"):
            self.status_message.emit(
                f"The model wrote a tool call that does not parse: {record['error']}", "error"
            )
            return
        allowed = set(self._chat_settings.allowed_tools)
        waiting = 0
        for call in record.get("calls") or []:
            if call.get("status") != "pending":
                continue
            if call["name"] in allowed:
                self.run_tool_call(message.id, call["id"])
            else:
                waiting += 1
        if waiting:
            self.status_message.emit(
                f"The model asks to run {waiting} tool call{'s' if waiting > 1 else ''}: approve or deny "
                "it under the reply",
                "info",
            )
        self._after_calls(message)

    def run_tool_call(self, message_id: int, call_id: str, always: bool = False) -> bool:
        message = self.conversation.nodes.get(message_id) if self.conversation else None
        if message is None:
            return False
        record = calls_of(message) or {}
        call = next((c for c in record.get("calls") or [] if c.get("id") == call_id), None)
        if call is None or call.get("status") != "pending":
            return False
        if always and call["name"] not in self._chat_settings.allowed_tools:
            allowed = (*self._chat_settings.allowed_tools, call["name"])
            self.set_chat_settings(dataclasses.replace(self._chat_settings, allowed_tools=allowed))
        if self.tools is None:
            self._update_call(message, call_id, status="error", result="no MCP servers are set up")
            self._after_calls(message)
            return False
        try:
            arguments = json.loads(call.get("arguments") or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            self._update_call(message, call_id, status="error", result="the arguments are not a JSON object")
            self._after_calls(message)
            return False
        self._update_call(message, call_id, status="running")

        def done(outcome: ToolOutcome, m=message, cid=call_id) -> None:
            self._update_call(
                m,
                cid,
                status=outcome.status,
                result=outcome.text,
                size=outcome.size,
                truncated=outcome.truncated,
                seconds=round(outcome.seconds, 3),
            )
            self._after_calls(m)

        self.tools.call(call["name"], arguments, done)
        if always:  # the other calls of that tool in this reply need no asking either
            for other in record.get("calls") or []:
                if other is not call and other["name"] == call["name"] and other.get("status") == "pending":
                    self.run_tool_call(message_id, other["id"])
        return True

    def deny_tool_call(self, message_id: int, call_id: str) -> None:
        message = self.conversation.nodes.get(message_id) if self.conversation else None
        if message is not None:
            self._update_call(message, call_id, status="denied")
            self._after_calls(message)

    def _after_calls(self, message: StoredMessage) -> None:
        """Every call has its outcome: the results go to the model in the next reply."""
        record = calls_of(message)
        calls = (record or {}).get("calls") or []
        if not calls or any(c.get("status") in UNRESOLVED for c in calls):
            return
        conv = self.conversation
        if conv is None or conv.leaf_id != message.id:
            return  # the conversation moved on (another branch is shown): nothing more is sent
        if self._tool_rounds_before(message) >= MAX_TOOL_ROUNDS:
            self.status_message.emit(
                f"Stopped after {MAX_TOOL_ROUNDS} replies in a row that called tools: send a message to go on.",
                "info",
            )
            return
        if self.busy:
            return
        self._prepare(ReplyPlan("tool_results", conv.path_to(message.id), self._sampling()))

    def _tool_rounds_before(self, message: StoredMessage) -> int:
        """Replies that called tools since the last user message, this one included."""
        rounds = 0
        for m in reversed(self.conversation.path_to(message.id)):
            if m.role == "user":
                break
            rounds += calls_of(m) is not None
        return rounds

    def _skip_pending_calls(self) -> None:
        """The user sends a new message while calls wait: they are not run."""
        for message in self.conversation.messages if self.conversation else []:
            for call in (calls_of(message) or {}).get("calls") or []:
                if call.get("status") == "pending":
                    self._update_call(message, call["id"], status="skipped")

    # ---- the KV blocks a result went into ----------------------------------------------------
    def _measure_result_blocks(self, a) -> None:
        """The reply that reads results has its prompt in the cache: find the blocks that hold
        the results of the calls it answers (their positions in its prompt, from the engine)."""
        a.blocks_asked = True
        answered = a.plan.history[-1] if a.plan.history else None
        record = calls_of(answered) if answered is not None else None
        request = self.host.request(a.record.request_id)
        if record is None or request is None or not self.calls.local:
            return
        calls = record.get("calls") or []
        request_id = a.record.request_id

        def found(spans) -> None:
            mine = list(spans)[-len(calls) :] if calls else []
            page = self.host.live.page_map
            for call, (start, end) in zip(calls, mine):
                if start < 0:
                    self._update_call(
                        answered, call["id"], blocks_note="the template left the result out of the prompt"
                    )
                    continue
                blocks = sorted(
                    b
                    for b in range(page.num_blocks)
                    if request_id in page.owners[b]
                    and (span := page.token_range(b)) is not None
                    and span[0] < end
                    and span[1] > start
                )
                self._update_call(answered, call["id"], blocks=blocks, result_tokens=[start, end])

        self.calls.ask(lambda engine: engine.prompt_spans(request), found, lambda _m: None)
