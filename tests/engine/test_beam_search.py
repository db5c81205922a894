"""Beam search on shared KV blocks equals transformers' generate(num_beams=K, do_sample=False):
the same ranked sequences and scores, for several widths, length penalties and every
early-stopping mode, under chunked prefill, a tight token budget and preemption; beams fork and
free their blocks, and the pool ends as it started."""

import pytest
import torch
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import (
    BeamStep,
    BlockEvent,
    RequestFailed,
    RequestFinished,
    SequenceFinished,
    SequenceForked,
    TokenGenerated,
)
from engine.model.loaded import LoadedModel
from engine.request import Request

VOCAB = 800
NEW = 14


@pytest.fixture(scope="module")
def tiny():
    # A wide weight init gives peaked, varied continuations (the default init repeats one token).
    model = make_tiny_llama(vocab_size=VOCAB, seed=5, initializer_range=0.3)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (13,), generator=g).tolist()
    with torch.inference_mode():
        greedy = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    # Two EOS ids (the tiny tokenizer's 2 and a token the model likes mid-reply), so beams end
    # at different lengths and n_eos changes how many candidates a step keeps.
    model.generation_config.eos_token_id = [2, greedy[1]]
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test"), prompt


def reference(model, prompt, eos_ids, k, **kw):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=kw.pop("max_new_tokens", NEW),
            eos_token_id=sorted(eos_ids),
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
            **kw,
        )
    return out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()


def run_engine(loaded, config, prompts, params):
    events = []
    engine = LLMEngine(loaded, config, events.append)
    free_at_start = engine.kv.pool.num_free
    ids = [engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)) for p in prompts]
    while engine.has_work():
        engine.step()
        engine.kv.pool.check_invariants()
    assert not [e for e in events if isinstance(e, RequestFailed)]
    assert engine.kv.pool.num_free == free_at_start, "every block is free again, pruned beams included"
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    return [done[i] for i in ids], events, engine


def assert_same_as_reference(finished, ref_seqs, ref_scores, fill):
    ours = [list(s.token_ids) for s in finished.sequences]
    assert len(ours) == len(ref_seqs)
    for tokens, ref in zip(ours, ref_seqs):
        # transformers pads the shorter hypotheses (with the pad id, or the first EOS id for pad 0)
        assert tokens == ref[: len(tokens)] and all(t == fill for t in ref[len(tokens) :])
    assert [s.score for s in finished.sequences] == pytest.approx(ref_scores, rel=1e-5, abs=1e-5)
    assert finished.token_ids == finished.sequences[0].token_ids
    assert [s.branch for s in finished.sequences] == list(range(len(ours)))


CASES = [
    (2, 1.0, False),
    (3, 1.0, True),
    (3, 0.5, "never"),
    (4, -1.0, False),
    (4, 2.0, "never"),
    (3, 0.0, True),
    (5, 1.5, False),
]


@pytest.mark.parametrize("k,length_penalty,early_stopping", CASES)
def test_beams_equal_transformers(tiny, k, length_penalty, early_stopping):
    loaded, prompt = tiny
    params = SamplingParams(
        temperature=0.0,
        num_beams=k,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_new_tokens=NEW,
    )
    (finished,), events, engine = run_engine(
        loaded, EngineConfig(block_size=4, num_blocks=120), [prompt], params
    )
    ref_seqs, ref_scores = reference(
        loaded.model, prompt, engine.eos_ids, k, length_penalty=length_penalty, early_stopping=early_stopping
    )
    fill = min(engine.eos_ids)  # pad_token_id=0 counts as unset in transformers' fill choice
    assert_same_as_reference(finished, ref_seqs, ref_scores, fill)
    assert finished.group.kind == "beams" and finished.group.num_sequences == k
    assert finished.group.shared_blocks < finished.group.unshared_blocks_equivalent
    reasons = {s.finish_reason for s in finished.sequences}
    assert reasons <= {"stop", "length"}


def test_the_hypotheses_end_on_eos_and_by_length(tiny):
    """The fixture's EOS choice makes some beams stop early: the comparison covers both ends."""
    loaded, prompt = tiny
    params = SamplingParams(temperature=0.0, num_beams=3, early_stopping=True, max_new_tokens=NEW)
    (finished,), _, _ = run_engine(loaded, EngineConfig(block_size=4, num_blocks=120), [prompt], params)
    assert {s.finish_reason for s in finished.sequences} == {"stop", "length"}


