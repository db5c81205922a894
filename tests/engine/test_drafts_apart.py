"""Speculative drafts are kept apart from a sequence's tokens (vLLM's spec_token_ids): at every
moment `token_ids` holds the prompt and the tokens the engine has streamed, never a draft; the
round's drafts sit in `spec_token_ids`, the scheduler counts them (it schedules the committed
tokens' last one and the drafts after it), and the forward computes them after the committed
tokens at their positions."""

from __future__ import annotations

import pytest
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import TokenGenerated
from engine.model.loaded import LoadedModel
from engine.request import Request

VOCAB = 300


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=9, num_hidden_layers=2)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_token_ids_never_hold_a_draft(tiny, method):
    events: list = []
    spec = SpeculativeConfig(method, num_draft=3, self_draft_layers=1)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=200, speculative=spec), events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompts = {
        engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)): list(p)
        for p in ([5, 6, 7, 8] * 5, [3, 4] * 8 + [9])
    }

    def streamed(request_id: int) -> list[int]:
        return [e.token_id for e in events if isinstance(e, TokenGenerated) and e.request_id == request_id]

    seen_drafts = []
    forward = engine.runner.forward

    def checked_forward(seqs, num_tokens, logit_counts, observer=None):
        for seq, n in zip(seqs, num_tokens):
            committed = prompts[seq.seq_id] + streamed(seq.seq_id)
            assert seq.token_ids == committed, "token_ids are the prompt and the streamed tokens only"
            assert seq.num_tokens == len(committed)
            assert seq.num_tokens_with_spec == len(committed) + len(seq.spec_token_ids)
            if seq.spec_token_ids:
                seen_drafts.append(len(seq.spec_token_ids))
                # the scheduler counted the drafts: the committed tokens' last one and every draft
                assert seq.num_computed_tokens + n == seq.num_tokens_with_spec
                assert n == 1 + len(seq.spec_token_ids)
                # what the forward computes there: the last committed token, then the drafts
                start = seq.num_computed_tokens
                assert seq.tokens_with_spec(start, start + n) == [committed[-1], *seq.spec_token_ids]
                assert logit_counts[seq.seq_id] == n  # every draft is verified
        return forward(seqs, num_tokens, logit_counts, observer)

    engine.runner.forward = checked_forward
    while engine.has_work():
        engine.step()
        for seq in engine.seqs.values():
            assert seq.spec_token_ids == [], "a round's drafts end with its step"
            assert seq.token_ids == prompts[seq.seq_id] + streamed(seq.seq_id)
    assert seen_drafts, "rounds with drafts were run"
    assert all(len(streamed(i)) == 24 for i in prompts)
