"""The sampler's stages against transformers' processors and hand formulas, its statistics, and
the consistency of its snapshots (the what-if: tests/engine/test_what_if.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.config import SamplingParams
from engine.sampling.sampler import Sampler, SamplingError

PROMPT = [3, 5, 5, 8, 13, 21]
OUTPUT = [5, 34, 34, 34, 55, 89, 3]


def random_logits(vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


def full_probs(snapshot, stage_index: int, vocab: int) -> torch.Tensor:
    """A stage's probabilities over the whole vocabulary (the snapshot must cover all of it)."""
    out = torch.full((vocab,), float("nan"))
    out[list(snapshot.candidate_ids)] = torch.tensor(snapshot.stages[stage_index].probs)
    assert not out.isnan().any(), "snapshot_top_n must cover the vocabulary for this check"
    return out


def openai_penalties(logits: torch.Tensor, output_ids, presence: float, frequency: float) -> torch.Tensor:
    """The OpenAI formula written out token by token."""
    out = logits.clone()
    for token in set(output_ids):
        count = output_ids.count(token)
        out[token] -= frequency * count + presence * (1 if count > 0 else 0)
    return out


def transformers_chain(logits: torch.Tensor, params: SamplingParams) -> list[tuple[str, torch.Tensor]]:
    """Each stage's output computed independently, stage by stage, with transformers' classes."""
    ids = torch.tensor([PROMPT + OUTPUT])
    scores = logits.reshape(1, -1).clone()
    chain = [("raw", scores)]
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
        chain.append(("repetition_penalty", scores))
    if params.presence_penalty:
        scores = openai_penalties(scores[0], OUTPUT, params.presence_penalty, 0.0).reshape(1, -1)
        chain.append(("presence_penalty", scores))
    if params.frequency_penalty:
        scores = openai_penalties(scores[0], OUTPUT, 0.0, params.frequency_penalty).reshape(1, -1)
        chain.append(("frequency_penalty", scores))
    warpers = [
        ("temperature", params.temperature != 1.0, lambda: TemperatureLogitsWarper(params.temperature)),
        ("top_k", params.top_k > 0, lambda: TopKLogitsWarper(params.top_k)),
        ("top_p", params.top_p < 1.0, lambda: TopPLogitsWarper(params.top_p)),
        ("min_p", params.min_p > 0.0, lambda: MinPLogitsWarper(params.min_p)),
    ]
    for name, on, make in warpers:
        if on:
            scores = make()(ids, scores)
            chain.append((name, scores))
    return chain


STAGE_SETTINGS = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.8),
    dict(frequency_penalty=-0.6),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(top_k=17),
    dict(top_p=0.7),
    dict(min_p=0.05),
    dict(
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
    ),
    dict(temperature=1.3, top_k=60, top_p=0.95, min_p=0.02),
]


@pytest.mark.parametrize("settings", STAGE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_stage_equals_transformers_processors(settings, seed):
    vocab = 300
    params = SamplingParams(snapshot_top_n=vocab, seed=seed, **settings)
    logits = random_logits(vocab, seed)
    result = Sampler(params).sample(logits, PROMPT, OUTPUT)
    chain = transformers_chain(logits, params)

    assert [s.name for s in result.snapshot.stages] == [name for name, _ in chain]
    for i, (name, scores) in enumerate(chain):
        expected = torch.softmax(scores[0], 0)
        torch.testing.assert_close(
            full_probs(result.snapshot, i, vocab), expected, atol=1e-6, rtol=1e-5, msg=name
        )
        assert result.snapshot.stages[i].kept_count == int(torch.isfinite(scores).sum()), name
    # The drawn token is one the final distribution allows, and its logprob is that distribution's.
    final = torch.log_softmax(chain[-1][1][0], 0)
    assert math.isfinite(final[result.token_id])
    assert result.logprob == pytest.approx(float(final[result.token_id]), abs=1e-5)


def test_openai_penalties_count_generated_tokens_only():
    vocab = 120
    logits = random_logits(vocab, 7)
    params = SamplingParams(
        temperature=0.0, presence_penalty=0.4, frequency_penalty=0.25, snapshot_top_n=vocab
    )
    snapshot = Sampler(params).sample(logits, PROMPT, OUTPUT).snapshot
    expected = torch.softmax(openai_penalties(logits, OUTPUT, 0.4, 0.25), 0)
    torch.testing.assert_close(full_probs(snapshot, 2, vocab), expected, atol=1e-6, rtol=1e-5)
    # Token 8 appears only in the prompt: untouched relative to token 0 (seen nowhere).
    ratio = lambda probs: float(probs[8] / probs[0])  # noqa: E731
    assert ratio(expected) == pytest.approx(ratio(torch.softmax(logits, 0)), rel=1e-5)


def test_repetition_penalty_covers_prompt_once_per_token():
    logits = torch.tensor([2.0, -1.0, 1.0, 0.5, 3.0])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, snapshot_top_n=5)
    snapshot = Sampler(params).sample(logits, prompt_ids=[0, 0, 0], output_ids=[1]).snapshot
    # CTRL: positive logits divided, negative multiplied, each seen token once however often.
    expected = torch.softmax(torch.tensor([1.0, -2.0, 1.0, 0.5, 3.0]), 0)
    torch.testing.assert_close(full_probs(snapshot, 1, 5), expected)


