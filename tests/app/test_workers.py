"""The one worker helper (app.workers): a job's news reach the GUI thread in order (progress, one
outcome, finished), cancelling unwinds the work at its next report, a superseded job stays
silent; and EngineHost.call runs a function on the engine thread with the same news."""

from __future__ import annotations

import threading

import pytest
from app_windows import LOAD_TIMEOUT_MS

from app.engine_host import EngineHost
from app.workers import Cancelled, UserFacingError, create_worker
from engine.config import ConfigError, EngineConfig

TIMEOUT_MS = 30_000


def record(job) -> list:
    """Every signal the job emits, with the thread it was delivered on."""
    seen = []
    for name in ("progress", "returned", "errored", "cancelled", "finished"):
        getattr(job, name).connect(
            lambda *args, name=name: seen.append((name, args, threading.current_thread().name))
        )
    return seen


def test_a_worker_reports_progress_then_its_result_on_the_gui_thread(qtbot):
    def work(report):
        report("half")
        assert threading.current_thread().name == "kvscope-test-worker"
        return 42

    worker = create_worker(work, name="kvscope-test-worker", progress=True, start=False)
    seen = record(worker)
    with qtbot.waitSignal(worker.finished, timeout=TIMEOUT_MS):
        worker.start()
    gui = threading.current_thread().name
    assert seen == [("progress", ("half",), gui), ("returned", (42,), gui), ("finished", (), gui)]
    assert not worker.running and worker.wait(1)


@pytest.mark.parametrize(
    "error, message",
    [
        (ConfigError("top_p must be in (0, 1], got 2"), "top_p must be in (0, 1], got 2"),
        (UserFacingError("Wait for the reply to finish."), "Wait for the reply to finish."),
        (ValueError("bad shape"), "ValueError: bad shape"),
        (RuntimeError(), "RuntimeError"),
    ],
)
def test_a_failure_arrives_as_one_line(qtbot, error, message):
    def work():
        raise error

    worker = create_worker(work, name="kvscope-test-worker", start=False)
    seen = record(worker)
    with qtbot.waitSignal(worker.finished, timeout=TIMEOUT_MS):
        worker.start()
    assert [(name, args) for name, args, _ in seen] == [("errored", (message,)), ("finished", ())]


def test_cancel_unwinds_the_work_at_its_next_report(qtbot):
    started, go_on = threading.Event(), threading.Event()
    pieces = []

    def work(report):
        started.set()
        go_on.wait(10)
        for piece in range(3):
            report(f"piece {piece}")
            pieces.append(piece)
        return "done"

    worker = create_worker(work, name="kvscope-test-worker", progress=True, start=False)
    seen = record(worker)
    with qtbot.waitSignal(worker.finished, timeout=TIMEOUT_MS):
        worker.start()
        started.wait(10)
        worker.cancel()
        go_on.set()
    assert pieces == [] and [name for name, _, _ in seen] == ["cancelled", "finished"]
    with pytest.raises(Cancelled):
        worker.report("after")


def test_a_discarded_job_emits_nothing_more(qtbot):
    release = threading.Event()

    def work():
        release.wait(10)
        return "stale"

    old = create_worker(work, name="kvscope-test-worker", start=False)
    seen = record(old)
    old.start()
    old.discard()
    release.set()
    assert old.wait(10)
    qtbot.waitUntil(lambda: not old.running, timeout=TIMEOUT_MS)  # its news drained, unseen
    assert seen == []


def test_host_call_runs_on_the_engine_thread(qtbot, tiny_loaded):
    host = EngineHost()
    try:
        with qtbot.waitSignal(host.model_loaded, timeout=LOAD_TIMEOUT_MS):
            host.start(EngineConfig(num_blocks=64), loaded=tiny_loaded)

        def work(core, report):
            report(threading.current_thread().name)
            return core.kv.pool.num_blocks

        # a question of the test's own, asked the way every EngineClient question is
        call = host.ask(lambda engine, report: engine._call(lambda core: work(core, report)), progress=True)
        seen = record(call)
        with qtbot.waitSignal(call.finished, timeout=TIMEOUT_MS):
            pass
        gui = threading.current_thread().name
        assert seen == [
            ("progress", ("kvscope-engine",), gui),
            ("returned", (64,), gui),
            ("finished", (), gui),
        ]
        failing = host.ask(lambda engine: engine._call(lambda core: core.no_such_thing))
        with qtbot.waitSignal(failing.errored, timeout=TIMEOUT_MS) as errored:
            pass
        assert errored.args[0].startswith("AttributeError:")
    finally:
        host.shutdown()
    stopped = host.ask(lambda engine: engine.limits())
    with qtbot.waitSignal(stopped.errored, timeout=TIMEOUT_MS) as errored:
        pass
    assert errored.args == ["no model is loaded"]
