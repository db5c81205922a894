"""Questions for the engine thread from the GUI, answered on the GUI thread.

The GUI never touches the tokenizer or the engine's state (they belong to the engine thread):
counting a draft's tokens, fitting a conversation into the context, tokenizing a logit-bias
entry are the engine's named questions (engine.api.EngineClient), asked through `EngineHost.ask`
(app.workers: answered between two steps, the answer reaches the GUI thread on the render tick).
An answer from an engine that has since been replaced is not delivered (its token ids or limits
are about the other model): its caller hears that instead.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from PySide6.QtCore import QObject

from app.engine_host import EngineHost
from app.workers import connect
from engine.api import EngineClient


class EngineCalls(QObject):
    """The chat's engine questions, through the host's one way of asking (`EngineHost.ask`),
    with the chat's rule added: an answer from an engine since replaced is not delivered."""

    def __init__(self, host: EngineHost, parent: QObject | None = None):
        super().__init__(parent)
        self.host = host
        self.detached = False  # its chat tab closed: answers still on their way are dropped

    def ask(
        self,
        query: Callable[[EngineClient], Future[Any]],
        on_result: Callable[[Any], None],
        on_error: Callable[[str], None] | None = None,
    ) -> bool:
        """Ask `query(engine)` (an EngineClient question); `on_result(answer)` or
        `on_error(message)` follow on the GUI thread. False (and on_error at once) when no model
        is ready."""
        failed = on_error or (lambda message: None)
        if self.host.engine is None or not self.host.status().ready:
            failed("no model is loaded")
            return False
        generation = self.host.generation

        def returned(value: Any) -> None:
            if self.detached:
                return  # the asker's widgets are gone
            if self.host.generation != generation:
                # asked of an engine that is gone: its answer (token ids, limits) is about another model
                failed("another model was loaded before the engine answered")
            else:
                on_result(value)

        def errored(message: str) -> None:
            if not self.detached:
                failed(message)

        connect(self.host.ask(query, name="chat question"), on_returned=returned, on_errored=errored)
        return True

    def detach(self) -> None:
        self.detached = True

    @property
    def local(self) -> bool:
        """The engine runs in this process (a remote server's has no engine thread to ask; the
        host knows no EngineConfig for it)."""
        return self.host.engine is not None and self.host.config is not None
