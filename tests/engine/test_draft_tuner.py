"""The draft tuner's acceptance: a new sequence starts from what the engine measured on the
sequences before it, not from a fixed guess."""

from __future__ import annotations

import pytest

from engine.speculative.adaptive import DraftTuner


def tuner_with_costs() -> DraftTuner:
    tuner = DraftTuner(most=4, adaptive=True, free_proposer=False)
    tuner.costs.observe_step(1, 0.010)  # a plain step: 10 ms
    tuner.costs.observe_step(5, 0.016)  # a round of 4 drafts: 16 ms
    tuner.costs.observe_drafting(1, 0.001)  # a draft forward: 1 ms
    return tuner


def test_with_nothing_measured_a_sequence_drafts_on_the_prior():
    tuner = tuner_with_costs()
    assert tuner.choose(1, decoding=1, cap=100) > 0


def test_a_new_sequence_starts_from_the_acceptance_the_engine_measured():
    tuner = tuner_with_costs()
    for seq in range(3):  # earlier sequences: every draft rejected
        for _ in range(6):
            tuner.round_done(
                seq, drafted=4, accepted=0, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.004
            )
    assert tuner.acceptance(0) == 0.0
    assert tuner.choose(99, decoding=1, cap=100) == 0  # a new one does not spend rounds to learn it
    for seq in range(10, 13):  # later sequences: every draft kept
        for _ in range(20):
            tuner.round_done(
                seq, drafted=4, accepted=4, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.004
            )
    assert tuner.choose(100, decoding=1, cap=100) == 4


def test_a_proposer_that_stops_short_of_the_drafts_asked_counts_the_gap_as_rejected():
    tuner = tuner_with_costs()
    for _ in range(10):  # asked for 4; the proposer was confident of 1, which was kept
        tuner.round_done(
            1, drafted=1, accepted=1, step_rows=2, step_s=0.012, decoding=1, draft_share_s=0.004, asked=4
        )
    # each round examined 2 positions and saved a step at one: half, not every draft made
    assert 0.4 < tuner.acceptance(1) < 0.6


def test_a_probe_that_drafts_nothing_spaces_the_next_probe_out():
    tuner = tuner_with_costs()
    for seq in range(3):  # the engine learned drafts do not pay
        for _ in range(6):
            tuner.round_done(
                seq, drafted=4, accepted=0, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.004
            )

    def plain_steps_to_probe() -> int:
        steps = 0
        while tuner.choose(7, decoding=1, cap=100) == 0:
            steps += 1
        return steps

    first = plain_steps_to_probe()
    tuner.nothing_drafted(7)  # the probe's draft was below the proposer's confidence
    assert plain_steps_to_probe() == 2 * (first + 1) - 1


def test_a_new_sequence_starts_at_the_probe_spacing_the_engine_reached():
    """Probes that keep failing in one reply are spaced out; the next reply (a new sequence) does
    not start again at the first spacing, and a kept probe draft brings the spacing back."""
    tuner = tuner_with_costs()
    for seq in range(3):  # the engine learned drafts do not pay
        for _ in range(6):
            tuner.round_done(
                seq, drafted=4, accepted=0, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.004
            )

    def plain_steps_to_probe(seq: int) -> int:
        steps = 0
        while tuner.choose(seq, decoding=1, cap=100) == 0:
            steps += 1
        return steps

    first = plain_steps_to_probe(7)
    for _ in range(2):  # two failed probes: the spacing doubles twice
        tuner.nothing_drafted(7)
        plain_steps_to_probe(7)
    tuner.nothing_drafted(7)
    tuner.release(7)
    later = plain_steps_to_probe(8)  # the next reply's first probe
    assert later == 8 * (first + 1) - 1
    tuner.round_done(8, drafted=1, accepted=1, step_rows=2, step_s=0.012, decoding=1, draft_share_s=0.001)
    assert plain_steps_to_probe(9) == first  # a kept probe draft: the first spacing again


