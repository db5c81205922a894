"""Batch truth on the packaged SmolLM2 (issue 24), at its own bits (Q4_1/Q8_0) and in float32:
greedy replies of many concurrent prompts of mixed lengths, chunked, in a small pool that
preempts, and served again from the prefix cache, equal each prompt's reply alone. Native is
compared with native alone and float32 with float32 alone, on this machine's kernel table
(whatever it chose: every kernel computes each row alone, tests/engine/test_batch_truth.py)."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig, ModelSpec, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.request import Request
from engine.serve.load import prompt_pool

pytestmark = pytest.mark.slow
WORDS = [
    "the",
    "sky",
    "is",
    "blue",
    "because",
    "light",
    "scatters",
    "off",
    "air",
    "molecules",
    "and",
    "shorter",
    "wavelengths",
    "more",
]


def requests() -> list[Request]:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    return [
        Request.chat(f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(n)), sampling=params)
        for i, n in enumerate([3, 60, 10, 200, 30, 120])
    ]


def run(loaded, batch, engine=None, **config):
    events: list = []
    engine = engine or LLMEngine(loaded, EngineConfig(**config), events.append)
    engine.sink = events.append
    ids = [engine.add_request(r) for r in batch]
    while engine.has_work():
        engine.step()
    done = {e.request_id: list(e.token_ids) for e in events if isinstance(e, RequestFinished)}
    return [done[i] for i in ids], engine


@pytest.fixture(scope="module", params=["native", "float32"])
def packaged(request, default_loaded):
    if request.param == "float32":
        return default_loaded
    from engine.model.loading import load_model

    return load_model(ModelSpec("default"))


def test_the_packaged_model_replies_the_same_alone_batched_chunked_preempted_and_cached(packaged):
    alone = [run(packaged, [r], enable_prefix_caching=False)[0][0] for r in requests()]
    batched, _ = run(packaged, requests(), prefill_chunk_size=32, enable_prefix_caching=False)
    assert batched == alone
    squeezed, engine = run(
        packaged, requests(), num_blocks=24, max_num_batched_tokens=96, enable_prefix_caching=False
    )
    assert engine.scheduler.preemptions > 0
    assert squeezed == alone
    _, engine = run(packaged, requests())
    cached, engine = run(packaged, requests(), engine=engine)
    assert engine.kv.hit_tokens > 0
    assert cached == alone


def test_a_prompts_last_row_alone_gets_the_bits_it_gets_with_its_prompt(packaged):
    """A one-row last chunk (what a prefix-cache hit leaves of a prompt of 16k + 1 tokens): that
    row meets the prompt's kernels alone, and the reply must be the reply alone (the serve load's
    prompt 19 differed at native bits while oneDNN took its lone-row GEMV in the dense kernel)."""
    load_prompt, _ = prompt_pool(0)[19]  # 97 tokens as a chat
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    for request in [Request.chat(load_prompt, sampling=greedy), *requests()[1::2]]:
        (alone,) = LLMEngine(packaged, EngineConfig(enable_prefix_caching=False)).run([request])
        assert isinstance(alone, RequestFinished)
        chunk = alone.stats.prompt_tokens - 1  # the prompt in one chunk, then its last row
        config = EngineConfig(enable_prefix_caching=False, prefill_chunk_size=chunk)
        (split,) = LLMEngine(packaged, config).run([request])
        assert isinstance(split, RequestFinished) and split.token_ids == alone.token_ids
