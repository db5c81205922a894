"""typical-p, DRY, XTC, logit bias and banned tokens: each against its published algorithm on
hand-built logits (written out here from the source it comes from), against transformers where
transformers has it, and as stages of the pipeline with their snapshots and what-if."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import TypicalLogitsWarper

from engine.config import ConfigError, SamplingParams
from engine.sampling.dry import DryPenalty
from engine.sampling.sampler import Sampler
from engine.sampling.stages import PENALTY_STAGES, exclude_top_choices


def probs_of(snapshot, stage_name: str, vocab: int) -> torch.Tensor:
    stage = next(s for s in snapshot.stages if s.name == stage_name)
    out = torch.zeros(vocab)
    out[list(snapshot.candidate_ids)] = torch.tensor(stage.probs)
    return out


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


# ---- typical-p -------------------------------------------------------------------------------
def test_typical_p_keeps_the_tokens_nearest_the_entropy_even_without_the_likeliest():
    # p = 1/2, 1/4, 1/8, 1/8: entropy 1.75 ln 2. Surprise minus entropy: 0.52, 0.17, 0.87, 0.87.
    # Ranked by that, the mass reaches 0.2 with the 1/4 token alone: the likeliest is cut.
    logits = logits_of([0.5, 0.25, 0.125, 0.125])

    def kept(mass):
        snap = (
            Sampler(SamplingParams(typical_p=mass, snapshot_top_n=4, seed=0)).sample(logits, [], []).snapshot
        )
        final = snap.stages[-1]
        return {t for t, p in zip(snap.candidate_ids, final.probs) if p > 0}

    assert kept(0.2) == {1}
    assert kept(0.5) == {0, 1}
    assert kept(0.8) == {0, 1, 2, 3}  # the 1/8 pair is tied: both stay


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_typical_p_stage_equals_transformers(mass, seed):
    vocab = 400
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2.5
    params = SamplingParams(typical_p=mass, temperature=0.8, snapshot_top_n=vocab, seed=seed)
    snapshot = Sampler(params).sample(logits, [], []).snapshot
    assert [s.name for s in snapshot.stages] == ["raw", "temperature", "typical_p"]
    expected = TypicalLogitsWarper(mass)(None, (logits / 0.8).reshape(1, -1))
    torch.testing.assert_close(probs_of(snapshot, "typical_p", vocab), torch.softmax(expected[0], 0))
    assert snapshot.stages[-1].kept_count == int(torch.isfinite(expected).sum())


# ---- DRY ---------------------------------------------------------------------------------------
def dry_reference(ids, multiplier, base, allowed_length, breakers, last_n=0):
    """text-generation-webui's DRYLogitsProcessor.__call__ for one row, as published (PR #5677):
    returns token -> penalty subtracted."""
    if last_n > 0:
        ids = ids[-last_n:]
    last_token = ids[-1]
    if last_token in breakers:
        return {}
    match_indices = [idx for idx, val in enumerate(ids[:-1]) if val == last_token]
    match_lengths = {}
    for i in match_indices:
        next_token = ids[i + 1]
        if next_token in breakers:
            continue
        match_length = 1
        while match_length < 50:
            j = i - match_length
            if j < 0:
                break
            previous_token = ids[-(match_length + 1)]
            if ids[j] != previous_token:
                break
            if previous_token in breakers:
                break
            match_length += 1
        match_lengths[next_token] = max(match_length, match_lengths.get(next_token, 0))
    return {
        token: multiplier * base ** (length - allowed_length)
        for token, length in match_lengths.items()
        if length >= allowed_length
    }


BREAK = 9  # the token whose text holds a newline in these tests


def decode(token_id: int) -> str:
    return "\n" if token_id == BREAK else f"t{token_id}"


def dry(multiplier=1.0, base=2.0, allowed=2, last_n=0) -> DryPenalty:
    return DryPenalty(multiplier, base, allowed, ("\n",), last_n, decode)


def test_dry_penalises_the_token_that_would_repeat_a_sequence():
    # "1 2 3 4 ... 1 2 3": a 3-token match; the 4 that followed it would make it 4 long.
    assert dry().penalties([1, 2, 3, 4, 7, 1, 2, 3]) == {4: 1.0 * 2.0 ** (3 - 2)}
    # A breaker inside the match stops it at the breaker: only "2 3" matches.
    assert dry().penalties([1, BREAK, 2, 3, 4, 1, BREAK, 2, 3]) == {4: 1.0}
    # The longest match wins when one token follows several occurrences.
    assert dry().penalties([5, 2, 3, 4, 1, 2, 3, 4, 8, 1, 2, 3]) == {4: 2.0**1}
    assert dry().penalties([1, 2, 3, 4, 1, 2, BREAK]) == {}  # the text ends in a breaker
    assert dry().penalties([1, 2, BREAK, 1, 2]) == {}  # what followed was a breaker
    assert dry(allowed=4).penalties([1, 2, 3, 4, 7, 1, 2, 3]) == {}  # too short to count
    assert dry(last_n=4).penalties([1, 2, 3, 4, 7, 1, 2, 3]) == {}  # the first run is out of range


@pytest.mark.parametrize("seed", range(8))
def test_dry_equals_the_published_algorithm_on_random_repetitive_text(seed):
    rng = random.Random(seed)
    phrase = [rng.randrange(12) for _ in range(6)]
    ids = []
    while len(ids) < 300:  # a repeated phrase, noise and breakers: matches of every length
        ids += phrase[: rng.randrange(1, 7)] if rng.random() < 0.6 else [rng.randrange(12)]
    for multiplier, base, allowed, last_n in [(0.8, 1.75, 2, 0), (1.5, 1.2, 3, 0), (0.5, 2.0, 1, 100)]:
        got = dry(multiplier, base, allowed, last_n).penalties(ids)
        want = dry_reference(ids, multiplier, base, allowed, {BREAK}, last_n)
        assert got.keys() == want.keys()
        for token in want:
            assert got[token] == pytest.approx(want[token])


def test_dry_is_a_stage_over_prompt_and_reply_with_its_snapshot():
    vocab = 20
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.0, dry_multiplier=0.8, dry_base=1.75, snapshot_top_n=vocab)
    prompt, output = [1, 2, 3, 4, 5], [1, 2, 3]  # the reply repeats the prompt's start
    snapshot = Sampler(params, decode_token=decode).sample(logits, prompt, output).snapshot
    assert [s.name for s in snapshot.stages] == ["raw", "dry"]
    expected = logits.clone()
    expected[4] -= 0.8 * 1.75 ** (3 - 2)
    torch.testing.assert_close(probs_of(snapshot, "dry", vocab), torch.softmax(expected, 0))
    assert snapshot.penalized_top_logits[snapshot.raw_top_ids.index(4)] == pytest.approx(float(expected[4]))


def test_dry_changes_the_greedy_choice_away_from_a_loop():
    logits = torch.zeros(10)
    logits[4] = 1.0  # the model wants to repeat "1 2 3 4"
    greedy = SamplingParams(temperature=0.0)
    assert Sampler(greedy).sample(logits, [1, 2, 3, 4], [1, 2, 3]).token_id == 4
    with_dry = SamplingParams(temperature=0.0, dry_multiplier=2.0)
    assert Sampler(with_dry).sample(logits, [1, 2, 3, 4], [1, 2, 3]).token_id != 4


# ---- XTC ---------------------------------------------------------------------------------------
def xtc_reference(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """text-generation-webui's XTCLogitsWarper once its coin has come up, as published (without
    its newline/EOS exception, like llama.cpp's)."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    sorted_indices_to_remove = torch.full_like(probs, False, dtype=torch.bool)
    sorted_indices_to_remove[..., :-1] = probs[..., 1:] >= threshold
    indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
    return scores.masked_fill(indices_to_remove, -math.inf)


