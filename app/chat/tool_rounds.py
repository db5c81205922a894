"""The chat's tool calls: the model's calls read by the engine (ToolCallsParsed) become cards
under its reply (app.chat.tool_card), each runs once the user approves it (or at once for a tool
allowed in this chat) on its MCP server (app.tools.registry), and when every call has its
outcome the results go back to the model in the next reply, which answers the call message in
the conversation tree. The calls and their outcomes are kept in the reply's meta
(app.chat.tool_turns), so the tree, its branches and its exports hold them. Once the reply that
reads the results has its prompt in the cache, each result's card names the KV blocks it took."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from app.chat.bubble import MessageBubble
from app.chat.chat_options import ChatOptions
from app.chat.conversations import ConversationStore
from app.chat.reply_state import ActiveReply, ReplyPlan
from app.chat.session import ChatSession, ChatSignals, write_or_say
from app.chat.tool_card import ToolCallCard, raw_tokens_html
from app.chat.tool_turns import UNRESOLVED, call_list, calls_of, find_call, tool_record
from app.chat.tree import StoredMessage
from app.chat.view import ChatPane
from app.engine_calls import EngineCalls
from app.engine_host import EngineHost
from app.tools.mcp_hub import ToolOutcome
from engine.events import ToolCallsParsed

# Replies in a row that may call tools before the chat waits for the user: a model that calls a
# tool again after every result would otherwise run on without end.
MAX_TOOL_ROUNDS = 6


class ToolRounds:
    def __init__(
        self,
        pane: ChatPane,
        store: ConversationStore,
        host: EngineHost,
        calls: EngineCalls,
        session: ChatSession,
        signals: ChatSignals,
        options: ChatOptions,
        prepare: Callable[[ReplyPlan], bool],
    ) -> None:
        self.pane, self.store, self.host, self.calls = pane, store, host, calls
        self.session, self.signals, self.options = session, signals, options
        self._prepare = prepare  # start a reply (app.chat.streaming.ReplyStreaming.prepare)

    # ---- the calls of a finished reply ---------------------------------------------------------
    def on_tool_calls_parsed(self, event: ToolCallsParsed) -> None:
        """The engine's reading of the reply streaming now (it comes just before its end)."""
        a = self.session.active
        if (
            a is not None
            and a.record.request_id == event.request_id
            and a.record.generation == self.host.generation
            and event.branch == 0
            and a.group is None
        ):
            a.tool_calls = event

    def with_tool_calls(self, a: ActiveReply, meta: dict[str, Any] | None) -> dict[str, Any] | None:
        """A finished reply's meta with the calls it made (when it made any, or tried to)."""
        event = a.tool_calls
        if event is None or (not event.calls and not event.error):
            return meta
        tools = self.options.tools
        servers = {name: tool.server for name, tool in tools.tools()} if tools is not None else {}
        out = dict(meta or {})
        out["tool_calls"] = tool_record(event, servers)
        return out

    def show_cards(self, bubble: MessageBubble, message: StoredMessage) -> None:
        """The cards of a reply's calls under its bubble (again from its meta when reloaded)."""
        record = calls_of(message)
        bubble.clear_tool_cards()
        if record is None:
            return
        raw = raw_tokens_html(self._call_tokens(message, record), str(record.get("raw", "")))
        if record.get("error"):
            bubble.add_tool_card(ToolCallCard(None, raw, error=str(record["error"])))
            return
        for i, call in enumerate(call_list(record)):
            card = ToolCallCard(call, raw if i == 0 else "")
            if i:
                card.raw.hide()
            card.run_requested.connect(lambda cid, m=message: self.run_call(m.id, cid))
            card.allow_requested.connect(lambda cid, m=message: self.run_call(m.id, cid, always=True))
            card.deny_requested.connect(lambda cid, m=message: self.deny_call(m.id, cid))
            bubble.add_tool_card(card)

    def _call_tokens(self, message: StoredMessage, record: dict[str, Any]) -> list[str]:
        """The calls' tokens as this session streamed them (none after a restart)."""
        kept = self.session.records.get(message.id)
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
                return next(
                    (c for c in bubble.tool_cards if isinstance(c, ToolCallCard) and c.call_id == call_id),
                    None,
                )
        return None

    def _update_call(self, message: StoredMessage, call_id: str, **fields: Any) -> None:
        """A call's outcome (or how far it got) into the reply's meta, the database and its card."""
        call = find_call(message, call_id)
        if call is None:
            return
        call.update(fields)
        write_or_say(
            self.signals,
            lambda: self.store.update_message(
                message.id, message.content, message.finish_reason, message.meta
            ),
        )
        card = self._card_of(message.id, call_id)
        if card is not None:
            card.show_call(call)

    # ---- approval and running -----------------------------------------------------------------
    def start_round(self, message: StoredMessage) -> None:
        """A reply with calls ended: run those the chat allows, ask about the others."""
        record = calls_of(message)
        if record is None:
            return
        if record.get("error"):
            self.signals.status(
                f"The model wrote a tool call that does not parse: {record['error']}", "error"
            )
            return
        allowed = set(self.options.settings.allowed_tools)
        waiting = 0
        for call in call_list(record):
            if call.get("status") != "pending":
                continue
            if call.get("name") in allowed:
                self.run_call(message.id, str(call.get("id")))
            else:
                waiting += 1
        if waiting:
            self.signals.status(
                f"The model asks to run {waiting} tool call{'s' if waiting > 1 else ''}: approve or deny "
                "it under the reply",
                "info",
            )
        self._after_calls(message)

    def run_call(self, message_id: int, call_id: str, always: bool = False) -> bool:
        """Run a pending call on its server (`always`: and every call of that tool in this chat
        from now on). False when it is not a pending call of this conversation."""
        message = self.session.message(message_id)
        call = find_call(message, call_id) if message is not None else None
        if message is None or call is None or call.get("status") != "pending":
            return False
        name = str(call.get("name"))
        if always:
            self.options.allow(name)
        registry = self.options.tools
        if registry is None:
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

        def done(outcome: ToolOutcome) -> None:
            self._update_call(
                message,
                call_id,
                status=outcome.status,
                result=outcome.text,
                size=outcome.size,
                truncated=outcome.truncated,
                seconds=round(outcome.seconds, 3),
            )
            self._after_calls(message)

        registry.call(name, arguments, done)
        if always:  # the other calls of that tool in this reply need no asking either
            for other in call_list(calls_of(message)):
                if other is not call and other.get("name") == name and other.get("status") == "pending":
                    self.run_call(message_id, str(other.get("id")))
        return True

    def deny_call(self, message_id: int, call_id: str) -> None:
        message = self.session.message(message_id)
        if message is not None:
            self._update_call(message, call_id, status="denied")
            self._after_calls(message)

    def _after_calls(self, message: StoredMessage) -> None:
        """Every call has its outcome: the results go to the model in the next reply."""
        calls = call_list(calls_of(message))
        if not calls or any(c.get("status") in UNRESOLVED for c in calls):
            return
        conv = self.session.conversation
        if conv is None or conv.leaf_id != message.id:
            return  # the conversation moved on (another branch is shown): nothing more is sent
        if self._rounds_before(message) >= MAX_TOOL_ROUNDS:
            self.signals.status(
                f"Stopped after {MAX_TOOL_ROUNDS} replies in a row that called tools: send a message to go on.",
                "info",
            )
            return
        if self.session.busy:
            return
        self._prepare(ReplyPlan("tool_results", conv.path_to(message.id), self.options.sampling()))

    def _rounds_before(self, message: StoredMessage) -> int:
        """Replies that called tools since the last user message, this one included."""
        conv = self.session.conversation
        rounds = 0
        for m in reversed(conv.path_to(message.id) if conv is not None else []):
            if m.role == "user":
                break
            rounds += calls_of(m) is not None
        return rounds

    def skip_pending(self) -> None:
        """The user sends a new message while calls wait: they are not run."""
        for message in self.session.path:
            for call in call_list(calls_of(message)):
                if call.get("status") == "pending":
                    self._update_call(message, str(call.get("id")), status="skipped")

    # ---- the KV blocks a result went into ----------------------------------------------------
    def measure_result_blocks(self, a: ActiveReply) -> None:
        """The reply that reads results has its prompt in the cache: find the blocks that hold
        the results of the calls it answers (their positions in its prompt, from the engine)."""
        a.blocks_asked = True
        answered = a.plan.history[-1] if a.plan.history else None
        calls = call_list(calls_of(answered)) if answered is not None else []
        request_id = a.record.request_id
        request = self.host.request(request_id)
        if answered is None or not calls or request is None or not self.calls.local:
            return

        def found(spans: Sequence[tuple[int, int]]) -> None:
            mine = list(spans)[-len(calls) :]
            page = self.host.live.page_map
            for call, (start, end) in zip(calls, mine):
                call_id = str(call.get("id"))
                if start < 0:
                    self._update_call(
                        answered, call_id, blocks_note="the template left the result out of the prompt"
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
                self._update_call(answered, call_id, blocks=blocks, result_tokens=[start, end])

        self.calls.ask(lambda engine: engine.prompt_spans(request), found, lambda _m: None)
