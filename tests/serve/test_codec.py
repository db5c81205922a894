"""The events stream's wire form: every event the engine makes comes back equal."""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.events import BlockEvent, StepStats, TokenGenerated
from engine.request import Request
from engine.serve import codec


def run_engine(loaded, *requests: Request) -> list:
    events: list = []
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=128), events.append)
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    engine.sample_memory()
    return events


def test_engine_events_round_trip_exactly(tiny_loaded):
    events = run_engine(
        tiny_loaded,
        Request.chat("Hello", temperature=0.8, top_p=0.9, seed=1, max_new_tokens=5, snapshot_top_n=8),
        Request.chat("Hello", temperature=0.7, n=3, seed=2, max_new_tokens=4),
        Request.chat("Hi", temperature=0.0, num_beams=2, max_new_tokens=3),
        Request.chat("x" * 10_000, max_new_tokens=2),  # fails: the context cannot hold it
    )
    kinds = {type(e).__name__ for e in events}
    assert {
        "TokenGenerated",
        "BlockEvent",
        "StepStats",
        "RequestFinished",
        "RequestFailed",
        "BeamStep",
    } <= kinds
    assert {"SequenceForked", "SequenceFinished", "MemorySample"} <= kinds
    back = codec.decode(codec.encode(events))
    assert back == events
    assert [type(e) for e in back] == [type(e) for e in events]
    snap = next(e.snapshot for e in back if isinstance(e, TokenGenerated) and e.snapshot)
    assert isinstance(snap.stages, tuple) and isinstance(snap.stages[0].probs, tuple)
    step = next(e for e in back if isinstance(e, StepStats))
    assert isinstance(step.seq_shapes[0], tuple)


def test_infinities_and_unknowns_survive_or_are_skipped():
    event = BlockEvent("append", (1,), 3, 0, 4, (4,), t=math.inf)
    assert codec.decode(codec.encode([event])) == [event]
    assert codec.decode('[{"type": "FromTheFuture", "data": {}}]') == []
    # a field this side does not know is ignored; a missing one takes its default
    (e,) = codec.decode(
        '[{"type": "BlockEvent", "data": {"op": "free", "block_ids": [2], "seq_id": 1, "new": 5}}]'
    )
    assert e == BlockEvent("free", (2,), 1)
    with pytest.raises(codec.DecodeError):
        codec.decode("{}")
    with pytest.raises(codec.DecodeError):
        codec.decode('[{"type": "BlockEvent", "data": {"op": "free"}}]')  # required fields missing
