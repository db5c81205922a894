"""The self-draft's calibration: the plan it keeps is the measured candidate that saves the most
target steps per draft forward, with its cost from the weights a draft reads."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import IdTokenizer, make_tiny_llama

from engine.model.loaded import LoadedModel
from engine.quant.base import model_weight_bytes
from engine.speculative import self_draft
from engine.speculative.self_draft import (
    HIDDEN,
    Calibration,
    _Normal,
    calibrate,
    candidate_vocabs,
    net_saving,
)

VOCAB = 9000  # above MIN_VOCAB: two vocabulary cuts to choose between


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=4, num_hidden_layers=5, tie_word_embeddings=False)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


def test_the_plan_is_the_measured_candidate_with_the_best_net_saving(tiny):
    rng = random.Random(0)
    sequences = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(8)]
    fitted = calibrate(tiny, Calibration(sequences, [20] * 8))
    plan, head = fitted.plan, fitted.head
    assert candidate_vocabs(VOCAB) == [4096, 8192, VOCAB]
    assert {m[1] for m in plan.measured} == {4096, 8192, VOCAB}
    assert {m[0] for m in plan.measured} == {HIDDEN, *self_draft.candidate_layers(5)}
    best = max(plan.measured, key=lambda m: net_saving(m[3], m[4], m[5]))
    assert net_saving(plan.acceptance, plan.coverage, plan.cost) == net_saving(best[3], best[4], best[5])
    # the replies of the two judged sequences (every fourth): a layer draft is judged on each
    # reply token, the hidden draft on each but the first (the target's own, from the prompt)
    assert plan.positions == 2 * (20 - (plan.layers == HIDDEN))
    # a draft reads its layers' weights (the hidden draft its map) and its own head's rows, over
    # a step's weights
    model = tiny.model
    step = sum(model_weight_bytes(layer) for layer in model.model.layers)
    step += model_weight_bytes(model.get_output_embeddings())
    hidden = model.config.hidden_size
    head_row = sum(t.numel() * t.element_size() for t in head.storage.tensors()) / head.out_features
    for n, vocab, _, _, _, cost in plan.measured:
        own = (
            self_draft.draft_bytes(hidden, 3 * hidden)
            if n == HIDDEN
            else sum(model_weight_bytes(layer) for layer in model.model.layers[:n])
        )
        assert cost == pytest.approx((own + vocab * head_row) / step)
    assert head.out_features == plan.vocab
    assert head(torch.zeros(1, hidden)).shape == (1, plan.vocab)
    assert (fitted.map is None) == (plan.layers != HIDDEN)


def test_a_fitted_map_recovers_an_exact_linear_relation():
    """The normal equations, added row block by row block, solve what one least-squares fit
    over all the rows solves (up to the small ridge)."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 10), torch.randn(6)
    normal = _Normal()
    for _ in range(5):
        x = torch.randn(400, 10)
        normal.add(x, x @ a.T + b)
    fitted_a, fitted_b = normal.solve()
    assert torch.allclose(fitted_a, a, atol=1e-2) and torch.allclose(fitted_b, b, atol=1e-2)


def test_a_draft_that_costs_more_than_it_saves_has_a_negative_net():
    assert net_saving(acceptance=0.5, coverage=0.4, cost=0.3) < 0 < net_saving(0.9, 0.9, 0.2)
    assert self_draft.calibration_replies(576, 300) == 231 and self_draft.calibration_replies(576, 80) == 80
    assert self_draft.calibration_replies(32, 80) == 13 and self_draft.calibration_replies(8, 80) == 8
    assert self_draft.calibration_replies(4096, 80) == 80
    assert self_draft.calibration_replies(2048, 300) == self_draft.MAX_REPLIES
    # a layer draft alone fits maps a third as wide: a third of the replies
    assert self_draft.calibration_replies(576, 300, layers=8) == 77
    assert self_draft.calibration_replies(576, 300, layers=HIDDEN) == 231
