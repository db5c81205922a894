"""Python's cyclic collector runs on the GUI thread only while a window is open (app/gui_gc.py):
a collection on another thread finalizes Qt objects there and can deadlock against the GUI."""

from __future__ import annotations

import gc
import threading
import time

from PySide6.QtCore import QObject

from app.gui_gc import GuiThreadCollector, collect_due
from engine.core import gc_heap


class _Cycle:
    """Half of an unreachable cycle that records the thread its finalizer ran on."""

    def __init__(self, finalized_on: list[str]):
        self.finalized_on = finalized_on
        self.other: _Cycle | None = None

    def __del__(self) -> None:
        self.finalized_on.append(threading.current_thread().name)


def _garbage_cycle_then_allocate(finalized_on: list[str], kept: list) -> None:
    a, b = _Cycle(finalized_on), _Cycle(finalized_on)
    a.other, b.other = b, a
    del a, b
    # far past every generation's threshold: automatic collection would have run here many times
    kept.extend([i] for i in range(200_000))


def test_a_cycle_made_on_another_thread_is_collected_on_the_gui_thread(qtbot):
    owner = QObject()
    collector = GuiThreadCollector(owner)
    try:
        assert not gc.isenabled()
        finalized_on: list[str] = []
        kept: list = []
        worker = threading.Thread(
            target=_garbage_cycle_then_allocate, args=(finalized_on, kept), name="worker"
        )
        worker.start()
        worker.join()
        assert finalized_on == []  # the worker's allocations collected nothing
        qtbot.waitUntil(lambda: len(finalized_on) == 2, timeout=5000)  # the GUI thread's timer did
        assert finalized_on == [threading.main_thread().name] * 2
    finally:
        collector.release()
    assert gc.isenabled()


def test_the_last_window_turns_automatic_collection_back_on(qtbot):
    owners = QObject(), QObject()
    first, second = GuiThreadCollector(owners[0]), GuiThreadCollector(owners[1])
    first.release()
    assert not gc.isenabled()  # the second window still holds it off
    second.release()
    second.release()  # a second close is harmless
    assert gc.isenabled()


def test_collect_due_collects_only_past_a_threshold():
    gc.disable()
    try:
        gc.collect()
        assert collect_due() is None  # nothing allocated since
        keep = [[i] for i in range(gc.get_threshold()[0] + 100)]
        assert collect_due() in (0, 1, 2)
        assert gc.get_count()[0] < gc.get_threshold()[0]
        del keep
    finally:
        gc.enable()


def _garbage_cycle_then_ask_for_a_collection(finalized_on: list[str], returned: list[int]) -> None:
    a, b = _Cycle(finalized_on), _Cycle(finalized_on)
    a.other, b.other = b, a
    del a, b
    gc_heap.collect()  # what engine code calls when it needs a model's memory back at once
    returned.append(len(finalized_on))


def test_a_workers_full_collection_runs_on_the_gui_thread_and_is_waited_for(qtbot):
    owner = QObject()
    collector = GuiThreadCollector(owner)
    try:
        finalized_on: list[str] = []
        returned: list[int] = []
        worker = threading.Thread(
            target=_garbage_cycle_then_ask_for_a_collection, args=(finalized_on, returned), name="worker"
        )
        worker.start()
        qtbot.waitUntil(lambda: returned != [], timeout=5000)  # the GUI thread's event loop runs meanwhile
        worker.join()
        assert returned == [2]  # collected before collect() returned to the worker
        assert finalized_on == [threading.main_thread().name] * 2
    finally:
        collector.release()


def test_without_a_window_a_full_collection_runs_on_the_calling_thread():
    finalized_on: list[str] = []
    returned: list[int] = []
    worker = threading.Thread(
        target=_garbage_cycle_then_ask_for_a_collection, args=(finalized_on, returned), name="worker"
    )
    worker.start()
    worker.join()
    assert returned == [2]
    assert finalized_on == ["worker"] * 2


def test_a_worker_waiting_for_a_collection_goes_on_when_the_window_closes(qtbot):
    """The window closes before its event loop ran the worker's collection: the worker does not
    wait out COLLECT_WAIT_S."""
    owner = QObject()
    collector = GuiThreadCollector(owner)
    returned: list[int] = []
    worker = threading.Thread(target=lambda: (gc_heap.collect(), returned.append(1)), name="worker")
    worker.start()
    deadline = time.monotonic() + 5
    while not collector._waiting and time.monotonic() < deadline:  # no event loop here: not run
        time.sleep(0.01)
    assert collector._waiting, "the worker never asked"
    collector.release()  # the window's close, before its event loop got to the request
    worker.join(5)  # well under COLLECT_WAIT_S
    assert returned == [1]
    assert gc.isenabled()
    qtbot.wait(10)  # the request arrives after all: nothing left to do