@pytest.mark.parametrize("shift", [0.0, 3.7, -12.5, 40.0])
def test_top_p_keeps_smallest_set_reaching_the_mass(shift):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log() + shift

    def kept(top_p):
        params = SamplingParams(top_p=top_p, snapshot_top_n=4, seed=0)
        return Sampler(params).sample(logits, [], []).snapshot.stages[-1].kept_count

    assert kept(0.5) == 1
    assert kept(0.8) == 2
    assert kept(0.81) == 3
    assert kept(0.96) == 4


def test_top_p_is_mass_not_a_share_of_the_vocabulary():
    # One token holds 90% of the mass among 10,000: top_p=0.85 keeps that one token only, and
    # top_p=0.95 keeps it plus just enough of the flat rest to reach 95%.
    vocab = 10_000
    rest = 0.1 / (vocab - 1)
    probs = torch.full((vocab,), rest)
    probs[42] = 0.9
    logits = probs.log()

    def kept(top_p):
        return Sampler(SamplingParams(top_p=top_p, snapshot_top_n=1, seed=0)).sample(logits, [], []).snapshot

    assert kept(0.85).stages[-1].kept_count == 1
    assert kept(0.85).drawn_id == 42
    # float32 cumsums over thousands of tokens of 1e-5 each are off by a few tokens' worth.
    wide = kept(0.95).stages[-1]
    assert wide.kept_count == pytest.approx(1 + (0.95 - 0.9) / rest, rel=0.002)
    assert wide.kept_mass == pytest.approx(0.95, abs=1e-4)


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = [random_logits(1000, s, scale=1.0) for s in range(30)]

    def run(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(lg, [], []).token_id for lg in logits]

    assert run(123) == run(123)
    assert run(123) != run(124)
    # No seed: still draws valid tokens.
    assert all(0 <= t < 1000 for t in run(None))


def test_greedy_picks_argmax_of_penalized_logits():
    logits = random_logits(500, 3)
    best = int(logits.argmax())
    plain = Sampler(SamplingParams(temperature=0.0)).sample(logits, [], [])
    assert plain.token_id == best
    assert plain.snapshot is None
    assert plain.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[best]), abs=1e-6)

    # A huge presence penalty on the argmax moves greedy to the runner-up.
    runner_up = int(torch.topk(logits, 2).indices[1])
    penalized = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0)).sample(
        logits * 0.01, [], [best]
    )
    assert penalized.token_id == int(torch.topk(logits * 0.01, 2).indices[1]) == runner_up


def test_sampling_at_temperature_matches_softmax_within_statistical_bound():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, 1.4])
    temperature, draws = 0.7, 20_000
    sampler = Sampler(SamplingParams(temperature=temperature, seed=2024))
    counts = torch.zeros(8)
    for _ in range(draws):
        counts[sampler.sample(logits, [], []).token_id] += 1
    freq = counts / draws

    def within_bound(p):  # every token within 5 standard errors of its expected frequency
        return bool(((freq - p).abs() <= 5 * (p * (1 - p) / draws).sqrt()).all())

    assert within_bound(torch.softmax(logits / temperature, 0))
    # Control: the untempered distribution must fail the same bound, or the test has no power.
    assert not within_bound(torch.softmax(logits, 0))


