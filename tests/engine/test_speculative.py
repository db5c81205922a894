"""Speculative decoding: exact greedy output with every proposer, a verifier that keeps the
target distribution, and clean KV rollback after rejections."""

import pytest
import torch
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.core.drafter import ModelDrafter
from engine.core.llm_engine import LLMEngine
from engine.events import BlockEvent, RequestFinished, SpecRound, TokenGenerated
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.speculative.proposers import NgramProposer
from engine.speculative.self_draft import draft_model, first_layers_draft
from engine.speculative.verify import verify, verify_greedy

VOCAB = 300
NEW = 30


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=9, num_hidden_layers=4, tie_word_embeddings=False)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


# repetitive prompts give n-gram lookup something to find
PROMPTS = [[5, 6, 7, 8] * 6, list(range(10, 40)), [3, 4] * 10 + [9]]


def generate(tiny, speculative=None, params=None, proposer=None):
    events = []
    engine = LLMEngine(
        tiny, EngineConfig(block_size=4, num_blocks=200, speculative=speculative), events.append
    )
    if proposer is not None:
        engine.proposer = proposer
    params = params or SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    ids = [engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)) for p in PROMPTS]
    while engine.has_work():
        engine.step()
        engine.kv.pool.check_invariants()
        for seq in engine.seqs.values():
            assert seq.num_draft_tokens == 0, "no draft survives a step unverified"
            # rolled-back slots leave no spare blocks: at most room for the next token
            assert len(seq.block_table) <= -(-(seq.num_computed_tokens + 1) // 4)
    assert engine.kv.pool.num_used == 0
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    return [list(done[i].token_ids) for i in ids], events, engine


@pytest.fixture(scope="module")
def plain(tiny):
    outs, _, _ = generate(tiny)
    return outs


@pytest.mark.parametrize(
    "spec",
    [
        SpeculativeConfig("ngram", num_draft=3, adaptive=False),
        SpeculativeConfig("ngram", num_draft=5),
        SpeculativeConfig("self", num_draft=4, self_draft_layers=2, adaptive=False),
    ],
    ids=["ngram", "ngram-adaptive", "self-2-layers"],
)
def test_greedy_with_speculation_equals_plain_greedy(tiny, plain, spec):
    outs, events, _ = generate(tiny, spec)
    assert outs == plain
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert rounds and sum(r.accepted for r in rounds) > 0, "some drafts were accepted"
    done = [e for e in events if isinstance(e, RequestFinished)]
    assert sum(d.stats.target_forwards for d in done) < sum(d.stats.generated_tokens + 1 for d in done)
    kinds = {e.spec for e in events if isinstance(e, TokenGenerated)}
    assert {"accepted", "resampled"} <= kinds or {"accepted", "bonus"} <= kinds


def test_greedy_with_a_separate_draft_model(tiny, plain):
    other = make_tiny_llama(vocab_size=VOCAB, seed=10, num_hidden_layers=1, tie_word_embeddings=False)
    loaded = LoadedModel.from_model(other, IdTokenizer(VOCAB), name="tiny draft", source="test")
    config = EngineConfig(block_size=4, num_blocks=200)
    drafter = ModelDrafter(draft_model(loaded, "draft"), config, 200, VOCAB)
    outs, events, _ = generate(tiny, SpeculativeConfig("ngram", adaptive=False), proposer=drafter)
    assert outs == plain
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert rounds and all(r.proposer == "draft" for r in rounds)
    assert any(r.accepted < len(r.draft_ids) - 1 for r in rounds), "the draft cache was cropped"


class WrongProposer(NgramProposer):
    """Always proposes tokens the target will not choose."""

    name = "wrong"

    def __init__(self, model):
        super().__init__()
        self.model = model

    def evidence(self, seq):
        return 1  # always something to propose

    def lookup(self, seq, k):
        with torch.inference_mode():
            logits = self.model(torch.tensor([seq.token_ids])).logits[0, -1]
        best = int(logits.argmax())
        return [(best + 1 + i) % VOCAB for i in range(k)], [None] * k


def test_after_forced_rejections_logits_equal_a_fresh_run(tiny, plain):
    recorded = {"plain": {}, "spec": {}}

    def recorder(engine, name):
        forward = engine.runner.forward

        def wrapped(seqs, num_tokens, counts):
            result = forward(seqs, num_tokens, counts)
            for seq, n in zip(seqs, num_tokens):
                if seq.seq_id not in result.rows:
                    continue
                start, count = result.rows[seq.seq_id]
                end = seq.num_computed_tokens + n  # the rows are the sequence's last `count` positions
                for i in range(count):
                    recorded[name][(seq.seq_id, end - count + i)] = result.logits[start + i].clone()
            return result

        engine.runner.forward = wrapped

    events = []
    spec_engine = LLMEngine(
        tiny,
        EngineConfig(block_size=4, num_blocks=200, speculative=SpeculativeConfig("ngram", 3, adaptive=False)),
        events.append,
    )
    spec_engine.proposer = WrongProposer(tiny.model)
    recorder(spec_engine, "spec")
    plain_engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=200), lambda e: None)
    recorder(plain_engine, "plain")
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    for engine in (spec_engine, plain_engine):
        engine.add_request(
            Request(
                prompt_token_ids=tuple(PROMPTS[1]),
                sampling=params,
            )
        )
        while engine.has_work():
            engine.step()
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert rounds and all(r.accepted == 0 for r in rounds)
    rollbacks = [e for e in events if isinstance(e, BlockEvent) and e.op == "rollback"]
    assert len(rollbacks) == len(rounds)
    plain_logits = {pos: v for (_, pos), v in recorded["plain"].items()}
    spec_first_rows = {pos: v for (_, pos), v in recorded["spec"].items() if pos in plain_logits}
    assert len(spec_first_rows) >= 10
    for pos, logits in spec_first_rows.items():
        torch.testing.assert_close(logits, plain_logits[pos], atol=1e-5, rtol=0)
    assert spec_engine.kv.pool.num_used == 0


