"""The MCP servers the user added, their state and their tools, for the GUI.

Servers are kept in the app's settings and connected when the registry starts (each on the
MCP hub's loop: app.tools.mcp_hub); their tools are what the chat offers the model. A server
that fails to start stays listed with the reason. A call runs on the hub; its outcome comes
back on the GUI thread (app.workers), so a tool that hangs or crashes never blocks the window.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.tools.mcp_hub import CALL_TIMEOUT_S, McpError, McpHub, McpServerConfig, McpTool, ToolOutcome
from app.workers import UserFacingError, create_worker
from engine.request import ToolSpec

SERVERS_KEY = "tools/mcp_servers"


@dataclass(slots=True)
class ServerState:
    config: McpServerConfig
    state: str = "connecting"  # "connecting", "ready", "failed"
    message: str = ""
    tools: list[McpTool] = field(default_factory=list)


class ToolRegistry(QObject):
    changed = Signal()  # a server was added, removed, connected or failed

    def __init__(
        self, settings: Any = None, parent: QObject | None = None, call_timeout_s: float = CALL_TIMEOUT_S
    ):
        super().__init__(parent)
        self.settings = settings
        self.call_timeout_s = call_timeout_s
        self.hub = McpHub()
        self.servers: dict[str, ServerState] = {}
        self._jobs: list[Any] = []

    # ---- servers ---------------------------------------------------------------------------
    def load(self) -> None:
        """The saved servers, connected."""
        raw = self.settings.get(SERVERS_KEY, []) if self.settings is not None else []
        for item in raw if isinstance(raw, list) else []:
            config = McpServerConfig.from_dict(item)
            if config is not None and config.name not in self.servers:
                self._start(config)

    def add(self, config: McpServerConfig) -> str:
        """Add and connect a server; "" or why it cannot be added."""
        problem = config.problem()
        if problem:
            return problem
        if config.name in self.servers:
            return f"there is already a server named {config.name!r}"
        self._start(config)
        self._save()
        return ""

    def remove(self, name: str) -> None:
        if self.servers.pop(name, None) is not None:
            self.hub.disconnect(name)
            self._save()
            self.changed.emit()

    def reconnect(self, name: str) -> None:
        state = self.servers.get(name)
        if state is not None:
            self._start(state.config)

    def _start(self, config: McpServerConfig) -> None:
        state = ServerState(config)
        self.servers[config.name] = state
        future = self.hub.connect(config)

        def connected(tools: list[McpTool]) -> None:
            if self.servers.get(config.name) is state:
                state.state, state.tools, state.message = "ready", tools, f"{len(tools)} tools"
                self.changed.emit()

        def failed(message: str) -> None:
            if self.servers.get(config.name) is state:
                state.state, state.message = "failed", message
                self.changed.emit()

        self._watch(future, connected, failed, f"kvscope-mcp-{config.name}")
        self.changed.emit()

    def _save(self) -> None:
        if self.settings is not None:
            self.settings.set(SERVERS_KEY, [s.config.to_dict() for s in self.servers.values()])

    def _watch(
        self, future: Any, on_result: Callable[[Any], None], on_error: Callable[[str], None], name: str
    ) -> None:
        def wait() -> Any:
            try:
                return future.result()
            except McpError as exc:
                raise UserFacingError(str(exc)) from None
            except CancelledError:
                raise UserFacingError("the MCP servers were closed") from None

        job = create_worker(wait, name=name, parent=self, on_returned=on_result, on_errored=on_error)
        self._jobs = [j for j in self._jobs if j.running] + [job]

    # ---- tools -----------------------------------------------------------------------------
    def tools(self) -> list[tuple[str, McpTool]]:
        """(the name the model sees, the tool) for every ready server's tools. A name two servers
        share is given as server_name."""
        found = [t for s in self.servers.values() if s.state == "ready" for t in s.tools]
        counts: dict[str, int] = {}
        for tool in found:
            counts[tool.name] = counts.get(tool.name, 0) + 1
        named = []
        for tool in found:
            name = tool.name if counts[tool.name] == 1 else f"{tool.server}_{tool.name}"
            named.append((_safe_name(name), tool))
        return named

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        return tuple(ToolSpec(name, t.description, t.input_schema) for name, t in self.tools())

    def find(self, name: str) -> McpTool | None:
        return next((t for n, t in self.tools() if n == name), None)

    def call(self, name: str, arguments: dict[str, Any], on_done: Callable[[ToolOutcome], None]) -> None:
        """Run the tool the model calls `name`; `on_done(outcome)` on the GUI thread."""
        tool = self.find(name)
        if tool is None:
            on_done(ToolOutcome("error", f"no connected MCP server has a tool named {name!r}"))
            return
        future = self.hub.call(tool.server, tool.name, arguments, self.call_timeout_s)
        self._watch(
            future, on_done, lambda message: on_done(ToolOutcome("error", message)), f"kvscope-tool-{name}"
        )

    def close(self) -> None:
        for job in self._jobs:
            job.discard()
        self.hub.close()


def _safe_name(name: str) -> str:
    """A tool name as models and ToolSpec take them: letters, digits, _ - . (at most 64)."""
    cleaned = "".join(c if c.isalnum() or c in "_-." else "_" for c in name)[:64]
    return cleaned or "tool"