def test_snapshot_fields_are_consistent():
    vocab = 2000
    logits = random_logits(vocab, 11)
    params = SamplingParams(
        repetition_penalty=1.1, temperature=0.9, top_k=50, top_p=0.8, min_p=0.05, snapshot_top_n=20, seed=5
    )
    result = Sampler(params, decode_token=lambda i: f"tok{i}").sample(logits, PROMPT, OUTPUT)
    snap = result.snapshot
    n = len(snap.candidate_ids)
    assert snap.candidate_ids[:20] == tuple(torch.topk(logits, 20).indices.tolist())
    assert snap.candidate_texts == tuple(f"tok{i}" for i in snap.candidate_ids)
    assert [s.name for s in snap.stages] == [
        "raw",
        "repetition_penalty",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
    ]

    removed_by = [None] * n
    for stage in snap.stages:
        assert len(stage.probs) == len(stage.removed) == n
        assert sum(stage.probs) <= 1.0 + 1e-6
        assert 0.0 < stage.kept_mass <= 1.0 + 1e-6
        for i, was_removed in enumerate(stage.removed):
            if was_removed:
                assert removed_by[i] is None, "a candidate is removed by one stage only"
                removed_by[i] = stage.name
            if removed_by[i] is not None:
                assert stage.probs[i] == 0.0
            else:
                assert stage.probs[i] > 0.0
    assert [s.kept_count for s in snap.stages] == sorted((s.kept_count for s in snap.stages), reverse=True)
    assert snap.stages[0].kept_count == vocab and snap.stages[0].kept_mass == 1.0
    assert snap.stages[3].kept_count == 50

    drawn = snap.candidate_ids.index(snap.drawn_id)
    assert snap.drawn_id == result.token_id
    assert snap.drawn_prob == pytest.approx(snap.stages[-1].probs[drawn], rel=1e-6)
    assert result.logprob == pytest.approx(math.log(snap.drawn_prob), abs=1e-5)
    assert removed_by[drawn] is None
    raw = torch.softmax(logits, 0)
    assert snap.raw_entropy == pytest.approx(float(-(raw * raw.log()).sum()), rel=1e-5)
    assert 0.0 < snap.entropy < snap.raw_entropy
    assert len(snap.raw_top_ids) == 256
    assert snap.raw_logsumexp == pytest.approx(float(logits.logsumexp(0)), rel=1e-6)


def test_snapshot_adds_a_drawn_token_outside_the_top_n():
    logits = torch.tensor([5.0, 4.9, 1.0, 0.0])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, snapshot_top_n=1)
    result = Sampler(params).sample(logits, [], [0])
    assert result.token_id == 1
    assert result.snapshot.candidate_ids == (0, 1)
    assert result.snapshot.drawn_prob == pytest.approx(
        float(torch.softmax(logits - torch.tensor([2.0, 0, 0, 0]), 0)[1])
    )
    assert result.snapshot.stages[-1].kept_mass == 1.0  # penalties remove nothing


def test_nan_logits_give_a_clear_error():
    logits = torch.tensor([0.0, float("nan"), 1.0])
    for params in (SamplingParams(temperature=0.0), SamplingParams(seed=0)):
        with pytest.raises(SamplingError, match="NaN"):
            Sampler(params).sample(logits, [], [])


def _top_p_by_full_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule ranked over the whole sorted vocabulary (what TopP computed before it ranked
    only the likeliest few)."""
    from engine.sampling.stages import TOP_P_TOLERANCE

    sorted_logits, order = torch.sort(scores, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p - TOP_P_TOLERANCE
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("spread", [0.5, 2.0, 6.0])  # flat (thousands kept) to peaked (a few)
def test_top_p_ranking_the_likeliest_few_keeps_what_a_full_sort_keeps(top_p, spread):
    from engine.sampling.stages import TopP

    gen = torch.Generator().manual_seed(int(spread * 10) + int(top_p * 1000))
    scores = torch.randn(3, 49_152, generator=gen) * spread
    scores[1, 1000:] = -math.inf  # a row after top-k or a ban: fewer alive than the others
    got, full = TopP(top_p)(None, scores), _top_p_by_full_sort(scores, top_p)
    if top_p < 0.99:
        assert torch.equal(got, full)
    else:  # thousands kept: float32 cumsums of tiny masses round the boundary a few tokens apart
        differ = (got > -math.inf) ^ (full > -math.inf)
        assert float((scores.softmax(-1) * differ).sum(-1).max()) < 1e-4
        assert torch.equal(got[~differ], full[~differ])


def test_top_p_ranks_only_as_many_tokens_as_the_mass_needs(monkeypatch):
    from engine.sampling import stages

    ranked = []
    topk = torch.topk
    monkeypatch.setattr(stages.torch, "topk", lambda x, k, dim: ranked.append(k) or topk(x, k, dim=dim))
    peaked = torch.randn(1, 49_152) * 6  # the top 64 hold 90% of its mass
    stages.TopP(0.9)(None, peaked)
    assert ranked == [stages.FIRST_RANKED]
    ranked.clear()
    flat = torch.zeros(1, 1000)  # every token as likely: 900 of them reach 90%
    kept = stages.TopP(0.9)(None, flat)
    assert ranked == [64, 256, 1000] and int((kept > -math.inf).sum()) == 900


def test_a_draw_follows_the_distribution_over_the_tokens_that_can_be_drawn():
    """The draw ranks only tokens with probability (the rest cannot be drawn): their shares
    match, and a token without probability never comes."""
    probs = torch.zeros(49_152)
    probs[[3, 7, 40_000]] = torch.tensor([0.2, 0.5, 0.3])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    counts = torch.zeros(49_152)
    for _ in range(20_000):
        counts[sampler.draw(probs)] += 1
    assert float(counts.sum() - counts[[3, 7, 40_000]].sum()) == 0
    torch.testing.assert_close(counts[[3, 7, 40_000]] / 20_000, probs[[3, 7, 40_000]], atol=0.015, rtol=0)