def test_xtc_removes_the_top_choices_but_the_least_likely_of_them():
    logits = logits_of([0.4, 0.3, 0.2, 0.1]).reshape(1, -1)
    kept = torch.isfinite(exclude_top_choices(logits, 0.15))[0].tolist()
    assert kept == [False, False, True, True]  # 0.4 and 0.3 go; 0.2 is the last above 0.15
    assert torch.equal(exclude_top_choices(logits, 0.35), logits)  # one above the threshold: no-op


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0.02, 0.05, 0.1, 0.3])
def test_xtc_equals_the_published_algorithm(seed, threshold):
    scores = (torch.randn(300, generator=torch.Generator().manual_seed(seed)) * 3).reshape(1, -1)
    assert torch.equal(exclude_top_choices(scores, threshold), xtc_reference(scores, threshold))


def test_xtc_fires_with_its_probability_from_the_seeded_generator():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    params = SamplingParams(xtc_threshold=0.15, xtc_probability=0.3, snapshot_top_n=4, seed=11)
    draws = 4000
    sampler = Sampler(params)
    fired = 0
    for i in range(draws):
        snap = sampler.sample(logits, [], [0] * i).snapshot
        xtc = next(s for s in snap.stages if s.name == "xtc")
        fired += xtc.kept_count == 2
    sd = math.sqrt(0.3 * 0.7 / draws)
    assert abs(fired / draws - 0.3) < 5 * sd

    def run(seed):
        sampler = Sampler(SamplingParams(xtc_threshold=0.15, xtc_probability=0.3, seed=seed))
        return [sampler.sample(logits, [], [0] * i).token_id for i in range(60)]

    assert run(11) == run(11)  # the coins and draws come from the seeded generator
    assert run(11) != run(12)


