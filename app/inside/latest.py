"""One engine question in flight per view, the latest one waiting: a slider dragged through ten
values, or ten tokens clicked in a row, cost two computations at most, and the answer shown is
always the newest question's."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from PySide6.QtCore import QObject

from app.engine_host import EngineHost
from app.workers import EngineCall

Query = Callable[[Any], Future[Any]]


class LatestCall(QObject):
    def __init__(self, host: EngineHost, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host, self.name = host, name
        self.call: EngineCall | None = None
        self._waiting: tuple[Query, Callable[[Any], None], Callable[[str], None]] | None = None

    def ask(self, query: Query, answered: Callable[[Any], None], failed: Callable[[str], None]) -> None:
        """Ask `query(engine)`; `answered(result)` or `failed(message)` on the GUI thread, unless a
        newer question was asked meanwhile (then only the newest is answered)."""
        self._waiting = (query, answered, failed)
        if self.call is None or not self.call.running:
            self._next()

    @property
    def busy(self) -> bool:
        return self.call is not None and self.call.running

    def _next(self) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return
        query, answered, failed = waiting
        self.call = call = self.host.ask(query, name=self.name)

        def done(result: Any) -> None:
            if self._waiting is None:  # a newer question replaces this answer: it is not shown
                answered(result)

        def error(message: str) -> None:
            if self._waiting is None:
                failed(message)

        call.returned.connect(done)
        call.errored.connect(error)
        call.finished.connect(self._next)
