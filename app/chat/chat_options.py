"""One chat's structured output and tools (app.chat.chat_settings) as the chat applies them: held
for the tab, kept with its conversation once there is one, shown in the pane's row, laid over
the sampling controls' settings for every reply (the grammar), and turned into what each
reply's request offers (the tools, tool_choice)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from app.chat.chat_settings import ChatSettings
from app.chat.conversations import ConversationStore
from app.chat.reply_state import ReplyPlan
from app.chat.session import ChatSession, ChatSignals, write_or_say
from app.chat.view import ChatPane
from app.tools.registry import ToolRegistry
from engine.config import SamplingParams
from engine.request import ToolSpec

# What a reply's request offers: the tools, tool_choice (auto, required, named), the named tool.
ToolOffer = tuple[tuple[ToolSpec, ...], str, str]
NO_TOOLS: ToolOffer = ((), "auto", "")


class ChatOptions:
    def __init__(
        self,
        pane: ChatPane,
        store: ConversationStore,
        session: ChatSession,
        signals: ChatSignals,
        tools: ToolRegistry | None,
        sampling: Callable[[], SamplingParams],
    ) -> None:
        self.pane, self.store, self.session, self.signals = pane, store, session, signals
        self.tools = tools
        self._base_sampling = sampling
        self.settings = ChatSettings()

    # ---- the setting -------------------------------------------------------------------------
    def set(self, settings: ChatSettings) -> None:
        """The chat's structured output and tools (kept with its conversation once there is one)."""
        self.settings = settings
        self.save()
        self.show()
        self.signals.measure()

    def save(self) -> None:
        """Keep the setting with the conversation (called again when its first message makes it)."""
        conv = self.session.conversation
        if conv is not None:
            data = self.settings.to_dict()
            write_or_say(self.signals, lambda: self.store.set_settings(conv.id, data))
            conv.settings = data

    def load(self) -> None:
        """An opened conversation's own setting (a new one keeps what the pane shows)."""
        conv = self.session.conversation
        if conv is not None and conv.settings is not None:
            self.settings = ChatSettings.from_dict(conv.settings)
        self.show()

    def show(self) -> None:
        """The pane's row follows the setting and the MCP servers (connected, failed, added)."""
        self.pane.show_chat_settings(self.settings, self._tool_summary(), self._tool_names())

    def edit_structured_output(self) -> None:
        from app.chat.structured_dialog import StructuredOutputDialog  # its widgets, when asked for

        dialog = StructuredOutputDialog(self.settings.grammar, self.pane)
        if dialog.exec():
            self.set(dataclasses.replace(self.settings, grammar=dialog.spec()))

    def set_tools(self, on: bool) -> None:
        self.set(dataclasses.replace(self.settings, tools=on))

    def set_tool_choice(self, choice: str) -> None:
        self.set(dataclasses.replace(self.settings, tool_choice=choice or "auto"))

    def allow(self, tool: str) -> None:
        """Run `tool` without asking in this chat from now on."""
        if tool not in self.settings.allowed_tools:
            self.set(dataclasses.replace(self.settings, allowed_tools=(*self.settings.allowed_tools, tool)))

    def _tool_summary(self) -> str:
        if self.tools is None:
            return "no MCP servers"
        specs = self.tools.tool_specs()
        servers = len(self.tools.servers)
        return f"{len(specs)} tools from {servers} MCP server{'s' if servers != 1 else ''}"

    def _tool_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.tools.tool_specs()) if self.tools is not None else ()

    # ---- what each reply asks ------------------------------------------------------------------
    def sampling(self) -> SamplingParams:
        """The sampling controls' settings under this chat's structured output."""
        return dataclasses.replace(self._base_sampling(), grammar=self.settings.grammar)

    def tool_offer(self, plan: ReplyPlan) -> ToolOffer:
        """(tools, tool_choice, tool name) the reply's request offers. The chat's choice holds
        for the reply to a message; a reply that reads results decides for itself."""
        settings = self.settings
        if not settings.tools or self.tools is None:
            return NO_TOOLS
        specs = self.tools.tool_specs()
        if not specs:
            return NO_TOOLS
        answers_results = plan.kind == "tool_results" or (
            plan.kind != "send" and bool(plan.history) and plan.history[-1].role == "assistant"
        )
        choice = "auto" if answers_results else settings.tool_choice
        if choice in ("auto", "required"):
            return specs, choice, ""
        if choice in {s.name for s in specs}:
            return specs, "named", choice
        return specs, "auto", ""
