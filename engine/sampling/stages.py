"""The sampling stages, in pipeline order: penalties (CTRL repetition, OpenAI presence and
frequency, DRY), the user's logit bias and banned tokens, then the warpers: temperature, top-k,
top-p, min-p, typical-p, XTC. transformers' own `LogitsProcessor` classes do the work where they
exist; the OpenAI penalties, an exact-mass top-p, DRY (engine.sampling.dry) and XTC are written
here. A stage the params leave neutral is not in the pipeline at all."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TypicalLogitsWarper,
)

from engine.config import SamplingParams
from engine.sampling.dry import DryPenalty

# Stages that act in greedy decoding too (they change which token is the argmax); the recorded
# "penalized" logits of a snapshot are the scores after the last of them.
PENALTY_STAGES = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "dry",
    "logit_bias",
    "banned_tokens",
)
WARPER_STAGES = ("temperature", "top_k", "top_p", "min_p", "typical_p", "xtc")
# XTC coins kept per reply position, so every evaluation of one position (the speculative
# verifier's distribution, then the token's logprob and snapshot) sees the same coin.
XTC_COINS_KEPT = 64
# Masses are float32 sums of softmax outputs whose inputs were themselves rounded: a set whose
# mass is within this of top_p counts as reaching it, so that e.g. p=0.8 over probabilities
# [0.5, 0.3, 0.15, 0.05] keeps two tokens whatever constant the logits are offset by.
TOP_P_TOLERANCE = 1e-5
FIRST_RANKED = 64  # tokens top-p ranks first (then 4x as many, until its mass is reached)


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
        # Only the likeliest tokens can be kept: rank the top few, four times as many until the
        # last one ranked is dropped in every row (a full sort of the packaged model's 49,152
        # logits took 1.5-3 ms a row at one thread, more than its decode step; its top 64 take
        # 0.05 ms). After top-k only the survivors are ranked at all. Each probability is the
        # sorted softmax's (exp(x - max) over the sum of every exp(x - max)), its normalizer
        # summed in the vocabulary's order rather than the sorted one: a rounding apart.
        alive = max(1, int((scores > -math.inf).sum(-1).max()))
        top = scores.max(dim=-1, keepdim=True).values
        normalizer = (scores - top).exp().sum(dim=-1, keepdim=True)
        ranked = min(alive, FIRST_RANKED)
        while True:
            sorted_logits, order = torch.topk(scores, ranked, dim=-1)
            probs = (sorted_logits - top).exp() / normalizer
            mass_above = probs.cumsum(dim=-1) - probs
            drop_sorted = mass_above >= self.top_p - TOP_P_TOLERANCE
            if ranked == alive or bool(drop_sorted[..., -1].all()):
                break
            ranked = min(alive, 4 * ranked)
        drop_sorted[..., 0] = False  # the likeliest token always stays
        kept = sorted_logits.masked_fill(drop_sorted, -math.inf)
        return torch.full_like(scores, -math.inf).scatter_(-1, order, kept)


class LogitBias:
    """OpenAI logit bias: add a fixed amount to the logits of chosen token ids."""

    def __init__(self, bias: tuple[tuple[int, float], ...]):
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        pairs = [(t, b) for t, b in self.bias if t < vocab]  # ids the LM head cannot produce
        if not pairs:
            return scores
        index = torch.tensor([t for t, _ in pairs], device=scores.device, dtype=torch.long)
        amounts = scores.new_tensor([b for _, b in pairs]).reshape(1, -1)
        return scores.index_add(1, index, amounts)


class BannedTokens:
    """Tokens that can never be drawn: their logits become -inf. A ban of every token the model
    could still draw would leave nothing to sample; then the scores pass unchanged."""

    def __init__(self, token_ids: tuple[int, ...]):
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        ids = [t for t in self.token_ids if t < vocab]
        if not ids:
            return scores
        banned = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
        banned[ids] = True
        out = scores.masked_fill(banned, -math.inf)
        return out if bool(torch.isfinite(out).any()) else scores


class ExcludeTopChoices:
    """XTC (p-e-w; text-generation-webui, llama.cpp): with probability `probability`, remove
    every token whose probability is at least `threshold` except the least likely of them, so
    the draw skips the most predictable choices while a still-plausible one remains. Fewer than
    two tokens at the threshold: nothing happens. (webui also skips a firing that would remove
    the newline or EOS token; like llama.cpp, this one does not.)

    The coin comes from the request's generator (`uniform`), so a seeded reply is reproducible;
    it is drawn once per reply position (the output length it is called with)."""

    def __init__(self, threshold: float, probability: float, uniform: Callable[[], float]):
        self.threshold = threshold
        self.probability = probability
        self._uniform = uniform
        self._coins: dict[int, bool] = {}

    def fires(self, position: int) -> bool:
        fired = self._coins.get(position)
        if fired is None:
            fired = self._coins[position] = self._uniform() < self.probability
            for old in [p for p in self._coins if p < position - XTC_COINS_KEPT]:
                del self._coins[old]
        return fired

    def __call__(self, output_ids: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        if not self.fires(len(output_ids)):
            return scores
        return exclude_top_choices(scores, self.threshold)


def exclude_top_choices(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """XTC's cut on scores [1, V] when its coin has fired."""
    probs = torch.softmax(scores, dim=-1)
    above = probs >= threshold
    if int(above.sum()) < 2:
        return scores
    # Keep the least likely of the tokens above the threshold; remove the others.
    least = torch.where(above, probs, math.inf).argmin(dim=-1, keepdim=True)
    remove = above.scatter(-1, least, False)
    return scores.masked_fill(remove, -math.inf)


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    # (ids, scores [1, V]) -> scores: ids is the history below as a long tensor [1, L] (what
    # transformers' processors take), as the token ids themselves for the "... tokens" forms (our
    # own stages, which read Python ints: no tensor built and read back each token), or None for
    # a stage that reads none (transformers' processors annotate it LongTensor all the same)
    processor: Callable[[Any, torch.Tensor], torch.Tensor]
    # Which token history the stage reads: the CTRL repetition penalty counts the prompt too,
    # the OpenAI penalties only what the model generated; warpers read none (XTC reads the
    # output's length, the position its coin belongs to).
    history: str  # "prompt+output" | "output" | "prompt+output tokens" | "output tokens" | "none"


