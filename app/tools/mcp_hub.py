"""MCP servers as the app talks to them, on one asyncio loop of its own (a daemon thread): each
server's session is entered and left by a task of its own (anyio's cancel scopes must be), tool
calls run on the loop with their own timeout, and every answer comes back as a
`concurrent.futures.Future`. No Qt here (app.tools.registry brings the answers to the GUI).

What comes back is bounded: a result is given to the model up to RESULT_CHARS characters (the
card says how much the tool returned), a call that takes longer than its timeout is abandoned
("timeout"), a tool that fails or whose server dies is an "error" with the reason, and a server
that does not start says why in one line (the last line it wrote on stderr, when it wrote any).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

# A server has this long to start and list its tools.
START_TIMEOUT_S = 30.0
# A call has this long unless the caller says otherwise.
CALL_TIMEOUT_S = 30.0
# What a result may add to the model's context (a 10 MB answer would not fit, and would cost
# minutes of prefill): the first this many characters, and a line saying how much there was.
RESULT_CHARS = 8_000


class McpError(Exception):
    """A server or a call that failed; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class McpServerConfig:
    """One MCP server: a command started over stdio, or a Streamable HTTP endpoint."""

    name: str
    command: str = ""  # stdio: the command line
    url: str = ""  # HTTP: the endpoint, e.g. http://127.0.0.1:8000/mcp

    @property
    def kind(self) -> str:
        return "stdio" if self.command else "http"

    def problem(self) -> str:
        """Why this cannot be a server ("" when it can)."""
        if not self.name.strip():
            return "give the server a name"
        if bool(self.command.strip()) == bool(self.url.strip()):
            return "give either a command (stdio) or a URL (HTTP)"
        if self.url and not self.url.startswith(("http://", "https://")):
            return "the URL must start with http:// or https://"
        if self.command:
            try:
                if not shlex.split(self.command):
                    return "the command is empty"
            except ValueError as exc:
                return f"the command does not parse: {exc}"
        return ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "command": self.command, "url": self.url}

    @staticmethod
    def from_dict(raw: Any) -> McpServerConfig | None:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            return None
        config = McpServerConfig(raw["name"], str(raw.get("command") or ""), str(raw.get("url") or ""))
        return None if config.problem() else config


@dataclass(frozen=True, slots=True)
class McpTool:
    server: str
    name: str
    description: str
    input_schema: str  # JSON Schema of the arguments, as JSON text


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    status: str  # "done", "error", "timeout"
    text: str  # what the model is given
    size: int = 0  # characters the tool returned
    truncated: bool = False
    seconds: float = 0.0


