"""An engine whose every event is kept, for tests that read a request's events after it ran."""

from __future__ import annotations

from engine.core.llm_engine import LLMEngine


class Sink(list):
    """Every event of the engine it is given to (cleared between requests)."""


def make_engine(loaded, config) -> LLMEngine:
    sink = Sink()
    engine = LLMEngine(loaded, config, sink.append)
    engine.test_events = sink
    return engine


def run_events(engine: LLMEngine, request) -> list:
    """Run `request` alone to its end; the events it made."""
    events = engine.test_events
    events.clear()
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    return events
