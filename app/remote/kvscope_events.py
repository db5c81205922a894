"""A kvscope server's events stream, made this app's: its ids and its clock.

The server numbers every client's requests (and the sequences of forks) in one space; the app
numbers its own requests as it submits them. Every id on the stream gets a local one from the
same counter the app's submissions use, so nothing collides: the app's own requests are the
ones whose tag (sent with the request) came back in a RequestTagged just before their
RequestStarted, and they take the id `submit` already returned; everyone else's requests and
every forked sequence get fresh ids the first time they appear. Times are moved onto this
process's perf_counter with the offset measured at the stream's hello.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.api import RequestTagged
from engine.events import ModelLoaded

ID_FIELDS = ("request_id", "seq_id", "parent_seq_id")


class EventTranslator:
    def __init__(self, next_id: Callable[[], int], name_of: Callable[[str], str]) -> None:
        self._next_id = next_id
        self._name_of = name_of  # the served model's name -> how the app shows it
        self.local_of: dict[int, int] = {}
        self.pending: dict[str, int] = {}  # tag -> local id, for requests sent but not yet seen
        self.offset = 0.0

    def hello(self, server_t: float, local_t: float) -> None:
        self.offset = local_t - server_t

    def local(self, server_id: int | None) -> int | None:
        if server_id is None:
            return None
        local = self.local_of.get(server_id)
        if local is None:
            local = self.local_of[server_id] = self._next_id()
        return local

    def translate(self, event):
        """The event in this app's ids and time (None for records that only carry mapping)."""
        if type(event) is RequestTagged:
            local = self.pending.pop(event.tag, None)
            if local is not None:
                self.local_of[event.request_id] = local
            return None
        changes = {name: self.local(getattr(event, name)) for name in ID_FIELDS if hasattr(event, name)}
        if hasattr(event, "seq_ids"):
            changes["seq_ids"] = tuple(self.local(s) for s in event.seq_ids)
        if getattr(event, "t", 0.0):
            changes["t"] = event.t + self.offset
        if type(event) is ModelLoaded:
            changes["info"] = dataclasses.replace(event.info, name=self._name_of(event.info.name))
        return dataclasses.replace(event, **changes) if changes else event
