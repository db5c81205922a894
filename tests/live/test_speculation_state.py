"""LiveState with speculative decoding: the page map folds rollbacks exactly (it equals the
engine's KVStats after every step) and every round is kept by request and round number."""

import torch
from hand_events import block_counts

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import BlockEvent, SpecRound, StepStats, TokenGenerated
from engine.request import Request
from engine.speculative.proposers import NgramProposer
from live.page_map import PageMap
from live.state import LiveState


class WrongProposer(NgramProposer):
    """Drafts tokens the target's greedy choice never is, so every round rolls slots back."""

    name = "wrong"

    def __init__(self, model, vocab_size: int):
        super().__init__()
        self.model, self.vocab_size = model, vocab_size

    def evidence(self, seq):
        return 1  # always something to propose

    def lookup(self, seq, k):
        with torch.inference_mode():
            best = int(self.model(torch.tensor([seq.token_ids])).logits[0, -1].argmax())
        return [(best + 1 + i) % self.vocab_size for i in range(k)], [None] * k


# Repeated text gives n-gram lookup drafts to propose; the random tiny model rejects most.
REPEATED = "one two three four five " * 8


def test_page_map_after_rollbacks_equals_the_engines_kv_stats(tiny_loaded):
    events: list = []
    config = EngineConfig(
        block_size=2, num_blocks=400, speculative=SpeculativeConfig("ngram", num_draft=6, adaptive=False)
    )
    engine = LLMEngine(tiny_loaded, config, events.append)
    engine.proposer = WrongProposer(tiny_loaded.model, len(tiny_loaded.tokenizer))
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    engine.add_request(Request.chat(REPEATED, sampling=params))
    live = LiveState()
    live.page_map = PageMap(config.num_blocks, config.block_size)  # as ModelLoaded would size it
    compared, rolled_back = 0, False
    while engine.has_work():
        engine.step()
        live.apply(events)
        steps = [e for e in events if isinstance(e, StepStats)]
        if steps:
            assert block_counts(live.page_map) == block_counts(steps[-1].kv)
            compared += 1
        seen_ops = {e.op for e in events if isinstance(e, BlockEvent)}
        if "rollback" in seen_ops:
            rolled_back = True
        events.clear()
    assert compared > 0
    assert rolled_back, "the test prompt must force at least one rollback"
    assert not live.errors, list(live.errors)
    assert live.page_map.used_blocks == 0


def test_rounds_are_kept_by_request_and_round_and_found_from_a_token(tiny_loaded):
    events: list = []
    config = EngineConfig(block_size=4, num_blocks=400, speculative=SpeculativeConfig("ngram", num_draft=4))
    engine = LLMEngine(tiny_loaded, config, events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    request_id = engine.add_request(Request.chat(REPEATED, sampling=params))
    while engine.has_work():
        engine.step()
    live = LiveState()
    dirty = live.apply(events)
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert rounds and "speculation" in dirty
    assert set(live.spec_rounds) == {(request_id, r.round) for r in rounds}
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    marked = [t for t in tokens if t.spec_round >= 0]
    assert marked
    for token in marked:
        found = live.spec_round(request_id, token.index)
        assert found is not None and found.round == token.spec_round
        assert token.token_id in found.emitted
