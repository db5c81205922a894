"""Python's cyclic garbage collector runs on the GUI thread only, while a window is open.

A collection finalizes every unreachable cycle it finds, Qt objects among them (a replaced chat
bubble, a closed dialog, the lambdas connected to their signals), and a PySide object's finalizer
disconnects its signals under Qt's connection lock. Left automatic, a collection runs on whichever
thread's allocation crossed the threshold: the engine's, the remote engine's client, a worker's.
That thread then waits for the GIL inside Qt's lock while the GUI thread, holding the GIL, waits
for the same lock to connect a signal (QLabel::setText builds a text control): neither moves
again. CI hung exactly so (2026-12-07, tests/app/test_remote_attach.py: the remote client's thread
collected in httpx's request building, the GUI thread set a chat bubble's text).

So while any window is open, automatic collection is off and a timer on the GUI thread collects
what CPython would have collected (`collect_due`); when the last window closes, automatic
collection is back. Off the GUI thread nothing collects, so the engine's steps pay no collection
either; a full one runs at most every FULL_COLLECTION_EVERY_S (CPython waits for a quarter of the
long-lived objects to be new, which Python does not expose; the engine freezes its load's heap,
engine/core/gc_heap.py, so a full collection walks only what was made since).

A worker that needs memory back at once (the quality measurement frees one model copy before
loading the next: engine.core.gc_heap.collect) asks the GUI thread for a full collection and waits
for it; if the GUI thread does not get to it in COLLECT_WAIT_S (it may be waiting for that worker),
the worker goes on without it, and the timer collects later.
"""

from __future__ import annotations

import gc
import threading
import time

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine.api import set_garbage_collector

COLLECT_EVERY_MS = 100
FULL_COLLECTION_EVERY_S = 10.0
COLLECT_WAIT_S = 10.0

_holders: list[GuiThreadCollector] = []  # the windows' holds keeping automatic collection off
_last_full = [0.0]  # monotonic time of the last full collection made here


def collect_due() -> int | None:
    """Collect the oldest generation whose count passed its threshold, as CPython's automatic
    collection would (a full one at most every FULL_COLLECTION_EVERY_S); the generation, or
    None when none was due."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (2, 1, 0):
        if counts[generation] <= thresholds[generation]:
            continue
        now = time.monotonic()
        if generation == 2:
            if now - _last_full[0] < FULL_COLLECTION_EVERY_S:
                generation = 1
            else:
                _last_full[0] = now
        gc.collect(generation)
        return generation
    return None


class GuiThreadCollector(QObject):
    """A window's hold on the collector: made on the GUI thread, with the window as parent."""

    _full_collection_asked = Signal(object)  # a threading.Event, set once collected

    def __init__(self, window: QObject):
        super().__init__(window)
        self._gui_thread = threading.get_ident()
        self._waiting: set[threading.Event] = set()  # workers' collections asked, not yet run
        self._timer = QTimer(self)
        self._timer.setInterval(COLLECT_EVERY_MS)
        self._timer.timeout.connect(collect_due)
        # queued: the slot runs on this object's (the GUI) thread whichever thread emits
        self._full_collection_asked.connect(self._collect_for)
        if not _holders:
            gc.disable()
        _holders.append(self)
        set_garbage_collector(self.collect_full)
        self._timer.start()

    def collect_full(self) -> None:
        """A full collection on the GUI thread, from any thread (engine.core.gc_heap.collect)."""
        if threading.get_ident() == self._gui_thread:
            gc.collect()
            return
        done = threading.Event()
        self._waiting.add(done)
        self._full_collection_asked.emit(done)
        done.wait(COLLECT_WAIT_S)
        self._waiting.discard(done)

    @Slot(object)
    def _collect_for(self, done: threading.Event) -> None:
        if done in self._waiting:
            gc.collect()
        done.set()

    def release(self) -> None:
        """The window is closing: stop collecting for it; the last one turns automatic collection
        back on, after collecting here, on the GUI thread, what waited."""
        self._timer.stop()
        for done in list(self._waiting):  # a worker waiting on this window goes on at once
            self._waiting.discard(done)
            done.set()
        if self not in _holders:
            return
        _holders.remove(self)
        if _holders:
            set_garbage_collector(_holders[0].collect_full)
        else:
            set_garbage_collector(None)
            gc.enable()
            gc.collect()
