"""The inbox between the engine thread and the GUI: `push` from the engine (a lock and an
append, never a wait), `drain` from the GUI's render timer."""

from __future__ import annotations

import threading
from collections import deque

from engine.events import Event


class EventStore:
    """Thread-safe inbox: `push` from the engine thread, `drain` from the GUI thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: deque[Event] = deque()

    def push(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def drain(self) -> list[Event]:
        with self._lock:
            events, self._events = self._events, deque()
        return list(events)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
