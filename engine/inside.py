"""What the views of the model's inside answer: plain data the engine computes on demand for one
token (or one text) and the app draws. Torch-free, like engine.events: the views read it.

- `TokenInside`: the logit lens (the residual stream after every layer through the final norm and
  the head) and every head's attention for the token drawn after a context, from one replay of
  that context through the engine's paged forward (engine/core/inside_token.py);
- `ExpertRoutes`: which experts a mixture-of-experts model routed each token to, per layer;
- `TextScore`: each token's log-probability, rank and surprise under the model, and the perplexity;
- `ControlVector` and `Steered`: a direction added to the residual stream, and the next token's
  distribution with and without it;
- `WhatIfAnswer`: a what-if's stages and which logits they ran on (the step's own, or recomputed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.events import TokenSnapshot

# Sequence ids of the engine's replays of a context (engine/core/replay.py): a range of their own,
# far above any request's and below the forks of a group's samples and beams (1 << 40,
# engine/core/group_driver.py), so that the page map names a replay's blocks as an
# inspection's, never a reply's.
REPLAY_SEQ_BASE = 2_000_000_000
REPLAY_SEQ_SPAN = 1 << 32


def is_replay_seq(seq_id: int) -> bool:
    return REPLAY_SEQ_BASE <= seq_id < REPLAY_SEQ_BASE + REPLAY_SEQ_SPAN


@dataclass(frozen=True, slots=True)
class Candidates:
    """The likeliest tokens of one distribution, likeliest first."""

    ids: tuple[int, ...]
    texts: tuple[str, ...]
    probs: tuple[float, ...]


# What a lens's last stage was checked against: the drawing step's own logits (kept for the
# token), or the replay's forward's (the step's are no longer kept).
STEP_LOGITS = "step"
REPLAY_LOGITS = "replay"


# ---- logit lens ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LensLayer:
    """The residual stream after one stage read through the final norm and the head."""

    stage: int  # 0: the embedding (what enters layer 0); i + 1: what layer i leaves
    token_rank: int  # the drawn token's rank here (1: the top candidate)
    token_prob: float  # its probability here
    top: Candidates
    entropy: float  # nats


@dataclass(frozen=True, slots=True)
class LogitLens:
    token_id: int  # the token drawn after the context
    token_text: str
    layers: tuple[LensLayer, ...]  # stage 0 (the embedding) .. num_layers (the last layer)
    # The first stage at which the drawn token is the top candidate (None: it never is).
    first_lead: int | None
    # max |lens(last layer) - logits| over the vocabulary, against the logits of the step that
    # drew the token where the engine still keeps them (`gap_against` STEP_LOGITS), else the
    # replay's own forward's (REPLAY_LOGITS): 0.0 when the last stage is that distribution to the bit.
    last_gap: float
    gap_against: str = STEP_LOGITS

    @property
    def against_the_step(self) -> bool:
        return self.gap_against == STEP_LOGITS

    @property
    def num_layers(self) -> int:
        return len(self.layers) - 1


# ---- attention per head -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LayerAttentionMap:
    """One layer's attention of the inspected row: every head over the positions it attended."""

    layer: int
    start: int  # first position attended (> 0 where a sliding window has begun to slide)
    window: int | None  # the layer's sliding window (None: full attention)
    softcap: float | None
    sinks: bool
    probs: tuple[tuple[float, ...], ...]  # [head][position - start] for positions start..query

    @property
    def heads(self) -> int:
        return len(self.probs)

    def sink_mass(self, head: int) -> float:
        """The probability the head's sink took (0 without sinks): 1 - its weights' sum."""
        return max(0.0, 1.0 - math.fsum(self.probs[head])) if self.sinks else 0.0


@dataclass(frozen=True, slots=True)
class AttentionMap:
    query_position: int  # the inspected row's position (the last token of the context)
    token_ids: tuple[int, ...]  # the context, by position
    token_texts: tuple[str, ...]
    block_size: int
    block_ids: tuple[int, ...]  # the KV blocks the row read, in block-table order
    layers: tuple[LayerAttentionMap, ...]
    kernel: str  # which computation wrote the numbers (kvk's row attention, or torch without kvk)

    def blocks_read(self, layer: int) -> tuple[int, ...]:
        """The blocks layer `layer` read (a sliding window skips the blocks wholly before it)."""
        first = self.layers[layer].start // self.block_size
        last = self.query_position // self.block_size
        return self.block_ids[first : last + 1]


@dataclass(frozen=True, slots=True)
class TokenInside:
    """The logit lens and the attention of the step that drew a token, recomputed for it."""

    lens: LogitLens | None
    lens_unavailable: str  # why there is no lens ("" when there is one)
    attention: AttentionMap
    context_tokens: int
    reused_tokens: int  # positions whose K/V came from the prefix cache as the reply's steps wrote them
    recomputed_tokens: int  # positions run again through the engine's forward (the inspected row included)
    seconds: float  # on the engine thread
    executor: str  # which forward ran (kvscope's own, or transformers')


# ---- experts ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenRoute:
    """One token's route through one MoE layer: the experts its router chose and their weights."""

    experts: tuple[int, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ExpertRoutes:
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]  # decoder layers that route (the others are dense)
    token_ids: tuple[int, ...]  # prompt then reply
    token_texts: tuple[str, ...]
    reply_start: int  # index of the first reply token in token_ids
    routes: tuple[tuple[TokenRoute, ...], ...]  # [position][index into moe_layers]
    load: tuple[tuple[int, ...], ...]  # [index into moe_layers][expert]: the reply's tokens routed there
    seconds: float


# ---- prompt log-probs ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScoredToken:
    token_id: int
    text: str
    logprob: float | None  # log p(token | the tokens before it); None for the first token
    rank: int | None  # 1: the model's top candidate there
    top: Candidates | None  # the likeliest tokens at this position (None for the first token)
    # their log-probabilities as computed (float32 values, exactly: the top one is `logprob` to
    # the bit when the token is the model's top candidate, which is how clients tell greedy text)
    top_logprobs: tuple[float, ...] = ()

    @property
    def surprise_bits(self) -> float | None:
        return None if self.logprob is None else -self.logprob / math.log(2)


@dataclass(frozen=True, slots=True)
class TextScore:
    tokens: tuple[ScoredToken, ...]
    total_logprob: float  # over every token but the first
    scored: int  # tokens with a log-probability
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(-self.total_logprob / self.scored) if self.scored else math.nan


# ---- steering -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ControlVector:
    """Directions to add to the residual stream: `directions[i]` after decoder layer `layers[i]`
    (0-based: the output of layer i), llama.cpp's `direction.i` (its layer 0 is never used)."""

    name: str
    layers: tuple[int, ...]
    directions: tuple[tuple[float, ...], ...]
    source: str  # the file, or the two prompts it was computed from
    model_hint: str = ""

    @property
    def width(self) -> int:
        return len(self.directions[0]) if self.directions else 0


@dataclass(frozen=True, slots=True)
class Steered:
    """The next token's distribution after a context, without and with a control vector."""

    layers: tuple[int, ...]  # where the direction was added
    strength: float
    plain: Candidates
    steered: Candidates
    kl: float  # KL(steered || plain) over the whole vocabulary, nats
    seconds: float


# ---- what-if ---------------------------------------------------------------------------------------
KEPT = "kept"
RECOMPUTED = "recomputed"


@dataclass(frozen=True, slots=True)
class WhatIfAnswer:
    snapshot: TokenSnapshot
    logits_from: str  # KEPT: the step's own logits; RECOMPUTED: through the engine's paged forward
    how: str  # one line for the label