def test_rollback_frees_blocks_left_empty_and_caches_only_verified_tokens(tiny):
    events = []
    engine = LLMEngine(
        tiny,
        EngineConfig(block_size=2, num_blocks=100, speculative=SpeculativeConfig("ngram", 6, adaptive=False)),
        events.append,
    )
    engine.proposer = WrongProposer(tiny.model)
    engine.add_request(
        Request(
            prompt_token_ids=(11, 12, 13),
            sampling=SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
        )
    )
    while engine.has_work():
        engine.step()
    ops = [e.op for e in events if isinstance(e, BlockEvent)]
    assert "rollback" in ops
    # every rollback that emptied blocks is followed by freeing them
    for i, e in enumerate(events):
        if isinstance(e, BlockEvent) and e.op == "rollback" and 0 in e.fills:
            emptied = {b for b, f in zip(e.block_ids, e.fills) if f == 0}
            nxt = next(x for x in events[i + 1 :] if isinstance(x, BlockEvent))
            assert nxt.op == "free" and set(nxt.block_ids) == emptied
    cached = [e for e in events if isinstance(e, BlockEvent) and e.op == "cache"]
    finished = next(e for e in events if isinstance(e, RequestFinished))
    verified = [11, 12, 13, *finished.token_ids]
    for e in cached:
        assert e.token_end <= len(verified)  # only verified positions are ever hashed


# ---- the verifier keeps the target distribution -------------------------------------------


def empirical(p, q_dist, proposals, n, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])

    def draw(probs):
        return int(torch.multinomial(probs, 1, generator=g))

    def uniform():
        return float(torch.rand((), generator=g))

    for _ in range(n):
        if q_dist is None:
            x, q = proposals, [None]
        else:
            x, q = [draw(q_dist)], [q_dist]
        verdict = verify(p, x, q, draw, uniform)
        counts[x[0] if verdict.accepted == 1 else verdict.token] += 1
    return counts / n


