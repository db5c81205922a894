"""The hidden-state self-draft: the engine hands it what the head read at the row each
sequence's last token was drawn from and the residual entering its middle layer there, it
chains drafts through its map and head, greedy output
stays the target's, and its plan is calibrated, kept and read back like a layer draft's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished, SpecRound
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.speculative import self_draft
from engine.speculative.hidden_draft import HiddenStateDrafter
from engine.speculative.self_draft import HIDDEN, Calibration, calibrate, hidden_draft_input

VOCAB = 300
NEW = 24
PROMPTS = [[5, 6, 7, 8] * 6, list(range(10, 40)), [3, 4] * 10 + [9]]


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=9, num_hidden_layers=4, tie_word_embeddings=False)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


def run(tiny, proposer=None, spec=None, prompts=PROMPTS, new=NEW):
    events: list = []
    spec = spec or SpeculativeConfig("ngram", num_draft=3, adaptive=False)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=300, speculative=spec), events.append)
    if proposer is not None:
        engine.proposer = proposer
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    ids = [engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)) for p in prompts]
    while engine.has_work():
        engine.step()
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    return [list(done[i].token_ids) for i in ids], events, engine


def plain_greedy(tiny, prompts, new=NEW):
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=600))
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    requests = [Request(prompt_token_ids=tuple(p), sampling=params) for p in prompts]
    return [list(end.token_ids) for end in engine.run(requests)]


@pytest.fixture(scope="module")
def replies(tiny):
    """The tiny target's own greedy replies (what a calibration fits on)."""
    prompts = [[(7 * i + j) % VOCAB for j in range(12)] for i in range(16)]
    outs = plain_greedy(tiny, prompts, new=40)
    return Calibration([p + o for p, o in zip(prompts, outs)], [len(p) for p in prompts])


@pytest.fixture(scope="module")
def fitted(tiny, replies):
    return calibrate(tiny, replies, layers=HIDDEN)


def drafter(tiny, fitted, confidence=0.0):
    """The fitted hidden-state draft, drafting at `confidence` (0: always)."""
    plan = dataclasses.replace(fitted.plan, confidence=confidence)
    return HiddenStateDrafter(
        dataclasses.replace(fitted, plan=plan), tiny.model.get_input_embeddings(), VOCAB
    )


def test_the_calibration_measures_the_hidden_draft_beside_the_layer_drafts(tiny, replies, fitted):
    assert fitted.plan.layers == HIDDEN and fitted.map is not None
    hidden = tiny.info.hidden_size
    assert (fitted.map.out_features, fitted.map.in_features) == (hidden, 3 * hidden)
    assert fitted.plan.middle == self_draft.middle_layer(4) == 3
    assert fitted.head.out_features == fitted.plan.vocab
    # the choice of every candidate, the hidden draft among them, its cost the bytes its map and
    # its head's rows hold
    chosen = calibrate(tiny, replies)
    assert {m[0] for m in chosen.plan.measured} == {HIDDEN, *self_draft.candidate_layers(4)}
    layers = tiny.model.model.layers
    step = sum(self_draft.model_weight_bytes(layer) for layer in layers)
    step += self_draft.model_weight_bytes(tiny.model.get_output_embeddings())

    def held(module):
        return sum(t.numel() * t.element_size() for t in module.storage.tensors())

    head_row = held(fitted.head) / fitted.head.out_features
    for n, vocab, _, _, _, cost in chosen.plan.measured:
        if n == HIDDEN:
            assert cost == pytest.approx((held(fitted.map) + vocab * head_row) / step)


def test_the_engine_hands_over_what_the_head_read_where_the_last_token_was_drawn(tiny, fitted):
    """At every proposal the kept state is the row the sequence's last token came from: the
    target's own head on it gives that token back, and the kept middle residual is what
    transformers' forward has entering that layer at that position, after plain steps and after
    rounds that kept some drafts and rejected others."""
    proposer = drafter(tiny, fitted)
    checked = []
    propose = proposer.propose

    def checking(seqs, ks):
        for seq in seqs:
            length, state, middle = proposer._hidden[seq.seq_id]
            assert length == len(seq.token_ids)
            logits = engine.runner.own_forward.head_logits(state[None])
            ids = torch.tensor([seq.token_ids[:-1]])
            with torch.inference_mode():
                out = tiny.model.model(input_ids=ids, output_hidden_states=True)
            expected = out.hidden_states[fitted.plan.middle][0, -1]
            checked.append(
                int(logits.argmax()) == seq.token_ids[-1]
                and torch.allclose(middle, expected, rtol=1e-4, atol=1e-4)
            )
        return propose(seqs, ks)

    proposer.propose = checking
    events: list = []
    spec = SpeculativeConfig("ngram", num_draft=3, adaptive=False)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=300, speculative=spec), events.append)
    engine.proposer = proposer
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    for prompt in PROMPTS:
        engine.add_request(Request(prompt_token_ids=tuple(prompt), sampling=params))
    while engine.has_work():
        engine.step()
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert len(checked) > 20 and all(checked)
    assert any(r.accepted > 0 for r in rounds) and any(r.accepted < len(r.draft_ids) for r in rounds)
    assert not proposer._hidden, "a finished sequence's state is released"


