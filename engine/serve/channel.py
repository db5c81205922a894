"""Items pushed from the engine thread, awaited on the server's event loop.

`push` is what the engine's sink calls: a lock, an append and at most one wake-up scheduled on the
loop per batch, never a wait. `get` returns everything that arrived since the last call, so a
burst of events costs the HTTP side one wake-up, not one per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable


class ChannelOverflow(RuntimeError):
    """The reader fell more than `limit` items behind; the channel is closed."""


class Channel:
    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int | None = None) -> None:
        self._loop = loop
        self._limit = limit
        self._lock = threading.Lock()
        self._items: list[object] = []
        self._wake = asyncio.Event()
        self._scheduled = False
        self.overflowed = False

    def push(self, item: object) -> None:
        self.push_many((item,))

    def push_many(self, items: Iterable[object]) -> None:
        """From any thread."""
        with self._lock:
            if self.overflowed:
                return
            self._items.extend(items)
            if self._limit is not None and len(self._items) > self._limit:
                # Dropping items would corrupt the reader's state (a lost "free" leaves a block lit
                # forever): the reader is told instead, and reconnects for a fresh snapshot.
                self.overflowed = True
                self._items.clear()
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        with self._lock:
            self._scheduled = False
        self._wake.set()

    async def get(self) -> list[object]:
        """Everything pushed since the last call (waits for at least one item)."""
        while True:
            with self._lock:
                if self.overflowed:
                    raise ChannelOverflow(f"the reader fell more than {self._limit} events behind")
                if self._items:
                    items, self._items = self._items, []
                    return items
                self._wake.clear()
            await self._wake.wait()
