"""The engine on its own thread: submit, stream, cancel, errors, shutdown."""

import threading
import time

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.core.service import Engine
from engine.events import (
    BlockEvent,
    EngineError,
    MemorySample,
    ModelLoaded,
    ModelLoadFailed,
    RequestFailed,
    RequestFinished,
    StepStats,
    TokenGenerated,
)
from engine.request import Request


class Sink:
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def __call__(self, event):
        with self.lock:
            self.events.append(event)

    def of(self, kind, request_id=None):
        with self.lock:
            return [
                e
                for e in self.events
                if isinstance(e, kind) and (request_id is None or e.request_id == request_id)
            ]

    def wait_for(self, predicate, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        raise AssertionError("timed out waiting for the engine")


@pytest.fixture
def running(tiny_loaded):
    sink = Sink()
    engine = Engine(EngineConfig(block_size=4, num_blocks=256), sink, loaded=tiny_loaded)
    engine.start()
    assert engine.wait_until_loaded(30)
    yield engine, sink
    engine.shutdown()
    assert not engine.is_alive()


def test_a_chat_request_streams_tokens_and_finishes(running):
    engine, sink = running
    rid = engine.submit(Request.chat("Hello there", system="Be brief.", temperature=0.0, max_new_tokens=12))
    sink.wait_for(lambda: sink.of(RequestFinished, rid))
    (done,) = sink.of(RequestFinished, rid)
    tokens = sink.of(TokenGenerated, rid)
    assert len(tokens) == done.stats.generated_tokens == len(done.token_ids)
    assert [t.index for t in tokens] == list(range(len(tokens)))
    assert "".join(t.text_delta for t in tokens) == done.text
    assert len(done.stats.itl_s) == len(tokens) - 1 and done.stats.ttft_s > 0
    assert sink.of(ModelLoaded) and sink.of(StepStats) and sink.of(MemorySample)


def test_cancel_mid_generation_frees_the_blocks(running):
    engine, sink = running
    rid = engine.submit(
        Request.chat("Count to a thousand", temperature=0.0, max_new_tokens=400, ignore_eos=True)
    )
    sink.wait_for(lambda: len(sink.of(TokenGenerated, rid)) >= 3)
    engine.cancel(rid)
    sink.wait_for(lambda: sink.of(RequestFinished, rid))
    (done,) = sink.of(RequestFinished, rid)
    assert done.finish_reason == "cancelled" and 3 <= done.stats.generated_tokens < 400
    steps = sink.of(StepStats)
    sink.wait_for(lambda: sink.of(StepStats)[-1].kv.used_blocks == 0 or engine.core.kv.pool.num_used == 0)
    assert engine.core.kv.pool.num_used == 0
    frees = [e for e in sink.of(BlockEvent) if e.op == "free" and e.seq_id == rid]
    assert frees and steps


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(running):
    engine, sink = running
    too_long = Request(prompt_token_ids=tuple([5] * 5000), sampling=SamplingParams(max_new_tokens=2))
    bad = engine.submit(too_long)
    good = engine.submit(Request.chat("hi", temperature=0.0, max_new_tokens=3))
    sink.wait_for(lambda: sink.of(RequestFinished, good))
    (failure,) = sink.of(RequestFailed, bad)
    assert "context" in failure.message or "KV pool" in failure.message


def test_an_exception_inside_a_step_becomes_an_error_event(running, monkeypatch):
    engine, sink = running
    core = engine.core
    original = core.runner.forward
    calls = {"n": 0}

    def exploding(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(core.runner, "forward", exploding)
    first = engine.submit(Request.chat("one", temperature=0.0, max_new_tokens=3))
    sink.wait_for(lambda: sink.of(RequestFailed, first))
    assert "simulated kernel failure" in sink.of(RequestFailed, first)[0].message
    assert sink.of(EngineError)
    second = engine.submit(Request.chat("two", temperature=0.0, max_new_tokens=3))
    sink.wait_for(lambda: sink.of(RequestFinished, second))
    assert core.kv.pool.num_used == 0


def test_shutdown_mid_generation_cancels_and_joins(tiny_loaded):
    sink = Sink()
    engine = Engine(EngineConfig(block_size=4, num_blocks=256), sink, loaded=tiny_loaded)
    engine.start()
    engine.wait_until_loaded(30)
    rid = engine.submit(Request.chat("go", temperature=0.0, max_new_tokens=500, ignore_eos=True))
    sink.wait_for(lambda: sink.of(TokenGenerated, rid))
    engine.shutdown()
    assert not engine.is_alive()
    assert sink.of(RequestFinished, rid)[0].finish_reason == "cancelled"


def test_a_model_that_fails_to_load_reports_and_stops(tmp_path):
    from engine.config import ModelSpec

    sink = Sink()
    engine = Engine(EngineConfig(model=ModelSpec(str(tmp_path / "nope"))), sink)
    engine.start()
    assert not engine.wait_until_loaded(30)
    (failed,) = sink.of(ModelLoadFailed)
    assert failed.message == engine.load_error and "nope" in failed.message
    engine.shutdown()
    assert not engine.is_alive()


def test_call_runs_on_the_engine_thread_and_returns_its_result(tiny_loaded):
    engine = Engine(EngineConfig(num_blocks=16), sink=lambda event: None, loaded=tiny_loaded)
    engine.start()
    try:
        engine.wait_until_loaded(60)
        where = engine._call(lambda core: (threading.current_thread().name, core.kv.pool.num_blocks))
        assert where.result(60) == ("kvscope-engine", 16)
        failing = engine._call(lambda core: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(60)
        assert engine._call(lambda core: "still serving").result(60) == "still serving"
    finally:
        engine.shutdown()
    late = engine._call(lambda core: "never runs")
    with pytest.raises(RuntimeError, match="stopped"):
        late.result(5)


def test_call_fails_when_the_model_did_not_load(tmp_path):
    from engine.config import ModelSpec

    engine = Engine(
        EngineConfig(model=ModelSpec(str(tmp_path / "missing"), device="cpu")), sink=lambda e: None
    )
    engine.start()
    try:
        engine.wait_until_loaded(60)
        with pytest.raises(RuntimeError, match="did not load"):
            engine._call(lambda core: 1).result(10)
    finally:
        engine.shutdown()


def test_a_loaded_engine_keeps_its_heap_out_of_full_collections(tiny_loaded):
    """What lives at the end of a load lives as long as the engine: frozen, a full collection
    walks only what was made since (engine/core/gc_heap.py); closing thaws it, so the model's
    objects can be collected after the engine is gone."""
    import gc

    engine = Engine(EngineConfig(block_size=4, num_blocks=64), Sink(), loaded=tiny_loaded)
    engine.start()
    assert engine.wait_until_loaded(30)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000, "the imports' and the model's objects"
    walked_before = len(gc.get_objects())
    assert walked_before < frozen, "a full collection now walks less than it keeps out"
    engine.shutdown()
    assert not engine.is_alive()
    assert gc.get_freeze_count() == 0
