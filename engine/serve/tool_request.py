"""What a chat request asks of tools, between the server's parsing and the engine's Request."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import ToolSpec


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What a chat request asks of tools (engine.request.Request's tool fields)."""

    tools: tuple[ToolSpec, ...]
    tool_choice: str  # auto, none, required, named
    tool_name: str = ""
    parallel_tool_calls: bool = True

    @property
    def constrained(self) -> bool:
        """The reply is held to the call format by a grammar (its calls stream as written)."""
        return self.tool_choice in ("required", "named")