def always_accept(p, q_dist, n, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    for _ in range(n):
        counts[int(torch.multinomial(q_dist, 1, generator=g))] += 1
    return counts / n


N = 40_000
BOUND = 0.02  # total variation; sampling noise at N draws over 6 outcomes is ~0.005


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_verifier_output_follows_the_target_for_any_draft(seed):
    g = torch.Generator().manual_seed(100 + seed)
    target = torch.softmax(torch.randn(6, generator=g) * 1.5, 0)
    target[4] = 0.0  # a token the target never produces
    target /= target.sum()
    draft = torch.softmax(torch.randn(6, generator=g) * 1.5, 0)
    draft[1] = 0.0  # a token the draft never proposes
    draft /= draft.sum()
    p = torch.stack([target, target])
    got = empirical(p, draft, None, N, seed)
    assert tv(got, target) < BOUND
    control = always_accept(p, draft, N, seed)
    assert tv(control, target) > BOUND, "the control verifier must fail the same bound"


def test_verifier_with_a_one_hot_ngram_draft():
    target = torch.tensor([0.1, 0.5, 0.0, 0.25, 0.15, 0.0])
    p = torch.stack([target, target])
    got = empirical(p, None, [3], N, 7)  # the n-gram always proposes token 3
    assert tv(got, target) < BOUND
    assert got[2] == 0 and got[5] == 0
    one_hot = torch.zeros(6)
    one_hot[3] = 1
    assert tv(always_accept(p, one_hot, N, 7), target) > BOUND


def test_greedy_verifier_keeps_drafts_while_they_equal_the_argmax():
    p = torch.eye(5)[[2, 4, 0, 1]]  # one-hot targets: argmax 2, 4, 0, then bonus 1
    verdict = verify(p, [2, 4, 3], [None] * 3, lambda probs: int(probs.argmax()), lambda: 0.5)
    assert (verdict.accepted, verdict.token, verdict.bonus) == (2, 0, False)
    verdict = verify(p, [2, 4, 0], [None] * 3, lambda probs: int(probs.argmax()), lambda: 0.5)
    assert (verdict.accepted, verdict.token, verdict.bonus) == (3, 1, True)


def test_the_greedy_verdict_scores_only_the_rows_it_emits_from():
    """verify_greedy agrees with verify on one-hot rows, and takes a row's argmax and log-sum-exp
    only up to the row whose token it emits: the rows after a rejected draft emit nothing."""
    best, lse = [2, 4, 0, 1], [0.5, 1.5, 2.5, 3.5]
    p = torch.eye(5)[best]
    for draft, want in (([2, 4, 3], (2, 0, False)), ([2, 4, 0], (3, 1, True)), ([3, 4, 0], (0, 2, False))):
        asked: list[int] = []

        def score(i: int, asked: list[int] = asked) -> tuple[int, float]:
            asked.append(i)
            return best[i], lse[i]

        verdict = verify_greedy(score, draft)
        full = verify(p, draft, [None] * 3, lambda probs: int(probs.argmax()), lambda: 0.5)
        assert (
            (verdict.accepted, verdict.token, verdict.bonus)
            == (full.accepted, full.token, full.bonus)
            == want
        )
        assert asked == list(range(verdict.accepted + 1))
        assert verdict.log_normalizers == tuple(lse[: verdict.accepted + 1])


def test_self_draft_shares_weights_and_truncates_layers(tiny):
    draft = first_layers_draft(tiny, 2).model
    assert draft.config.num_hidden_layers == 2 and tiny.model.config.num_hidden_layers == 4
    assert len(draft.model.layers) == 2 and len(tiny.model.model.layers) == 4
    assert draft.model.layers[1] is tiny.model.model.layers[1]
    assert draft.model.embed_tokens is tiny.model.model.embed_tokens
    assert draft.lm_head.storage is tiny.model.lm_head.storage and tiny.model.model is not draft.model


def test_self_draft_copies_its_layers_kv_from_the_target_instead_of_computing_them(tiny):
    spec = SpeculativeConfig("self", num_draft=3, self_draft_layers=2, adaptive=False)
    config = EngineConfig(block_size=4, num_blocks=200, speculative=spec)
    engine = LLMEngine(tiny, config)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=tuple(PROMPTS[1]), sampling=params))
    engine.step()  # the prompt, and its first token
    (seq,) = engine.seqs.values()
    copying = engine.proposer
    assert isinstance(copying, ModelDrafter)
    ((copied, _),) = copying.propose([seq], [3])
    # the target's K/V of every token it computed, none run through the draft again: one forward
    # a draft (the first feeds the token the target has not computed yet)
    assert copying.copied_tokens == seq.num_computed_tokens == len(PROMPTS[1])
    assert copying.forwards == 3
    own = copying._seqs[seq.seq_id]
    mine = torch.tensor(copying.kv.slot_ids(own.block_table, 0, seq.num_computed_tokens))
    theirs = torch.tensor(engine.kv.slot_ids(seq.block_table, 0, seq.num_computed_tokens))
    rows_a, rows_b = copying.storage.slot_rows(mine), engine.storage.slot_rows(theirs)
    d = engine.storage.head_dim
    for layer in range(2):
        a = copying.storage.kv[layer].view(2, -1, d).index_select(1, rows_a)
        b = engine.storage.kv[layer].view(2, -1, d).index_select(1, rows_b)
        assert torch.equal(a, b) and bool(b.abs().sum() > 0)
    # a drafter that computes its cache itself drafts the same tokens
    computing = ModelDrafter(first_layers_draft(tiny, 2), config, 200, VOCAB)
    ((computed, _),) = computing.propose([seq], [3])
    assert computing.copied_tokens == 0 and computed == copied


def test_greedy_speculation_scores_its_tokens_as_plain_decoding_does(tiny):
    """A round's tokens carry the log-probs a lone decode gives them, bit for bit (each row's
    argmax and log-sum-exp the one way plain greedy decoding computes them)."""

    def logprobs(spec):
        _, events, _ = generate(tiny, spec)
        return [
            (e.request_id, e.index, e.token_id, e.logprob) for e in events if isinstance(e, TokenGenerated)
        ]

    plain = logprobs(None)
    spec = logprobs(SpeculativeConfig("ngram", num_draft=3, adaptive=False))
    assert sorted(spec) == sorted(plain)