def test_acceptance_is_kept_per_class_of_evidence():
    """An n-gram proposal that follows a 3-token match is kept far more often than one that
    follows a 1-token match (83% against 15% of first drafts on the packaged model's chat): the
    tuner drafts after the one and not after the other, in the same sequence."""
    tuner = DraftTuner(most=4, adaptive=True, free_proposer=True)
    tuner.costs.observe_step(1, 0.010)
    tuner.costs.observe_step(5, 0.016)
    for _ in range(8):
        tuner.choose(1, decoding=1, cap=100, evidence=1)
        tuner.round_done(1, drafted=4, accepted=0, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.0)
        tuner.choose(1, decoding=1, cap=100, evidence=3)
        tuner.round_done(1, drafted=4, accepted=4, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.0)
    assert tuner.choose(1, decoding=1, cap=100, evidence=3) == 4
    assert tuner.choose(1, decoding=1, cap=100, evidence=1) == 0
    assert 0.7 < tuner.acceptance(1) < 0.9  # the panel's figure, every class: 4 of 5 examined kept
    # a new sequence starts each class from what the engine measured in it
    assert tuner.choose(2, decoding=1, cap=100, evidence=1) == 0
    assert tuner.choose(2, decoding=1, cap=100, evidence=3) == 4
    # a shadow round is scored in the class it was proposed in
    tuner.start_shadow(2, at=10, drafts=[7, 8, 9, 10], evidence=1)
    tuner.score_shadow(2, [0] * 10 + [7, 8, 9, 10])
    assert tuner.tuning(2).by_evidence[1].overall() > 0


def test_the_ngram_evidence_is_the_length_of_its_match():
    from types import SimpleNamespace

    from engine.speculative.proposers import NgramProposer

    ngram = NgramProposer()

    def evidence(tokens: list[int], seq_id: int) -> int:
        return ngram.evidence(SimpleNamespace(seq_id=seq_id, token_ids=tokens))  # type: ignore[arg-type]

    assert evidence([1, 2, 3, 9, 1, 2, 3], 1) == 3
    assert evidence([4, 2, 9, 5, 2], 2) == 1
    assert evidence([4, 2, 9, 5, 6], 3) == 0
    seq = SimpleNamespace(seq_id=1, token_ids=[1, 2, 3, 9, 1, 2, 3])
    assert ngram.lookup(seq, 2) == ([9, 1], [None, None])  # type: ignore[arg-type]


def test_the_length_chosen_makes_the_most_tokens_a_second_not_the_most_saved_a_round():
    """Measured on the packaged model's repeat task (all but 2% of drafts kept): a plain step
    2.85 ms, 5 rows 5.3 ms, 9 rows 10.3 ms (a second pass of the panels' 8-row tiles). A round
    of 8 drafts saves more a round (7.5 tokens' worth against 3.9, for 7.45 ms more against
    2.45) but makes fewer tokens a millisecond (8.5 / 10.3 against 4.9 / 5.3)."""

    def length_after_full_acceptance(step_ms: tuple[float, float, float]) -> int:
        tuner = DraftTuner(most=8, adaptive=True, free_proposer=True)
        for rows, ms in zip((1, 5, 9), step_ms):
            tuner.costs.observe_step(rows, ms / 1000)
        for _ in range(30):
            tuner.choose(1, decoding=1, cap=100)
            tuner.round_done(
                1, drafted=8, accepted=8, step_rows=9, step_s=step_ms[2] / 1000, decoding=1, draft_share_s=0.0
            )
        return tuner.choose(1, decoding=1, cap=100)

    assert length_after_full_acceptance((2.85, 5.3, 10.3)) == 4
    # the same acceptance with rows that cost little more than their activations: the longest
    assert length_after_full_acceptance((2.85, 3.0, 3.2)) == 8


def test_a_rounds_rows_cost_their_postprocessing_too():
    """Forward and scheduling alone, a draft kept 40% of the time adds less than it gives; its
    postprocessing (timed apart, as the engine times it) tips the round into a loss, and a
    round's measured saving counts the postprocessing of steps of its rows."""

    def tuned(post_ms: tuple[float, float]) -> DraftTuner:
        tuner = DraftTuner(most=1, adaptive=True, free_proposer=True)
        for rows, ms, post in ((1, 10.0, post_ms[0]), (2, 12.0, post_ms[1])):
            tuner.costs.observe_step(rows, (ms + post) / 1000, post / 1000)
        for i in range(40):
            tuner.choose(1, decoding=1, cap=100)
            tuner.round_done(
                1,
                drafted=1,
                accepted=1 if i % 5 < 2 else 0,
                step_rows=2,
                step_s=0.012,
                decoding=1,
                draft_share_s=0.0,
            )
        return tuner

    assert tuned((0.0, 0.0)).choose(1, decoding=1, cap=100) == 1  # 0.4 x 10 ms > 2 ms
    costly = tuned((0.5, 3.0))  # the second row's postprocessing: 2.5 ms more
    assert costly.choose(1, decoding=1, cap=100) == 0  # 0.4 x 10.5 ms < 4.5 ms
    outcome = costly.round_done(
        1, drafted=1, accepted=1, step_rows=2, step_s=0.012, decoding=1, draft_share_s=0.0
    )
    assert abs(outcome.saved_s - (0.0105 - (0.015 - 0.0105))) < 1e-9


