"""A request that breaks a step fails alone: the step runs again without it and every other
request's greedy tokens are those it gets alone (issue 24: one failed step used to fail every
request in flight)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import EngineError, RequestFailed, RequestFinished
from engine.request import Request

POISON = 4242  # a token id the tiny model's embedding is made to refuse
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
PROMPTS = ([5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [30, 31])


def engine_of(tiny_loaded, events):
    return LLMEngine(tiny_loaded, EngineConfig(block_size=4, num_blocks=64), events.append)


def run(engine, requests):
    ids = [engine.add_request(r) for r in requests]
    for _ in range(500):
        if not engine.has_work():
            break
        engine.step()
    return ids


def alone(tiny_loaded, prompt, params=GREEDY):
    events: list = []
    engine = engine_of(tiny_loaded, events)
    (rid,) = run(engine, [Request(prompt_token_ids=tuple(prompt), sampling=params)])
    (done,) = [e for e in events if isinstance(e, RequestFinished) and e.request_id == rid]
    return done.token_ids


@pytest.fixture
def poisoned_embedding(tiny_loaded):
    """The embedding raises when a step's input holds POISON, as a kernel failing on one
    request's rows would."""

    def refuse(_module, args):
        if (args[0] == POISON).any():
            raise RuntimeError("simulated kernel failure on a poisoned row")

    handle = tiny_loaded.model.model.embed_tokens.register_forward_pre_hook(refuse)
    yield
    handle.remove()


def finished(events):
    return {e.request_id: e.token_ids for e in events if isinstance(e, RequestFinished)}


def test_a_prompt_that_breaks_the_forward_fails_alone(tiny_loaded, poisoned_embedding):
    expected = [alone(tiny_loaded, p) for p in PROMPTS]
    events: list = []
    engine = engine_of(tiny_loaded, events)
    bad = Request(prompt_token_ids=(1, 2, POISON, 3), sampling=GREEDY)
    requests = [Request(prompt_token_ids=tuple(p), sampling=GREEDY) for p in PROMPTS]
    ids = run(engine, requests[:2] + [bad] + requests[2:])
    bad_id = ids.pop(2)
    (failure,) = [e for e in events if isinstance(e, RequestFailed)]
    assert failure.request_id == bad_id and "simulated kernel failure" in failure.message
    assert [finished(events)[i] for i in ids] == expected
    assert any(isinstance(e, EngineError) and f"request {bad_id} failed alone" in e.message for e in events)
    assert engine.kv.pool.num_used == 0
    engine.kv.pool.check_invariants()


def test_a_request_that_breaks_the_forward_mid_decode_fails_alone(tiny_loaded, poisoned_embedding):
    """The poisoned token is the request's first generated one (a +100 logit bias), so its
    second decode step breaks while the other requests are decoding beside it."""
    expected = [alone(tiny_loaded, p) for p in PROMPTS]
    events: list = []
    engine = engine_of(tiny_loaded, events)
    forced = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, logit_bias=((POISON, 100.0),))
    requests = [Request(prompt_token_ids=tuple(p), sampling=GREEDY) for p in PROMPTS]
    bad = Request(prompt_token_ids=(40, 41, 42), sampling=forced)
    ids = run(engine, [requests[0], bad, *requests[1:]])
    bad_id = ids.pop(1)
    (failure,) = [e for e in events if isinstance(e, RequestFailed)]
    assert failure.request_id == bad_id
    assert [finished(events)[i] for i in ids] == expected
    assert engine.kv.pool.num_used == 0


def test_a_request_whose_sampling_breaks_fails_alone(tiny_loaded):
    """The failure after the forward: one request's sampler raises on its third token."""
    expected = [alone(tiny_loaded, p) for p in PROMPTS]
    events: list = []
    engine = engine_of(tiny_loaded, events)
    requests = [Request(prompt_token_ids=tuple(p), sampling=GREEDY) for p in PROMPTS]
    ids = [engine.add_request(r) for r in requests]
    victim = engine.seqs[ids[1]]
    real, calls = victim.sampler.sample, []

    def breaks_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise FloatingPointError("simulated sampler failure")
        return real(*args, **kwargs)

    victim.sampler.sample = breaks_on_third
    run(engine, [])
    (failure,) = [e for e in events if isinstance(e, RequestFailed)]
    assert failure.request_id == ids[1] and "simulated sampler failure" in failure.message
    done = finished(events)
    assert [done[i] for i in ids if i != ids[1]] == [e for i, e in enumerate(expected) if i != 1]
    assert engine.kv.pool.num_used == 0


def test_a_group_whose_sampling_breaks_fails_whole_and_alone(tiny_loaded):
    expected = alone(tiny_loaded, PROMPTS[0])
    events: list = []
    engine = engine_of(tiny_loaded, events)
    group = Request(
        prompt_token_ids=(50, 51, 52), sampling=SamplingParams(temperature=0.8, n=3, seed=1, max_new_tokens=6)
    )
    gid = engine.add_request(group)
    pid = engine.add_request(Request(prompt_token_ids=tuple(PROMPTS[0]), sampling=GREEDY))
    engine.step()  # the prompts are in: the group forks on its first token
    member = next(s for s in engine.seqs.values() if s.group is not None and s.branch == 2)

    def broken(*args, **kwargs):
        raise RuntimeError("sample 2 broke")

    member.sampler.sample = broken
    run(engine, [])
    (failure,) = [e for e in events if isinstance(e, RequestFailed)]
    assert failure.request_id == gid and "sample 2 broke" in failure.message
    assert finished(events)[pid] == expected
    assert engine.kv.pool.num_used == 0


def test_token_ids_outside_the_vocabulary_are_refused_before_any_step(tiny_loaded):
    events: list = []
    engine = engine_of(tiny_loaded, events)
    vocab = tiny_loaded.info.vocab_size
    for prompt, params in (
        ((1, vocab), GREEDY),
        ((1, -1), GREEDY),
        ((1, 2), SamplingParams(temperature=0.0, logit_bias=((vocab + 5, 1.0),))),
        ((1, 2), SamplingParams(temperature=0.0, banned_token_ids=(vocab,))),
    ):
        engine.add_request(Request(prompt_token_ids=prompt, sampling=params))
    failures = [e for e in events if isinstance(e, RequestFailed)]
    assert len(failures) == 4 and all("is not in the vocabulary" in f.message for f in failures)
    assert not engine.has_work()
