"""The chat's behaviour: turns user actions into engine requests and stored messages, and the
engine's tokens into a streaming reply that is saved as it grows.

`ChatController` builds the chat's collaborators, each a plain object given what it works with
(the pane, the store, the host, the session's state, the signals), and wires the pane's, the
sidebar's and the host's signals to them:

  app.chat.session     the shared state (conversation, reply in flight, this session's replies)
  app.chat.crud        conversations: new, open, rename, delete, export, import, search
  app.chat.transcript  the transcript of the visible path with its forks (◀ 2/3 ▶)
  app.chat.branching   send / edit, regenerate, branch from a token, continue: each a new branch
  app.chat.streaming   a plan measured and started, the reply streaming in and stored
  app.chat.context     the context meter
  app.chat.keep        keeping one of a reply's alternatives (n samples, beams)
  app.chat.pinning     hovering and pinning tokens for the probability panel
  app.chat.chat_options the chat's structured output and tools, over every reply's settings
  app.chat.tool_rounds tool calls as cards, approved, run on their MCP servers, their results
                       read by the next reply

A reply asked for as n samples or by beam search streams into a `GroupReplyCard`; the engine's
best is stored as the message until the user keeps another alternative.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal, SignalInstance

from app.chat.branching import Branching
from app.chat.chat_options import ChatOptions
from app.chat.chat_settings import ChatSettings
from app.chat.context import ContextTracking
from app.chat.context_fit import DEFAULT_POLICY
from app.chat.conversation_list import ConversationList
from app.chat.conversations import ConversationStore, StorageError
from app.chat.crud import ConversationActions
from app.chat.keep import KeepAlternative
from app.chat.pinning import TokenPinning
from app.chat.reply_state import ActiveReply, ReplyPlan, ReplyRecord
from app.chat.session import ChatSession, ChatSignals
from app.chat.streaming import ReplyStreaming
from app.chat.tool_rounds import ToolRounds
from app.chat.transcript import Transcript
from app.chat.tree import Conversation
from app.chat.view import ChatPane
from app.engine_calls import EngineCalls
from app.engine_host import EngineHost
from app.tools.registry import ToolRegistry
from engine.config import SamplingParams

__all__ = ["ActiveReply", "ChatController", "ReplyRecord"]


class ChatController(QObject):
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
    ) -> None:
        super().__init__(parent)
        self.pane, self.sidebar, self.store, self.host = pane, sidebar, store, host
        self.context_policy = context_policy
        self.session = session = ChatSession()
        self.calls = calls = EngineCalls(host, self)
        signals = ChatSignals(
            status=self.status_message.emit,
            started=self.reply_started.emit,
            refused=self.reply_refused.emit,
            inspected=self.token_inspected.emit,
            sync=self.sync_state,
            measure=self.schedule_measure,
            listed=self.refresh_sidebar,
        )
        self.pinning = TokenPinning(pane, host, session, signals)
        self.keeping = KeepAlternative(pane, store, session, signals)
        # Every reply's sampling: the controls' settings under this chat's structured output.
        self.options = options = ChatOptions(pane, store, session, signals, tools, sampling)
        self.tool_rounds = ToolRounds(
            pane, store, host, calls, session, signals, options, lambda plan: self.streaming.prepare(plan)
        )
        self.transcript = Transcript(
            pane,
            store,
            host,
            session,
            signals,
            self.pinning,
            on_action=lambda bubble, name: self.branching.on_message_action(bubble, name),
            on_keep=self.keeping.keep,
            cards=self.tool_rounds.show_cards,
        )
        self.context = ContextTracking(
            pane,
            host,
            calls,
            session,
            options.sampling,
            context_policy,
            self,
            tools=lambda plan: options.tool_offer(plan)[0],
        )
        self.streaming = ReplyStreaming(
            pane,
            store,
            host,
            calls,
            session,
            signals,
            self.transcript,
            self.context,
            self.pinning,
            context_policy,
            options,
            self.tool_rounds,
        )
        self.branching = Branching(
            pane, host, session, signals, self.streaming, options.sampling, self.tool_rounds.skip_pending
        )
        self.conversations = ConversationActions(
            pane, sidebar, store, session, signals, self.transcript, options
        )

        pane.send_requested.connect(self.branching.send)
        pane.stop_requested.connect(self.streaming.stop)
        pane.regenerate_requested.connect(self.branching.regenerate)
        pane.edit_requested.connect(self.branching.edit_last)
        pane.edit_cancelled.connect(self.branching.cancel_edit)
        pane.system_prompt_edited.connect(self._on_system_prompt_edited)
        pane.input.textChanged.connect(self.schedule_measure)
        sidebar.new_requested.connect(self.conversations.new_conversation)
        sidebar.chosen.connect(self.conversations.open_conversation)
        sidebar.search_changed.connect(self.conversations.search)
        sidebar.hit_chosen.connect(self.conversations.open_message)
        # The host outlives a closed tab: its signals are cut in detach(), not left to reach
        # parts (plain Python objects) whose widgets are deleted.
        self._host_links: list[tuple[SignalInstance, Callable[..., Any]]] = [
            (host.tokens_generated, self.streaming.on_tokens),
            (host.request_finished, self.streaming.on_finished),
            (host.request_failed, self.streaming.on_failed),
            (host.status_changed, self.sync_state),
            (host.model_loaded, self.schedule_measure),
            (host.frame, self.streaming.on_frame),
            (host.tool_calls_parsed, self.tool_rounds.on_tool_calls_parsed),
        ]
        for signal, slot in self._host_links:
            signal.connect(slot)
        pane.structured_requested.connect(options.edit_structured_output)
        pane.tools_toggled.connect(options.set_tools)
        pane.tool_choice_chosen.connect(options.set_tool_choice)
        pane.servers_requested.connect(self.servers_wanted)
        if tools is not None:  # through the controller: a closed tab's controller is disconnected
            tools.changed.connect(self._on_tools_changed)
        self.refresh_sidebar()
        options.show()
        self.sync_state()

    # ---- the state others read ---------------------------------------------------------------
    @property
    def conversation(self) -> Conversation | None:
        return self.session.conversation

    @property
    def active(self) -> ActiveReply | None:
        """The reply streaming now."""
        return self.session.active

    @property
    def preparing(self) -> ReplyPlan | None:
        return self.session.preparing

    @property
    def busy(self) -> bool:
        return self.session.busy

    def detach(self) -> None:
        """Its tab is closing: the host's signals and the engine's pending answers no longer
        reach this chat (its widgets are deleted next)."""
        for signal, slot in self._host_links:
            signal.disconnect(slot)
        self._host_links.clear()
        self.calls.detach()

    def sync_state(self) -> None:
        """The pane's controls, the sidebar and the bubbles follow the state."""
        status = self.host.status()
        busy = self.session.busy
        self.pane.set_state(
            model_ready=status.ready,
            loading=status.loading,
            generating=busy,
            can_regenerate=bool(self.session.path),
            can_edit=self.session.last_user_index() is not None,
        )
        self.keeping.sync_keep_buttons(busy)
        self.sidebar.setEnabled(not busy)
        self.sidebar.setToolTip("Stop the reply to switch conversations" if busy else "")
        for bubble in self.pane.transcript.bubbles:
            bubble.set_busy(busy)

    def schedule_measure(self) -> None:
        """Count the conversation and the draft again soon (the text, path or model changed)."""
        self.context.schedule()

    def _on_tools_changed(self) -> None:
        self.options.show()

    def _on_system_prompt_edited(self, text: str) -> None:
        conv = self.session.conversation
        if conv is not None:
            try:
                self.store.set_system_prompt(conv.id, text)
                conv.system_prompt = text
            except StorageError as exc:
                self.status_message.emit(str(exc), "error")
        self.schedule_measure()

    # ---- what the window and the tabs ask --------------------------------------------------
    def send(self, text: str) -> bool:
        return self.branching.send(text)

    def stop(self) -> None:
        self.streaming.stop()

    def regenerate(self) -> bool:
        return self.branching.regenerate()

    def regenerate_message(self, message_id: int, same_settings: bool = False) -> bool:
        return self.branching.regenerate_message(message_id, same_settings)

    def edit_last(self) -> None:
        self.branching.edit_last()

    def edit_message(self, message_id: int) -> None:
        self.branching.edit_message(message_id)

    def branch_from_token(self, request_id: int, index: int, token_id: int) -> bool:
        return self.branching.branch_from_token(request_id, index, token_id)

    def continue_reply(self, message_id: int) -> bool:
        return self.branching.continue_reply(message_id)

    def new_conversation(self) -> None:
        self.conversations.new_conversation()

    def open_conversation(self, conversation_id: int, leaf_id: int | None = None) -> None:
        self.conversations.open_conversation(conversation_id, leaf_id)

    def open_latest(self) -> None:
        self.conversations.open_latest()

    def refresh_sidebar(self) -> None:
        self.conversations.refresh_sidebar()

    def rename(self, conversation_id: int, title: str) -> None:
        self.conversations.rename(conversation_id, title)

    def delete(self, conversation_id: int) -> None:
        self.conversations.delete(conversation_id)

    def export_to(self, conversation_id: int, fmt: str, path: Path) -> None:
        self.conversations.export_to(conversation_id, fmt, path)

    def import_from(self, path: Path) -> int:
        return self.conversations.import_from(path)

    @property
    def chat_settings(self) -> ChatSettings:
        """This chat's structured output and tools."""
        return self.options.settings

    def set_chat_settings(self, settings: ChatSettings) -> None:
        self.options.set(settings)

    def edit_structured_output(self) -> None:
        self.options.edit_structured_output()

    def inspect_token(self, request_id: int, index: int) -> None:
        self.pinning.inspect_token(request_id, index)

    def forget_token_data(self) -> None:
        self.pinning.forget_token_data()

    def owns_request(self, request_id: int) -> bool:
        """One of this chat's replies on the running engine streamed `request_id`'s tokens."""
        return any(
            r.generation == self.host.generation and any(t.request_id == request_id for t in r.tokens)
            for r in self.session.records.values()
        )