def test_a_costly_proposer_at_no_drafts_chooses_its_length_again_only_after_a_probe(monkeypatch):
    """At length 0 a costly proposer learns only from its probe rounds: between them its plain
    steps do not weigh every length again (that choice at every step cost ~1% of a step), and
    after a kept probe the length is chosen again from what it measured."""
    tuner = tuner_with_costs()
    for _ in range(6):  # drafts do not pay
        tuner.round_done(7, drafted=4, accepted=0, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.004)
    weighed = []
    best = DraftTuner._best
    monkeypatch.setattr(DraftTuner, "_best", lambda self, *a: weighed.append(1) or best(self, *a))
    steps = 0
    while tuner.choose(7, decoding=1, cap=100) == 0:
        steps += 1
    assert steps > 1 and len(weighed) == 1, "weighed once, after the rounds; not at each plain step"
    for _ in range(8):  # the probe and the rounds after it: every draft kept
        tuner.round_done(7, drafted=1, accepted=1, step_rows=2, step_s=0.012, decoding=1, draft_share_s=0.001)
    assert tuner.choose(7, decoding=1, cap=100) > 0 and len(weighed) == 2


def test_a_costly_proposer_at_no_drafts_needs_its_state_only_before_a_probe():
    """may_draft_next is true exactly before the steps whose choice can draft: the engine keeps
    the hidden-state drafter's state only then."""
    tuner = tuner_with_costs()
    for seq in range(3):  # the engine learned drafts do not pay
        for _ in range(6):
            tuner.round_done(
                seq, drafted=4, accepted=0, step_rows=5, step_s=0.016, decoding=1, draft_share_s=0.004
            )
    assert tuner.may_draft_next(7), "a sequence the tuner has not seen may draft"
    predicted, chosen = [], []
    for _ in range(200):
        predicted.append(tuner.may_draft_next(7))
        k = tuner.choose(7, decoding=1, cap=100)
        chosen.append(k)
        if k:  # the probe: rejected
            tuner.round_done(
                7, drafted=1, accepted=0, step_rows=2, step_s=0.012, decoding=1, draft_share_s=0.001
            )
    assert sum(chosen) >= 3, "it probed"
    assert all(p for p, k in zip(predicted, chosen) if k), "every step that drafted was foreseen"
    probes = sum(1 for k in chosen if k)
    # the others: the first step, and each one after a probe (its length is chosen again then)
    assert sum(predicted) == 2 * probes + 1
    free = DraftTuner(most=4, adaptive=True, free_proposer=True)
    fixed = DraftTuner(most=4, adaptive=False, free_proposer=False)
    assert free.may_draft_next(1) and fixed.may_draft_next(1)


def test_drafts_the_proposer_does_not_make_add_no_row_to_the_cost():
    """A confidence-gated proposer makes a draft at half the asks, and half of those are kept:
    a quarter of the asked positions save a step. Drafting then pays (a made draft's row costs
    3 ms of a 10 ms step, but only half the asks pay it), where a proposer making every draft
    at the same quarter kept does not."""

    def tuner_after(rounds) -> DraftTuner:
        tuner = DraftTuner(most=1, adaptive=True, free_proposer=False)
        tuner.costs.observe_step(1, 0.010)
        tuner.costs.observe_step(2, 0.013)
        tuner.costs.observe_drafting(1, 0.0002)
        for i in range(40):
            drafted, accepted = rounds[i % len(rounds)]
            if drafted:
                tuner.round_done(1, drafted, accepted, 2, 0.013, 1, 0.0002, asked=1)
            else:
                tuner.nothing_drafted(1, asked=1)
        return tuner

    gated = tuner_after([(1, 1), (0, 0), (1, 0), (0, 0)])
    eager = tuner_after([(1, 1), (1, 0), (1, 0), (1, 0)])
    assert gated.acceptance(1) == eager.acceptance(1) == pytest.approx(0.25, abs=0.07)
    assert gated.choose(2, decoding=1, cap=100) == 1, "a new sequence drafts from the engine's share"
    assert eager.choose(2, decoding=1, cap=100) == 0