def test_greedy_with_the_hidden_draft_is_plain_greedy(tiny, fitted):
    plain = plain_greedy(tiny, PROMPTS)
    outs, events, _ = run(tiny, drafter(tiny, fitted))
    assert outs == plain
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert rounds and sum(r.accepted for r in rounds) > 0, "some drafts were kept"
    assert sum(len(r.draft_ids) for r in rounds) > len(rounds), "drafts chained past the first"


def test_at_no_drafts_the_state_is_kept_only_for_the_steps_that_may_draft(tiny, fitted):
    """A sequence the tuner has stopped drafting for: the forward keeps the middle residual (and
    the drafter the state) only before a step that may draft, and every probe still drafts."""
    spec = SpeculativeConfig("ngram", num_draft=2, adaptive=True)
    events: list = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=300, speculative=spec), events.append)
    engine.proposer = drafter(tiny, fitted)  # drafting at any confidence: every probe drafts
    tuner = engine.tuner
    tuner.costs.observe_step(1, 0.010)
    tuner.costs.observe_step(3, 0.016)
    for seq in range(-3, 0):  # the engine learned that drafts do not pay
        for _ in range(6):
            tuner.round_done(
                seq, drafted=2, accepted=0, step_rows=3, step_s=0.016, decoding=1, draft_share_s=0.004
            )
    kept_middle, asked = [], []
    forward, choose = engine.runner.forward, tuner.choose

    def recording_forward(*args):
        kept_middle.append(engine.runner.own_forward.keep_middle)
        return forward(*args)

    def recording_choose(*args, **kwargs):
        asked.append(choose(*args, **kwargs))
        return asked[-1]

    engine.runner.forward, tuner.choose = recording_forward, recording_choose
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    (end,) = engine.run([Request(prompt_token_ids=tuple(PROMPTS[1]), sampling=params)])
    assert [list(end.token_ids)] == plain_greedy(tiny, [PROMPTS[1]], new=40)
    probes = sum(1 for k in asked if k)
    assert probes >= 2, "it probed"
    assert len([e for e in events if isinstance(e, SpecRound)]) == probes, "each probe had its state"
    assert kept_middle.count(0) > len(kept_middle) // 2, "most steps kept no middle residual"


def test_drafts_chain_through_the_map_and_the_head(tiny, fitted):
    proposer = drafter(tiny, fitted)
    state = torch.randn(tiny.info.hidden_size)

    class Seq:
        seq_id, params = 1, SamplingParams(temperature=0.0)
        token_ids = [4, 5, 6]
        num_prompt_tokens, output_ids = 3, []

    middle = 3 * torch.randn(tiny.info.hidden_size)
    proposer.observe_hidden(Seq, state, middle, 3)
    ((tokens, qs),) = proposer.propose([Seq], [3])
    f, token, expected = state[None], 6, []
    embed = tiny.model.get_input_embeddings()
    with torch.inference_mode():
        for _ in range(3):  # every draft reads the middle residual of the last position run
            x = hidden_draft_input(f, embed(torch.tensor([token])).float(), middle[None])
            f = fitted.map(x).float()
            token = int(fitted.head(f).argmax())
            expected.append(token)
    assert tokens == expected and qs == [None] * 3 and proposer.forwards == 3


