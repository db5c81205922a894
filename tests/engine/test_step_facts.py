"""One source per fact: each StepStats carries the LM-head rows the runner computed and a cost
computed from them, whatever the step's mode (plain, a speculative round of 4 drafts, the fork
of n=4 samples, 3 beams); and a speculative step's forward time excludes its drafting."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core import llm_engine as llm_engine_module
from engine.core.llm_engine import LLMEngine
from engine.events import StepStats
from engine.request import Request

PROMPT = tuple(range(100, 130)) + tuple(range(100, 110))  # a repeat: n-gram drafts find matches


class FourDrafts:
    """Always proposes 4 tokens (an n-gram lookup without a match would propose fewer)."""

    name = "four"
    free = True
    forwards = 1
    reads_hidden = False
    middle_layer = 0

    def evidence(self, seq):
        return 1  # always something to propose

    def propose(self, seqs, ks):
        return [
            ([(seq.token_ids[-1] + 1 + i) % 500 for i in range(k)], [None] * k) for seq, k in zip(seqs, ks)
        ]

    def on_verified(self, seq, valid_tokens):
        pass

    def release(self, seq):
        pass

    def memory_bytes(self):
        return 0, 0


def run_recording_rows(loaded, params: SamplingParams, **config) -> tuple[list[StepStats], list[int]]:
    events: list = []
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, **config), events.append)
    if engine.proposer is not None:
        engine.proposer = FourDrafts()
    computed = []
    forward = engine.runner.forward

    def recording(seqs, num_tokens, counts):
        result = forward(seqs, num_tokens, counts)
        # the rows the LM head really ran, and the tokens the layers ran
        computed.append((result.logits.shape[0], sum(num_tokens)))
        return result

    engine.runner.forward = recording
    engine.add_request(Request(prompt_token_ids=PROMPT, sampling=params))
    while engine.has_work():
        engine.step()
    return [e for e in events if isinstance(e, StepStats)], computed


CASES = {
    "plain": (SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True), {}),
    "speculation, 4 drafts": (
        SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        {"speculative": SpeculativeConfig("ngram", num_draft=4, adaptive=False)},
    ),
    "n=4 samples": (SamplingParams(temperature=0.8, n=4, seed=1, max_new_tokens=5, ignore_eos=True), {}),
    "3 beams": (SamplingParams(temperature=0.0, num_beams=3, max_new_tokens=5, ignore_eos=True), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_roofline_rows_and_flops_are_what_the_runner_computed(tiny_loaded, case):
    params, config = CASES[case]
    steps, computed = run_recording_rows(tiny_loaded, params, **config)
    assert [s.logit_rows for s in steps] == [rows for rows, _ in computed]
    shapes = tiny_loaded.info.shapes
    h, vocab = shapes.hidden_size, shapes.vocab_size
    per_token = (
        2
        * shapes.num_layers
        * (  # q, k, v, o and the MLP's three, per layer
            2 * h * shapes.num_heads * shapes.head_dim
            + 2 * h * shapes.num_kv_heads * shapes.head_dim
            + 3 * h * shapes.intermediate_size
        )
    )
    for s, (rows, tokens) in zip(steps, computed, strict=True):
        assert s.cost is not None and s.cost.breakdown["logit_rows"] == rows
        # the FLOPs of what the runner ran, counted here by hand: the head's rows and the
        # layers' tokens (attention's term depends on the contexts, which the runner owns)
        assert s.cost.breakdown["flops_lm_head"] == 2 * rows * h * vocab
        assert s.cost.breakdown["flops_qkvo"] + s.cost.breakdown["flops_mlp"] == per_token * tokens
        assert s.cost.flops == per_token * tokens + 2 * rows * h * vocab + s.cost.breakdown["flops_attention"]
        assert s.kernel  # the kernels the linears ran
    if case == "speculation, 4 drafts":
        rounds = [s for s in steps if s.decode_tokens]
        # each round verifies its token and its drafts (4, fewer near max_new_tokens)
        assert all(s.logit_rows == s.decode_tokens for s in rounds)
        assert [s.logit_rows for s in rounds].count(5) >= 1
    if case == "n=4 samples":
        fork = next(s for s in steps if s.prefill_tokens)  # the prompt's last row, read by 4 samples
        assert fork.logit_rows == 1
        assert max(s.logit_rows for s in steps) == 4
    if case == "3 beams":
        assert [s.logit_rows for s in steps if s.decode_tokens] and all(
            s.logit_rows == 3 for s in steps if s.decode_tokens
        )


class FakeClock:
    """time.perf_counter for the engine: advanced only by the proposer and the runner."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_speculative_steps_forward_time_excludes_drafting(tiny_loaded, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(llm_engine_module.time, "perf_counter", clock)
    events: list = []
    engine = LLMEngine(
        tiny_loaded, EngineConfig(num_blocks=64, speculative=SpeculativeConfig("ngram", 4)), events.append
    )
    propose, forward = engine.proposer.propose, engine.runner.forward

    def slow_propose(seqs, ks):
        clock.now += 10.0
        return propose(seqs, ks)

    def timed_forward(*args):
        clock.now += 1.0
        return forward(*args)

    engine.proposer.propose = slow_propose
    engine.runner.forward = timed_forward
    engine.add_request(
        Request(
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True),
        )
    )
    while engine.has_work():
        engine.step()
    steps = [e for e in events if isinstance(e, StepStats)]
    drafted = [s for s in steps if s.draft_s > 0]
    assert drafted, "the repeat gives the n-gram proposer rounds to draft"
    for s in steps:
        assert s.forward_s == 1.0  # the target forward alone
        assert s.draft_s in (0.0, 10.0)  # one decoding sequence asked the proposer, or none
        assert s.duration_s >= s.draft_s + s.forward_s
