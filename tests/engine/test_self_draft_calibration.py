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
from engine.speculative.self_draft import Calibration, calibrate, candidate_vocabs, net_saving

VOCAB = 9000  # above MIN_VOCAB: two vocabulary cuts to choose between


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=4, num_hidden_layers=5, tie_word_embeddings=False)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


def test_the_plan_is_the_measured_candidate_with_the_best_net_saving(tiny):
    rng = random.Random(0)
    sequences = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(8)]
    plan, head = calibrate(tiny, Calibration(sequences, [20] * 8))
    assert candidate_vocabs(VOCAB) == [4096, 8192, VOCAB]
    assert {m[1] for m in plan.measured} == {4096, 8192, VOCAB}
    assert {m[0] for m in plan.measured} == set(self_draft.candidate_layers(5))
    best = max(plan.measured, key=lambda m: net_saving(m[3], m[4], m[5]))
    assert net_saving(plan.acceptance, plan.coverage, plan.cost) == net_saving(best[3], best[4], best[5])
    assert plan.positions == 2 * 20  # the replies of the two judged sequences (every fourth)
    # a draft reads its layers' weights and its own head's int8 rows, over a step's weights
    model = tiny.model
    layers = sum(model_weight_bytes(layer) for layer in model.model.layers[: plan.layers])
    step = sum(model_weight_bytes(layer) for layer in model.model.layers)
    step += model_weight_bytes(model.get_output_embeddings())
    hidden = model.config.hidden_size
    assert plan.cost == pytest.approx((layers + plan.vocab * (hidden + 4)) / step)
    assert head.out_features == plan.vocab
    assert head(torch.zeros(1, hidden)).shape == (1, plan.vocab)


def test_a_draft_that_costs_more_than_it_saves_has_a_negative_net():
    assert net_saving(acceptance=0.5, coverage=0.4, cost=0.3) < 0 < net_saving(0.9, 0.9, 0.2)
    assert self_draft.calibration_replies(576, 80) == 58
    assert self_draft.calibration_replies(4096, 80) == 80 and self_draft.calibration_replies(64, 80) == 8