def test_beam_steps_describe_the_tree_and_its_blocks(tiny):
    loaded, prompt = tiny
    k = 3
    params = SamplingParams(temperature=0.0, num_beams=k, max_new_tokens=NEW)
    (finished,), events, _ = run_engine(loaded, EngineConfig(block_size=4, num_blocks=120), [prompt], params)
    steps = [e for e in events if isinstance(e, BeamStep)]
    assert [s.step for s in steps] == list(range(len(steps))) and steps[-1].done
    assert not any(s.done for s in steps[:-1])
    assert all(p == 0 for p in steps[0].parents), "every first beam extends the prompt"
    # Each step's beams are owned by live sequences: the prompt's, or ones forked before it.
    forked = {e.seq_id for e in events if isinstance(e, SequenceForked)}
    pruned = [e for e in events if isinstance(e, SequenceFinished)]
    assert all(set(s.seq_ids) <= forked | {finished.request_id} for s in steps)
    assert all(e.finish_reason == "pruned" for e in pruned)
    assert finished.group.forks == len(forked) and finished.group.pruned == len(pruned)
    assert not [e for e in events if isinstance(e, TokenGenerated)], "beams stream no tokens"
    # running scores are sums of log-probs: they only fall
    for before, after in zip(steps, steps[1:]):
        for parent, score in zip(after.parents, after.scores):
            assert score <= before.scores[parent]
    cows = [e for e in events if isinstance(e, BlockEvent) and e.op == "cow"]
    assert len(cows) == finished.group.cow_copies > 0
    for cow in cows:
        assert len(cow.src_block_ids) == len(cow.block_ids) == len(cow.fills) == 1
        assert 0 < cow.fills[0] < 4, "only a partly filled block is copied"


SCHEDULES = {
    "block 1 (never a partial block)": EngineConfig(block_size=1, num_blocks=400),
    "chunked prefill, block 5": EngineConfig(block_size=5, num_blocks=100, prefill_chunk_size=4),
    "budget = beams": EngineConfig(block_size=4, num_blocks=120, max_num_batched_tokens=3),
    "prefix cache off": EngineConfig(block_size=4, num_blocks=120, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_beams_equal_transformers_under_any_schedule(tiny, name):
    loaded, prompt = tiny
    params = SamplingParams(temperature=0.0, num_beams=3, max_new_tokens=NEW)
    (finished,), _, engine = run_engine(loaded, SCHEDULES[name], [prompt], params)
    ref_seqs, ref_scores = reference(loaded.model, prompt, engine.eos_ids, 3)
    assert_same_as_reference(finished, ref_seqs, ref_scores, min(engine.eos_ids))


def test_two_beam_searches_under_preemption(tiny):
    """A pool too small for both searches: the newest is preempted as a whole group, recomputed
    (each beam re-prefills its own tokens, in lockstep) and still gives transformers' answer."""
    loaded, prompt = tiny
    other = prompt[::-1]
    params = SamplingParams(temperature=0.0, num_beams=3, max_new_tokens=NEW)
    finished, events, engine = run_engine(
        loaded, EngineConfig(block_size=4, num_blocks=16), [prompt, other], params
    )
    assert engine.scheduler.preemptions > 0, "the pool is small enough to force preemption"
    assert sum(f.stats.preemptions for f in finished) == engine.scheduler.preemptions
    for p, f in zip([prompt, other], finished):
        ref_seqs, ref_scores = reference(loaded.model, p, engine.eos_ids, 3)
        assert_same_as_reference(f, ref_seqs, ref_scores, min(engine.eos_ids))


def test_repetition_penalty_is_applied_to_log_probs_as_transformers_does(tiny):
    loaded, prompt = tiny
    params = SamplingParams(temperature=0.0, num_beams=3, repetition_penalty=1.3, max_new_tokens=NEW)
    (finished,), _, engine = run_engine(loaded, EngineConfig(block_size=4, num_blocks=120), [prompt], params)
    ref_seqs, ref_scores = reference(loaded.model, prompt, engine.eos_ids, 3, repetition_penalty=1.3)
    assert_same_as_reference(finished, ref_seqs, ref_scores, min(engine.eos_ids))


def test_cancel_mid_search_returns_the_running_beams_and_frees_everything(tiny):
    loaded, prompt = tiny
    events = []
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=120), events.append)
    rid = engine.add_request(
        Request(prompt_token_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0, num_beams=3))
    )
    for _ in range(4):  # the prompt's step chooses the first token, each decode step one more
        engine.step()
    engine.abort(rid)
    (finished,) = [e for e in events if isinstance(e, RequestFinished)]
    assert finished.finish_reason == "cancelled" and len(finished.sequences) == 3
    assert all(s.finish_reason == "cancelled" and len(s.token_ids) == 4 for s in finished.sequences)
    scores = [s.score for s in finished.sequences]
    assert scores == sorted(scores, reverse=True)
    assert engine.kv.pool.num_used == 0 and not engine.has_work()


@pytest.mark.parametrize(
    "fields,words",
    [
        (dict(num_beams=2, temperature=0.7), "temperature 0"),
        (dict(num_beams=2, n=2, temperature=0.0), "not both"),
        (dict(num_beams=2, temperature=0.0, early_stopping="sometimes"), "early_stopping"),
        (dict(num_beams=0), "num_beams"),
        (dict(num_beams=2, temperature=0.0, stop=("x",)), "stop strings"),
    ],
)
def test_bad_beam_settings_are_refused_in_words(fields, words):
    with pytest.raises(ConfigError, match=words):
        SamplingParams(**fields)


def test_more_beams_than_the_engine_runs_at_once_fail_the_request(tiny):
    loaded, prompt = tiny
    events = []
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=120, max_num_seqs=2), events.append)
    engine.add_request(
        Request(prompt_token_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0, num_beams=3))
    )
    (failed,) = [e for e in events if isinstance(e, RequestFailed)]
    assert "max_num_seqs" in failed.message and "3" in failed.message
    assert not engine.has_work()