def test_no_draft_below_the_threshold_or_from_a_state_of_other_tokens(tiny, fitted):
    class Seq:
        seq_id, params = 2, SamplingParams(temperature=0.0)
        token_ids = [4, 5, 6]
        num_prompt_tokens, output_ids = 3, []

    state = torch.randn(tiny.info.hidden_size)
    sure = drafter(tiny, fitted, confidence=1.01)  # no draft is that confident
    sure.observe_hidden(Seq, state, state, 3)
    assert sure.propose([Seq], [3]) == [([], [])]
    stale = drafter(tiny, fitted)
    stale.observe_hidden(Seq, state, state, 2)  # the state of a sequence one token shorter
    assert stale.propose([Seq], [3]) == [([], [])]


def test_the_hidden_plan_is_kept_and_read_back(tiny, fitted, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    self_draft.save_plan(tiny, fitted)
    back = self_draft.load_plan(tiny)
    assert back is not None and back.plan == fitted.plan and back.map is not None
    x = torch.randn(2, 3 * tiny.info.hidden_size)
    with torch.inference_mode():
        assert torch.equal(back.map(x), fitted.map(x))
        assert torch.equal(
            back.head(x[:, : tiny.info.hidden_size]), fitted.head(x[:, : tiny.info.hidden_size])
        )


def test_the_draft_keeps_its_rows_as_q8_0_blocks_on_kvk_and_as_int8_rows_without(
    tiny, fitted, tmp_path, monkeypatch
):
    """Q8_0 where kvk runs (gguf's own blocks: the weights within half a block step), int8 rows
    on torch's kernel where it does not; a plan cached on one reads back on the other."""
    from gguf import GGMLQuantizationType, quants

    from engine.kernels import native
    from engine.kernels.gguf_weight import GGUFWeight
    from engine.kernels.weights import Int8RowWeight

    if native.kernels() is None:
        pytest.skip("no kvk kernels in this build")
    weight = torch.randn(40, 96)
    q8 = self_draft.draft_storage(weight)
    assert isinstance(q8, GGUFWeight) and q8.ggml_type == GGMLQuantizationType.Q8_0
    blocks = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    assert torch.equal(
        q8.dequantize(), torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0))
    )
    step = weight.reshape(40, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(
        ((q8.dequantize().reshape(40, 3, 32) - weight.reshape(40, 3, 32)).abs() <= step * 0.57).all()
    )  # (d itself rounded to float16)
    assert self_draft.draft_bytes(40, 96) == q8.nbytes == 40 * 3 * 34

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    assert isinstance(fitted.map.storage, GGUFWeight)
    self_draft.save_plan(tiny, fitted)
    monkeypatch.setattr(native, "kernels", lambda: None)
    assert isinstance(self_draft.draft_storage(weight), Int8RowWeight)
    assert self_draft.draft_bytes(40, 96) == 40 * (96 + 4)
    back = self_draft.load_plan(tiny)
    assert back is not None and isinstance(back.map.storage, Int8RowWeight)
    want = fitted.map.storage.dequantize()
    assert float((back.map.storage.dequantize() - want).abs().max()) <= float(want.abs().max()) / 127


def test_the_self_method_runs_the_hidden_draft_when_asked(tiny, replies, monkeypatch, tmp_path):
    """`self_draft_layers=0` makes the hidden-state draft, fitted on the target's replies."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(LLMEngine, "_greedy_replies", lambda self, prompts, new: replies)
    spec = SpeculativeConfig("self", num_draft=2, self_draft_layers=HIDDEN, adaptive=False)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=100, speculative=spec))
    assert isinstance(engine.proposer, HiddenStateDrafter)
    assert engine.proposer.name.startswith("self (the target's hidden state")


def test_sampled_drafts_carry_the_distribution_they_were_drawn_from(tiny, fitted):
    """Under sampling a draft's q is its own distribution over the whole vocabulary (the ids its
    head lacks at 0), which the verifier needs to keep the target's distribution."""
    events: list = []
    spec = SpeculativeConfig("ngram", num_draft=3, adaptive=False)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=300, speculative=spec), events.append)
    engine.proposer = drafter(tiny, fitted)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=NEW, ignore_eos=True, seed=3)
    engine.add_request(Request(prompt_token_ids=tuple(PROMPTS[0]), sampling=params))
    while engine.has_work():
        engine.step()
    rounds = [e for e in events if isinstance(e, SpecRound)]
    (done,) = [e for e in events if isinstance(e, RequestFinished)]
    assert rounds and len(done.token_ids) == NEW
    q = [p for r in rounds for p in r.q_probs]
    assert all(0.0 < p < 1.0 for p in q), "drawn from a distribution, not one-hot"
