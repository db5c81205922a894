"""A request can continue a reply from given tokens (a branch from a chosen token): its tokens are
those of a fresh request whose prompt is the conversation plus that prefix, and the prefix's KV
blocks come from the prefix cache instead of being recomputed."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished, StepStats
from engine.request import ChatMessage, Request

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
MESSAGES = (ChatMessage("system", "You are terse. " * 6), ChatMessage("user", "Name a colour and say why."))


def finish(engine: LLMEngine, events: list, request: Request) -> RequestFinished:
    request_id = engine.add_request(request)
    while engine.has_work():
        engine.step()
    return next(e for e in events if isinstance(e, RequestFinished) and e.request_id == request_id)


def test_a_branch_equals_a_fresh_request_and_reuses_the_prefix_blocks(tiny_loaded):
    events: list = []
    engine = LLMEngine(tiny_loaded, EngineConfig(block_size=4, num_blocks=256), events.append)
    first = finish(engine, events, Request(messages=MESSAGES, sampling=GREEDY))
    chosen = (first.token_ids[4] + 1) % len(tiny_loaded.tokenizer)  # an alternative at position 4
    prefix = (*first.token_ids[:4], chosen)

    steps_before = len([e for e in events if isinstance(e, StepStats)])
    branch = finish(engine, events, Request(messages=MESSAGES, sampling=GREEDY, reply_prefix_ids=prefix))
    template_ids = engine.prompt_ids(Request(messages=MESSAGES))
    assert branch.stats.prompt_tokens == len(template_ids) + len(prefix)
    # The conversation and the reply's first four tokens are in the first request's full blocks:
    # every whole block of them is served from the cache; the chosen token and after are computed.
    assert branch.stats.cached_prompt_tokens == (len(template_ids) + 4) // 4 * 4
    steps = [e for e in events if isinstance(e, StepStats)]
    hits = steps[steps_before].prefix_hit_tokens - steps[steps_before - 1].prefix_hit_tokens
    assert hits == branch.stats.cached_prompt_tokens  # the step stats show the cached prompt tokens

    fresh_events: list = []
    fresh = LLMEngine(
        tiny_loaded,
        EngineConfig(block_size=4, num_blocks=256, enable_prefix_caching=False),
        fresh_events.append,
    )
    reference = finish(
        fresh, fresh_events, Request(prompt_token_ids=(*template_ids, *prefix), sampling=GREEDY)
    )
    assert branch.token_ids == reference.token_ids
    assert reference.stats.cached_prompt_tokens == 0


def test_a_reply_prefix_needs_chat_messages():
    with pytest.raises(ConfigError, match="needs chat messages"):
        Request(prompt_token_ids=(1, 2), reply_prefix_ids=(3,))
