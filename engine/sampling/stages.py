"""The sampling stages, in pipeline order: penalties (CTRL repetition, OpenAI presence and
frequency), temperature, top-k, top-p, min-p. transformers' own `LogitsProcessor` classes do the
work where they exist; the OpenAI penalties and an exact-mass top-p are written here. A stage the
params leave neutral is not in the pipeline at all."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from engine.config import SamplingParams

PENALTY_STAGES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
WARPER_STAGES = ("temperature", "top_k", "top_p", "min_p")
# Masses are float32 sums of softmax outputs whose inputs were themselves rounded: a set whose
# mass is within this of top_p counts as reaching it, so that e.g. p=0.8 over probabilities
# [0.5, 0.3, 0.15, 0.05] keeps two tokens whatever constant the logits are offset by.
TOP_P_TOLERANCE = 1e-5


class PresencePenalty:
    """OpenAI presence penalty: subtract `penalty` once from every token already generated."""

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, output_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, output_ids, True)
        return scores - self.penalty * seen


class FrequencyPenalty:
    """OpenAI frequency penalty: subtract `penalty` once per occurrence in the generated text."""

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, output_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(
            1, output_ids, torch.ones_like(output_ids, dtype=scores.dtype)
        )
        return scores - self.penalty * counts


class TopP:
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches `top_p`.

    Same rule as transformers' `TopPLogitsWarper` (which it equals away from exact boundaries),
    but a token's fate is decided by the mass strictly above it, with `TOP_P_TOLERANCE`, instead
    of by an ascending float32 cumsum compared exactly against 1 - top_p: there, whether
    probabilities [0.5, 0.3, ...] with p=0.8 keep 2 or 3 tokens depends on rounding.
    """

    def __init__(self, top_p: float):
        self.top_p = top_p

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        # After top-k only a few tokens are left: ranking just those is far cheaper than
        # sorting the whole vocabulary (removed tokens carry no mass and need no decision).
        alive = int((scores[0] > -math.inf).sum())
        if alive < scores.shape[-1] // 2:
            sorted_logits, order = torch.topk(scores, alive, dim=-1)
        else:
            sorted_logits, order = torch.sort(scores, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_above >= self.top_p - TOP_P_TOLERANCE
        drop_sorted[..., 0] = False  # the likeliest token always stays
        drop = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, drop_sorted)
        return scores.masked_fill(drop, -math.inf)


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [1, L], scores [1, V])
    # Which token history the stage reads: the CTRL repetition penalty counts the prompt too,
    # the OpenAI penalties only what the model generated; warpers read none.
    history: str  # "prompt+output" | "output" | "none"


def enabled_warpers(params: SamplingParams) -> list[tuple[str, float]]:
    """The temperature/truncation stages the params switch on, in pipeline order (none if greedy)."""
    if params.greedy:
        return []
    wanted = [
        ("temperature", float(params.temperature), params.temperature != 1.0),
        ("top_k", params.top_k, params.top_k > 0),
        ("top_p", float(params.top_p), params.top_p < 1.0),
        ("min_p", float(params.min_p), params.min_p > 0.0),
    ]
    return [(name, value) for name, value, on in wanted if on]


def build_stages(params: SamplingParams) -> list[Stage]:
    stages = []
    if params.repetition_penalty != 1.0:
        rep = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))
        stages.append(Stage("repetition_penalty", rep, "prompt+output"))
    if params.presence_penalty != 0.0:
        stages.append(Stage("presence_penalty", PresencePenalty(params.presence_penalty), "output"))
    if params.frequency_penalty != 0.0:
        stages.append(Stage("frequency_penalty", FrequencyPenalty(params.frequency_penalty), "output"))
    warper_classes = {
        "temperature": TemperatureLogitsWarper,
        "top_k": TopKLogitsWarper,
        "top_p": TopP,
        "min_p": MinPLogitsWarper,
    }
    for name, value in enabled_warpers(params):
        stages.append(Stage(name, warper_classes[name](value), "none"))
    return stages
