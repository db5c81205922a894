"""Greedy fp32 output of the engine equals transformers' generate(do_sample=False), token for token,
under continuous batching, chunked prefill, prefix caching and preemption."""

import pytest
import torch
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFailed, RequestFinished
from engine.model.loaded import LoadedModel
from engine.request import Request

VOCAB = 800
NEW = 24


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=5)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


@pytest.fixture(scope="module")
def prompts_and_refs(tiny):
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB, (21,), generator=g).tolist()  # a shared "system prompt"
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 40, 17)] + [
        shared + [5, 6, 7],
        shared + [9, 10],
    ]
    refs = []
    for p in prompts:
        with torch.inference_mode():
            out = tiny.model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        refs.append(out[0, len(p) :].tolist())
    return prompts, refs


def run(tiny, config, prompts, staggered=False):
    events = []
    engine = LLMEngine(tiny, config, events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)))
        if staggered:  # arrivals while others decode: continuous batching
            for _ in range(i + 1):
                if engine.has_work():
                    engine.step()
    while engine.has_work():
        engine.step()
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_used == 0, "every block is released when all requests end"
    assert not [e for e in events if isinstance(e, RequestFailed)]
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    return [list(done[i].token_ids) for i in ids], engine, events


CONFIGS = {
    "whole-prompt, block 16": EngineConfig(block_size=16, num_blocks=64),
    "chunk 1, block 1": EngineConfig(block_size=1, num_blocks=600, prefill_chunk_size=1),
    "chunk 7, block 5": EngineConfig(block_size=5, num_blocks=120, prefill_chunk_size=7),
    "prefix cache off": EngineConfig(block_size=4, num_blocks=150, enable_prefix_caching=False),
    "tight budget": EngineConfig(block_size=8, num_blocks=64, max_num_batched_tokens=9),
    "one seq at a time": EngineConfig(block_size=8, num_blocks=64, max_num_seqs=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_generate(tiny, prompts_and_refs, name):
    prompts, refs = prompts_and_refs
    outs, _, _ = run(tiny, CONFIGS[name], prompts, staggered=True)
    assert outs == refs


def test_preemption_keeps_outputs_exact(tiny, prompts_and_refs):
    prompts, refs = prompts_and_refs
    outs, engine, events = run(tiny, EngineConfig(block_size=4, num_blocks=20), prompts)
    assert engine.scheduler.preemptions > 0, "the pool is small enough to force preemption"
    assert outs == refs
    stats = {e.request_id: e.stats for e in events if isinstance(e, RequestFinished)}
    assert sum(s.preemptions for s in stats.values()) == engine.scheduler.preemptions


def test_prefix_cache_hits_a_shared_system_prompt(tiny, prompts_and_refs):
    prompts, refs = prompts_and_refs
    # staggered: the first prompt's blocks are committed (and hashed) before the second arrives
    outs, engine, events = run(tiny, EngineConfig(block_size=4, num_blocks=200), prompts[3:], staggered=True)
    assert outs == refs[3:]
    finished = [e for e in events if isinstance(e, RequestFinished)]
    # the second request shares the 21-token prefix: 5 full blocks of 4
    assert [f.stats.cached_prompt_tokens for f in finished] == [0, 20]
    shares = [e for e in events if getattr(e, "op", None) == "share"]
    assert len(shares) == 1 and len(shares[0].block_ids) == 5


def test_step_never_exceeds_token_budget(tiny, prompts_and_refs):
    from engine.events import StepStats

    prompts, _ = prompts_and_refs
    _, _, events = run(tiny, EngineConfig(block_size=8, num_blocks=64, max_num_batched_tokens=13), prompts)
    steps = [e for e in events if isinstance(e, StepStats)]
    assert steps and all(s.prefill_tokens + s.decode_tokens <= 13 for s in steps)
    assert any(s.prefill_tokens and s.decode_tokens for s in steps), "prefill chunks share steps with decodes"


def test_a_prompt_larger_than_the_pool_fails_with_a_clear_message(tiny):
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=3), events.append)
    engine.add_request(
        Request(prompt_token_ids=tuple(range(3, 30)), sampling=SamplingParams(max_new_tokens=2))
    )
    (failed,) = [e for e in events if isinstance(e, RequestFailed)]
    assert "KV pool" in failed.message and "12" in failed.message
    assert not engine.has_work()


def test_a_reply_that_outgrows_the_pool_fails_without_spinning(tiny):
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=3), events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=tuple(range(3, 8)), sampling=params))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 100
    (failed,) = [e for e in events if isinstance(e, RequestFailed)]
    assert "too small" in failed.message
    tokens = [e for e in events if getattr(e, "token_id", None) is not None]
    assert len(tokens) == 12 - 5 + 1  # it ran until the 12 slots were full
    assert engine.kv.pool.num_used == 0
    engine.kv.pool.check_invariants()
