"""Questions for the engine thread from the GUI, answered on the GUI thread.

The GUI never touches the tokenizer or the engine's state (they belong to the engine thread):
counting a draft's tokens, fitting a conversation into the context, tokenizing a logit-bias
entry all go through `Engine.call`, which runs a function between two steps and resolves a
Future. Its callbacks would run on the engine thread, so instead each render frame (the host's
`frame` signal, ~30 Hz idle) looks at the pending futures and delivers the finished ones here,
on the GUI thread, like every other event. A result from an engine that has since been replaced
is not delivered (its answer, token ids or limits, is about the other model): its caller hears
that instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Slot

from app.engine_host import EngineHost


@dataclass(slots=True)
class _Pending:
    generation: int
    future: Future
    on_result: Callable[[Any], None]
    on_error: Callable[[str], None] | None


class EngineCalls(QObject):
    def __init__(self, host: EngineHost, parent: QObject | None = None):
        super().__init__(parent)
        self.host = host
        self._pending: list[_Pending] = []
        host.frame.connect(self._deliver)
        host.status_changed.connect(self._deliver)

    def run(
        self,
        fn: Callable[[Any], Any],
        on_result: Callable[[Any], None],
        on_error: Callable[[str], None] | None = None,
    ) -> bool:
        """Run `fn(llm_engine)` on the engine thread; `on_result(value)` or `on_error(message)`
        follow on the GUI thread. False (and on_error at once) when no model is ready."""
        engine = self.host.engine
        if engine is None or not self.host.status().ready:
            if on_error is not None:
                on_error("no model is loaded")
            return False
        self._pending.append(_Pending(self.host.generation, engine.call(fn), on_result, on_error))
        return True

    @property
    def local(self) -> bool:
        """The engine runs in this process (a remote server's has no engine thread to ask; the
        host knows no EngineConfig for it)."""
        return self.host.engine is not None and self.host.config is not None

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout_s: float = 30.0) -> None:
        """Block until every pending call is answered, then deliver (tests, scripted runs)."""
        for pending in list(self._pending):
            with contextlib.suppress(TimeoutError):
                pending.future.exception(timeout_s)
        self._deliver()

    @Slot()
    def _deliver(self, _dirty=None) -> None:
        if not self._pending:
            return
        done = [p for p in self._pending if p.future.done()]
        self._pending = [p for p in self._pending if not p.future.done()]
        for pending in done:
            if pending.generation != self.host.generation:
                # Asked of an engine that is gone: its answer (token ids, limits) is about another model.
                if pending.on_error is not None:
                    pending.on_error("another model was loaded before the engine answered")
                continue
            error = pending.future.exception()
            if error is None:
                pending.on_result(pending.future.result())
            elif pending.on_error is not None:
                pending.on_error(str(error) or type(error).__name__)