def result_text(result: Any) -> str:
    """A CallToolResult's content as text: text blocks as they are, others named."""
    parts = []
    for block in getattr(result, "content", None) or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(str(getattr(block, "text", "")))
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {getattr(block, 'mime_type', '?')}]")
        elif kind == "resource_link":
            parts.append(f"[resource: {getattr(block, 'uri', '?')}]")
        else:
            parts.append(f"[{kind or 'content'}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def bounded(text: str, limit: int = RESULT_CHARS) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    note = f"\n[kvscope: the tool returned {len(text):,} characters; the first {limit:,} are given here]"
    return text[:limit] + note, True


def _one_line(exc: BaseException) -> str:
    """An exception (anyio wraps them in groups) as its innermost message."""
    while getattr(exc, "exceptions", None):  # an (anyio) exception group: its first member
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


class _Session:
    def __init__(self, config: McpServerConfig):
        self.config = config
        self.client: Any = None
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.errlog: Any = None


class McpHub:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._pending: set[Future[Any]] = set()  # answers not yet given (cancelled on close)

    # ---- the loop --------------------------------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name="kvscope-mcp", daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop

    def _submit(self, coro: Any) -> Future[Any]:
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def close(self, timeout: float = 5.0) -> None:
        """Leave every session (their servers stop) and end the loop. An answer still awaited
        (a call that hangs) is cancelled: whoever waits for it is told, not left waiting."""
        loop = self._loop
        if loop is None:
            return
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.cancel()
        with contextlib.suppress(Exception):
            self._submit(self._close_all()).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        self._loop = None

    # ---- servers ---------------------------------------------------------------------------
    def connect(self, config: McpServerConfig, timeout: float = START_TIMEOUT_S) -> Future[list[McpTool]]:
        """Start (or reach) the server and list its tools; McpError says why it cannot."""
        return self._submit(self._connect(config, timeout))

    def disconnect(self, name: str) -> Future[None]:
        return self._submit(self._disconnect(name))

    def call(
        self, server: str, tool: str, arguments: dict[str, Any], timeout: float = CALL_TIMEOUT_S
    ) -> Future[ToolOutcome]:
        return self._submit(self._call_tool(server, tool, arguments, timeout))

    async def _connect(self, config: McpServerConfig, timeout: float) -> list[McpTool]:
        await self._disconnect(config.name)
        session = _Session(config)
        ready: asyncio.Future[list[McpTool]] = asyncio.get_running_loop().create_future()
        session.task = asyncio.create_task(self._hold(session, ready))
        self._sessions[config.name] = session
        try:
            return await asyncio.wait_for(asyncio.shield(ready), timeout)
        except TimeoutError:
            await self._disconnect(config.name)
            raise McpError(f"{config.name}: the server did not answer within {timeout:.0f} s") from None

    async def _hold(self, session: _Session, ready: asyncio.Future[list[McpTool]]) -> None:
        """The session's own task: enter it, list the tools, wait to be told to leave."""
        from mcp import Client, StdioServerParameters  # the SDK: only once a server is used
        from mcp.client.stdio import stdio_client

        config = session.config
        try:
            if config.kind == "stdio":
                argv = shlex.split(config.command)
                # closed in `finally` below, once the session (and its server) has ended
                session.errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
                params = StdioServerParameters(command=argv[0], args=argv[1:])
                target: Any = stdio_client(params, errlog=session.errlog)
            else:
                target = config.url
            async with Client(target) as client:
                listed = await client.list_tools()
                tools = [
                    McpTool(config.name, t.name, t.description or "", json.dumps(t.input_schema or {}))
                    for t in listed.tools
                ]
                session.client = client
                if not ready.done():
                    ready.set_result(tools)
                await session.stop.wait()
        except BaseException as exc:  # noqa: BLE001 - a server that failed: said, not raised on the loop
            if not ready.done():
                ready.set_exception(McpError(f"{config.name}: {self._start_failure(session, exc)}"))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            session.client = None
            if session.errlog is not None:
                session.errlog.close()

    @staticmethod
    def _start_failure(session: _Session, exc: BaseException) -> str:
        reason = _one_line(exc)
        if isinstance(exc, FileNotFoundError) or "No such file" in reason:
            return f"the command was not found ({reason})"
        if session.errlog is not None:
            with contextlib.suppress(Exception):
                session.errlog.seek(0)
                lines = [line.strip() for line in session.errlog.read().splitlines() if line.strip()]
                if lines:
                    return f"the server stopped: {lines[-1][:300]}"
        return f"the server could not be reached ({reason})"

    async def _disconnect(self, name: str) -> None:
        session = self._sessions.pop(name, None)
        if session is None:
            return
        session.stop.set()
        if session.task is not None:
            try:
                await asyncio.wait_for(session.task, 5.0)
            except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                session.task.cancel()

    async def _close_all(self) -> None:
        for name in list(self._sessions):
            await self._disconnect(name)

    # ---- calls -----------------------------------------------------------------------------
    async def _call_tool(
        self, server: str, tool: str, arguments: dict[str, Any], timeout: float
    ) -> ToolOutcome:
        loop = asyncio.get_running_loop()
        started = loop.time()
        session = self._sessions.get(server)
        if session is None or session.client is None:
            return ToolOutcome("error", f"the MCP server {server!r} is not connected")
        try:
            result = await asyncio.wait_for(
                session.client.call_tool(tool, arguments, read_timeout_seconds=timeout), timeout + 1.0
            )
        except TimeoutError:
            return ToolOutcome("timeout", f"the tool did not answer within {timeout:g} s", 0, False, timeout)
        except Exception as exc:  # noqa: BLE001 - the server failed or went away: the model is told
            reason = _one_line(exc)
            if "timed out" in reason:
                return ToolOutcome(
                    "timeout", f"the tool did not answer within {timeout:g} s", 0, False, timeout
                )
            return ToolOutcome("error", f"the call failed: {reason}", 0, False, loop.time() - started)
        text = result_text(result)
        given, truncated = bounded(text)
        status = "error" if getattr(result, "is_error", False) else "done"
        return ToolOutcome(status, given, len(text), truncated, loop.time() - started)
