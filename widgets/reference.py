"""The full-precision reference at one generated token, as a quality run measured it.

A quality run (app/quality/runner.py) feeds the reply's exact tokens through the unquantized
model; at each reply token it keeps that model's probabilities for the candidates the engine's
snapshot recorded, so the probability panel can draw them next to the running model's own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReferenceDistribution:
    label: str  # what the reference is, e.g. "full precision (float32)"
    probs: dict[int, float]  # candidate token id -> probability under the reference
    top_id: int  # the reference's own most likely token here
    top_text: str
    top_prob: float
    kl: float  # KL(reference || running model) at this token, nats