def test_xtc_uses_one_coin_per_position_for_every_evaluation():
    # The speculative verifier asks for the distribution, then the logprob of the chosen token:
    # both must see the same coin, or a drawn token could look removed.
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    sampler = Sampler(SamplingParams(xtc_threshold=0.15, xtc_probability=0.5, seed=3, snapshot_top_n=4))
    for position in range(40):
        output = [0] * position
        dist = sampler.distribution(logits, [], output)
        result = sampler.result_for(logits, [], output, int(dist.argmax()))
        assert math.isfinite(result.logprob)
        assert result.snapshot.stages[-1].kept_count == int((dist > 0).sum())


def test_xtc_is_off_in_greedy_decoding():
    params = SamplingParams(temperature=0.0, xtc_probability=1.0, snapshot_top_n=4)
    result = Sampler(params).sample(logits_of([0.4, 0.3, 0.2, 0.1]), [], [])
    assert result.token_id == 0 and [s.name for s in result.snapshot.stages] == ["raw"]


# ---- logit bias and banned tokens ----------------------------------------------------------------
def test_logit_bias_adds_and_banned_tokens_are_never_drawn():
    vocab = 50
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    top = int(logits.argmax())
    params = SamplingParams(
        temperature=0.0,
        logit_bias=((3, 2.5), (7, -4.0), (999, 9.0)),
        banned_token_ids=(top,),
        snapshot_top_n=vocab,
    )
    result = Sampler(params).sample(logits, [], [])
    assert [s.name for s in result.snapshot.stages] == ["raw", "logit_bias", "banned_tokens"]
    biased = logits.clone()
    biased[3] += 2.5
    biased[7] -= 4.0  # id 999 is beyond the vocabulary: ignored
    torch.testing.assert_close(probs_of(result.snapshot, "logit_bias", vocab), torch.softmax(biased, 0))
    assert probs_of(result.snapshot, "banned_tokens", vocab)[top] == 0.0
    assert result.token_id != top
    sampled = Sampler(SamplingParams(banned_token_ids=(top,), seed=1, temperature=5.0))
    assert top not in {sampled.sample(logits, [], []).token_id for _ in range(300)}