def enabled_warpers(params: SamplingParams) -> list[tuple[str, float]]:
    """The temperature/truncation stages the params switch on, in pipeline order (none if greedy).
    XTC's value is its threshold (its probability is in the params)."""
    if params.greedy:
        return []
    wanted = [
        ("temperature", float(params.temperature), params.temperature != 1.0),
        ("top_k", params.top_k, params.top_k > 0),
        ("top_p", float(params.top_p), params.top_p < 1.0),
        ("min_p", float(params.min_p), params.min_p > 0.0),
        ("typical_p", float(params.typical_p), params.typical_p < 1.0),
        ("xtc", float(params.xtc_threshold), params.xtc_probability > 0.0),
    ]
    return [(name, value) for name, value, on in wanted if on]


def build_stages(
    params: SamplingParams,
    decode_token: Callable[[int], str] | None = None,
    uniform: Callable[[], float] | None = None,
) -> list[Stage]:
    """The pipeline for `params`. `decode_token` tells DRY which tokens hold a sequence breaker;
    `uniform` is XTC's coin (the request's generator)."""
    stages: list[Stage] = []
    if params.repetition_penalty != 1.0:
        rep = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))
        stages.append(Stage("repetition_penalty", rep, "prompt+output"))
    if params.presence_penalty != 0.0:
        stages.append(Stage("presence_penalty", PresencePenalty(params.presence_penalty), "output"))
    if params.frequency_penalty != 0.0:
        stages.append(Stage("frequency_penalty", FrequencyPenalty(params.frequency_penalty), "output"))
    if params.dry_multiplier > 0.0:
        dry = DryPenalty(
            params.dry_multiplier,
            params.dry_base,
            params.dry_allowed_length,
            params.dry_sequence_breakers,
            params.dry_penalty_last_n,
            decode_token,
        )
        stages.append(Stage("dry", dry, "prompt+output tokens"))
    if params.logit_bias:
        stages.append(Stage("logit_bias", LogitBias(params.logit_bias), "none"))
    if params.banned_token_ids:
        stages.append(Stage("banned_tokens", BannedTokens(params.banned_token_ids), "none"))
    warper_classes = {
        "temperature": TemperatureLogitsWarper,
        "top_k": TopKLogitsWarper,
        "top_p": TopP,
        "min_p": MinPLogitsWarper,
        "typical_p": TypicalLogitsWarper,
    }
    for name, value in enabled_warpers(params):
        if name == "xtc":
            coin = uniform or _unseeded_uniform
            stages.append(
                Stage("xtc", ExcludeTopChoices(value, params.xtc_probability, coin), "output tokens")
            )
        else:
            stages.append(Stage(name, warper_classes[name](value), "none"))
    return stages


def _unseeded_uniform() -> float:
    return float(torch.rand(()))
