"""Speculative decoding on the packaged SmolLM2: greedy output equals plain greedy output with
the n-gram and the self-draft proposers, and repeating a text gets drafts accepted."""

import pytest

from engine.bench.bench_speculative import PASSAGE
from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.request import Request

pytestmark = pytest.mark.slow
PROMPT = f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"


def run(loaded, spec):
    events = []
    engine = LLMEngine(loaded, EngineConfig(speculative=spec), events.append)
    engine.add_request(Request.chat(PROMPT, sampling=SamplingParams(temperature=0.0, max_new_tokens=48)))
    while engine.has_work():
        engine.step()
    assert engine.kv.pool.num_used == 0
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    return done


def test_speculative_greedy_equals_plain_on_the_packaged_model(default_loaded):
    plain = run(default_loaded, None)
    ngram = run(default_loaded, SpeculativeConfig("ngram", num_draft=4))
    self_draft = run(default_loaded, SpeculativeConfig("self", num_draft=3, self_draft_layers=8))
    assert ngram.token_ids == plain.token_ids
    assert self_draft.token_ids == plain.token_ids
    assert ngram.stats.acceptance_rate > 0.3, "repeating a text is what prompt lookup is for"
    assert ngram.stats.target_forwards < plain.stats.target_forwards