def test_the_new_stages_order_and_penalty_classes():
    params = SamplingParams(
        repetition_penalty=1.1,
        dry_multiplier=0.5,
        logit_bias=((1, 1.0),),
        banned_token_ids=(2,),
        temperature=0.9,
        top_p=0.95,
        typical_p=0.9,
        xtc_probability=1.0,
        xtc_threshold=0.3,
        snapshot_top_n=10,
        seed=0,
    )
    names = [s.name for s in Sampler(params).stages]
    assert names == [
        "repetition_penalty", "dry", "logit_bias", "banned_tokens", "temperature", "top_p", "typical_p", "xtc",
    ]  # fmt: skip
    assert {"dry", "logit_bias", "banned_tokens"} <= set(PENALTY_STAGES)


# ---- params ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("typical_p", 0.0, "typical_p"),
        ("typical_p", 1.5, "typical_p"),
        ("dry_multiplier", -1.0, "dry_multiplier"),
        ("dry_base", 0.5, "dry_base"),
        ("dry_allowed_length", 0, "dry_allowed_length"),
        ("dry_penalty_last_n", -1, "dry_penalty_last_n"),
        ("dry_sequence_breakers", ("",), "breakers"),
        ("xtc_threshold", 0.7, "xtc_threshold"),
        ("xtc_probability", 1.2, "xtc_probability"),
        ("logit_bias", ((5, 300.0),), "logit bias"),
        ("logit_bias", ((-1, 1.0),), "token ids"),
        ("logit_bias", ("nonsense",), "pairs"),
        ("banned_token_ids", (-3,), "banned"),
    ],
)
def test_bad_values_are_refused_with_a_message(field, value, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**{field: value})


def test_params_from_json_lists_equal_params_from_tuples():
    import dataclasses
    import json

    params = SamplingParams(
        logit_bias=((3, 1.5),), banned_token_ids=(4, 5), dry_sequence_breakers=("\n", "##")
    )
    again = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(params))))
    assert again == params and hash(again) == hash(params)


# ---- the CLI -----------------------------------------------------------------------------------
def test_generate_flags_become_sampling_params():
    from engine.cli.args import sampling_from
    from engine.cli.main import build_parser

    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--typical-p", "0.9", "--dry-multiplier", "0.8", "--dry-base", "2",
         "--dry-allowed-length", "3", "--dry-penalty-last-n", "64", "--dry-sequence-breaker", "\n",
         "--dry-sequence-breaker", "###", "--xtc-threshold", "0.2", "--xtc-probability", "0.5",
         "--logit-bias", "42=5", "--logit-bias", "7=-100", "--ban-token", "13"]
    )  # fmt: skip
    params = sampling_from(args)
    assert (params.typical_p, params.dry_multiplier, params.dry_base) == (0.9, 0.8, 2.0)
    assert (params.dry_allowed_length, params.dry_penalty_last_n) == (3, 64)
    assert params.dry_sequence_breakers == ("\n", "###")
    assert (params.xtc_threshold, params.xtc_probability) == (0.2, 0.5)
    assert params.logit_bias == ((42, 5.0), (7, -100.0)) and params.banned_token_ids == (13,)
    defaults = sampling_from(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert defaults.dry_sequence_breakers == SamplingParams().dry_sequence_breakers


def test_generate_bans_a_token_and_refuses_bad_flags_in_one_line(tmp_path, default_tokenizer, capsys):
    import json

    from model_folders import save_tiny_model

    from engine.cli.main import main

    folder = save_tiny_model(tmp_path / "tiny", default_tokenizer)
    base = [
        "generate",
        "--model",
        str(folder),
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--json",
    ]
    assert main(base) == 0
    first = json.loads(capsys.readouterr().out)["token_ids"][0]
    assert main([*base, "--ban-token", str(first), "--dry-multiplier", "0.8", "--typical-p", "0.95"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"][0] != first

    assert main([*base, "--logit-bias", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert "ID=BIAS" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main([*base, "--xtc-threshold", "0.9"]) == 2
    assert "xtc_threshold" in capsys.readouterr().err
