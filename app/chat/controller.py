"""The chat's behaviour: turns user actions into engine requests and stored messages, and the
engine's tokens into a streaming reply that is saved as it grows.

Owns the current conversation (None until its first message, so opening the app does not pile
up empty conversations), the reply in flight (or being measured before it starts) and the token
selection shown in the probability panel. The work is split by concern into mixins:

  app.chat.crud       conversations, the transcript of the visible path, forks (◀ 2/3 ▶)
  app.chat.branching  send / edit, regenerate, branch from a token, continue: each a new branch
  app.chat.streaming  a plan measured and started, the reply streaming in and stored
  app.chat.context    the context meter
  app.chat.keep       keeping one of a reply's alternatives (n samples, beams)
  app.chat.pinning    hovering and pinning tokens for the probability panel
  app.chat.tool_rounds the chat's structured output and tools: tool calls as cards, approved,
                      run on their MCP servers, their results read by the next reply

A reply asked for as n samples or by beam search streams into a `GroupReplyCard`; the engine's
best is stored as the message until the user keeps another alternative.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer, Signal

from app.chat.branching import Branching
from app.chat.chat_settings import ChatSettings
from app.chat.context import MEASURE_DELAY_MS, ContextTracking
from app.chat.context_fit import DEFAULT_POLICY, ContextFit
from app.chat.conversation_list import ConversationList
from app.chat.conversations import Conversation, ConversationStore, StorageError
from app.chat.crud import ConversationActions
from app.chat.keep import KeepAlternative
from app.chat.pinning import TokenPinning
from app.chat.reply_state import ActiveReply, ReplyPlan, ReplyRecord
from app.chat.streaming import ReplyStreaming
from app.chat.tool_rounds import ToolRounds
from app.chat.view import ChatPane, MessageBubble
from app.engine_calls import EngineCalls
from app.engine_host import EngineHost
from app.tools.registry import ToolRegistry
from engine.config import SamplingParams

__all__ = ["ActiveReply", "ChatController", "ReplyRecord"]


class ChatController(
    QObject,
    ConversationActions,
    Branching,
    ReplyStreaming,
    ContextTracking,
    KeepAlternative,
    TokenPinning,
    ToolRounds,
):
    token_inspected = Signal(object, object)  # request id | None, token index | None
    status_message = Signal(str, str)  # text, kind: "error" | "info"
    reply_started = Signal(int)  # the request id of a reply just submitted to the engine
    reply_refused = Signal(str)  # nothing was sent, and why (the input keeps what was typed)
    servers_wanted = Signal()  # the user asked to manage the MCP servers

    def __init__(
        self,
        pane: ChatPane,
        sidebar: ConversationList,
        store: ConversationStore,
        host: EngineHost,
        sampling: Callable[[], SamplingParams],
        parent: QObject | None = None,
        context_policy: Callable[[], str] = lambda: DEFAULT_POLICY,
        tools: ToolRegistry | None = None,
    ):
        super().__init__(parent)
        self.pane, self.sidebar, self.store, self.host = pane, sidebar, store, host
        # Every reply's sampling: the controls' settings under this chat's structured output.
        self._base_sampling = sampling
        self._sampling = self._chat_sampling
        self._chat_settings = ChatSettings()
        self.tools = tools
        self.context_policy = context_policy
        self.calls = EngineCalls(host, self)
        self.conversation: Conversation | None = None
        self.active: ActiveReply | None = None
        self.preparing: ReplyPlan | None = None
        self._records: dict[int, ReplyRecord] = {}  # message id -> this session's reply data
        self._editing_id: int | None = None
        self._pinned: tuple[int, int] | None = None  # (request id, token index)
        self._pinned_bubble: MessageBubble | None = None
        self._pinned_position: int | None = None
        self.last_fit: ContextFit | None = None
        self._measuring = self._measure_again = False
        self._measure_timer = QTimer(self)
        self._measure_timer.setSingleShot(True)
        self._measure_timer.setInterval(MEASURE_DELAY_MS)
        self._measure_timer.timeout.connect(self.measure_now)

        pane.send_requested.connect(self.send)
        pane.stop_requested.connect(self.stop)
        pane.regenerate_requested.connect(self.regenerate)
        pane.edit_requested.connect(self.edit_last)
        pane.edit_cancelled.connect(self.cancel_edit)
        pane.system_prompt_edited.connect(self._on_system_prompt_edited)
        pane.input.textChanged.connect(self.schedule_measure)
        sidebar.new_requested.connect(self.new_conversation)
        sidebar.chosen.connect(self.open_conversation)
        sidebar.search_changed.connect(self.search)
        sidebar.hit_chosen.connect(self.open_message)
        host.tokens_generated.connect(self._on_tokens)
        host.request_finished.connect(self._on_finished)
        host.request_failed.connect(self._on_failed)
        host.status_changed.connect(self.sync_state)
        host.model_loaded.connect(self.schedule_measure)
        host.frame.connect(self._on_frame)
        host.tool_calls_parsed.connect(self._on_tool_calls_parsed)
        pane.structured_requested.connect(self.edit_structured_output)
        pane.tools_toggled.connect(self._on_tools_toggled)
        pane.tool_choice_chosen.connect(self._on_tool_choice)
        pane.servers_requested.connect(self.servers_wanted)
        if tools is not None:
            tools.changed.connect(self.refresh_tools)
        self.refresh_sidebar()
        self.refresh_tools()
        self.sync_state()

    def edit_structured_output(self) -> None:
        from app.chat.structured_dialog import StructuredOutputDialog

        dialog = StructuredOutputDialog(self._chat_settings.grammar, self.pane)
        if dialog.exec():
            self.set_chat_settings(dataclasses.replace(self._chat_settings, grammar=dialog.spec()))

    def _on_tools_toggled(self, on: bool) -> None:
        self.set_chat_settings(dataclasses.replace(self._chat_settings, tools=on))

    def _on_tool_choice(self, choice: str) -> None:
        self.set_chat_settings(dataclasses.replace(self._chat_settings, tool_choice=choice or "auto"))

    def _on_system_prompt_edited(self, text: str) -> None:
        if self.conversation is not None:
            try:
                self.store.set_system_prompt(self.conversation.id, text)
                self.conversation.system_prompt = text
            except StorageError as exc:
                self.status_message.emit(str(exc), "error")
        self.schedule_measure()

    def sync_state(self) -> None:
        status = self.host.status()
        msgs = self.conversation.messages if self.conversation else []
        busy = self.busy
        self.pane.set_state(
            model_ready=status.ready,
            loading=status.loading,
            generating=busy,
            can_regenerate=bool(msgs),
            can_edit=self._last_user_index() is not None,
        )
        self._sync_keep_buttons(busy)
        self.sidebar.setEnabled(not busy)
        self.sidebar.setToolTip("Stop the reply to switch conversations" if busy else "")
        for bubble in self.pane.transcript.bubbles:
            bubble.set_busy(busy)
