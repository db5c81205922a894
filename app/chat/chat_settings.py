"""What one chat asks of every reply beyond the sampling settings: a structured output (a JSON
Schema, any JSON object, a regex, a Lark or GBNF grammar, or a list of choices) and the tools
its replies may call, with the ones the user lets run without asking. Kept with the
conversation (app.chat.conversations), so each chat tab has its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError, GrammarSpec

# tool_choice for the reply to a new message: the model decides, must call one, or a named one.
# (The replies that read the results always decide for themselves: auto.)
TOOL_CHOICES = ("auto", "required")


@dataclass(frozen=True, slots=True)
class ChatSettings:
    grammar: GrammarSpec | None = None
    tools: bool = False  # offer the MCP servers' tools to the model
    tool_choice: str = "auto"  # "auto", "required", or the name of a tool to call
    allowed_tools: tuple[str, ...] = ()  # tools that run without the user's approval here

    def to_dict(self) -> dict[str, Any]:
        return {
            "grammar": None
            if self.grammar is None
            else {"kind": self.grammar.kind, "text": self.grammar.text},
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "allowed_tools": list(self.allowed_tools),
        }

    @staticmethod
    def from_dict(raw: Any) -> ChatSettings:
        """A stored setting; anything unreadable (another version's) is left at its default."""
        if not isinstance(raw, dict):
            return ChatSettings()
        grammar = None
        spec = raw.get("grammar")
        if isinstance(spec, dict):
            try:
                grammar = GrammarSpec(str(spec.get("kind")), str(spec.get("text", "")))
            except ConfigError:
                grammar = None
        allowed = raw.get("allowed_tools")
        choice = raw.get("tool_choice")
        return ChatSettings(
            grammar,
            raw.get("tools") is True,
            choice if isinstance(choice, str) and choice else "auto",
            tuple(a for a in allowed if isinstance(a, str)) if isinstance(allowed, list) else (),
        )

    def describe(self) -> str:
        """The settings in a few words (the chat pane's row)."""
        grammar = "off" if self.grammar is None else self.grammar.label
        return grammar
