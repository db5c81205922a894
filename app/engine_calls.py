"""Questions for the engine thread from the GUI, answered on the GUI thread.

The GUI never touches the tokenizer or the engine's state (they belong to the engine thread):
counting a draft's tokens, fitting a conversation into the context, tokenizing a logit-bias
entry all go through `EngineHost.call` (app.workers: the work runs between two steps, its
outcome reaches the GUI thread on the render tick). A result from an engine that has since been
replaced is not delivered (its answer, token ids or limits, is about the other model): its
caller hears that instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject

from app.engine_host import EngineHost
from app.workers import connect


class EngineCalls(QObject):
    """The chat's engine questions, through the host's one way of asking (`EngineHost.call`),
    with the chat's rule added: an answer from an engine since replaced is not delivered."""

    def __init__(self, host: EngineHost, parent: QObject | None = None):
        super().__init__(parent)
        self.host = host

    def run(
        self,
        fn: Callable[[Any], Any],
        on_result: Callable[[Any], None],
        on_error: Callable[[str], None] | None = None,
    ) -> bool:
        """Run `fn(llm_engine)` on the engine thread; `on_result(value)` or `on_error(message)`
        follow on the GUI thread. False (and on_error at once) when no model is ready."""
        failed = on_error or (lambda message: None)
        if self.host.engine is None or not self.host.status().ready:
            failed("no model is loaded")
            return False
        generation = self.host.generation

        def returned(value: Any) -> None:
            if self.host.generation != generation:
                # asked of an engine that is gone: its answer (token ids, limits) is about another model
                failed("another model was loaded before the engine answered")
            else:
                on_result(value)

        connect(self.host.call(fn, name="chat question"), on_returned=returned, on_errored=failed)
        return True

    @property
    def local(self) -> bool:
        """The engine runs in this process (a remote server's has no engine thread to ask; the
        host knows no EngineConfig for it)."""
        return self.host.engine is not None and self.host.config is not None
