"""Prompt log-probs: every token of a text scored by the model, each under the tokens before it
(teacher forcing), through the engine's paged forward in prefill chunks: its log-probability, its
rank among the vocabulary, the likeliest tokens there, and the text's perplexity.

What `/v1/completions` returns for `echo` with `logprobs` (so lm-evaluation-harness's
loglikelihood tasks run against `kvscope serve`), the app's scoring view and `engine score`.
Log-probabilities are log_softmax of the model's raw logits, as OpenAI's and vLLM's are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from engine.core.llm_engine import LLMEngine
from engine.core.replay import Replay
from engine.core.runner import ForwardResult
from engine.errors import InspectionError
from engine.inside import Candidates, ScoredToken, TextScore

# Rows of logits per forward: 256 x a 150k vocabulary is 150 MiB of float32 at most.
SCORE_CHUNK = 256
MAX_TOP = 20


def text_ids(core: LLMEngine, text: str) -> list[int]:
    """A text as the model reads a completion prompt (the tokenizer's own special tokens)."""
    ids: list[int] = list(core.tokenizer(text)["input_ids"])
    return ids


def score_text(core: LLMEngine, text: str, top_k: int = 5) -> TextScore:
    if not text.strip():
        raise InspectionError("there is no text to score")
    return score_ids(core, text_ids(core, text), top_k)


def score_ids(core: LLMEngine, ids: Sequence[int], top_k: int = 5) -> TextScore:
    started = time.perf_counter()
    ids = [int(i) for i in ids]
    if not ids:
        raise InspectionError("there is no token to score")
    if not 0 <= top_k <= MAX_TOP:
        raise InspectionError(f"top candidates must be in [0, {MAX_TOP}], got {top_k}")
    vocab = core.loaded.info.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InspectionError(f"token {bad[0]} is outside the model's vocabulary of {vocab}")
    window = core.limits.context_window
    if len(ids) > window:
        raise InspectionError(
            f"The text is {len(ids)} tokens but the model's context holds {window}: shorten it to score it."
        )
    text = core.text.text
    first = ScoredToken(ids[0], text(ids[0]), None, None, None)
    scored: list[ScoredToken] = [first]
    total = 0.0

    def take(start: int, count: int, result: ForwardResult) -> None:
        nonlocal total
        logits = result.logits  # [count, vocab]: row r predicts position start + r + 1
        targets = ids[start + 1 : start + count + 1]
        rows = logits[: len(targets)]
        if not targets:
            return
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        target = torch.tensor(targets, dtype=torch.long, device=rows.device)
        chosen = logprobs.gather(1, target[:, None])[:, 0]
        ranks = (rows > rows.gather(1, target[:, None])).sum(dim=-1) + 1
        if top_k:
            top_lp, top_ids = logprobs.topk(top_k, dim=-1)
        for r, token in enumerate(targets):
            lp = float(chosen[r])
            total += lp
            top: Candidates | None = None
            top_logprobs: tuple[float, ...] = ()
            if top_k:
                tids = tuple(int(i) for i in top_ids[r])
                top_logprobs = tuple(float(x) for x in top_lp[r])
                top = Candidates(tids, tuple(text(i) for i in tids), tuple(math.exp(x) for x in top_logprobs))
            scored.append(ScoredToken(token, text(token), lp, int(ranks[r]), top, top_logprobs))

    with Replay(core, ids, reuse=False) as replay:
        replay.run(len(ids), logits="all", on_result=take, chunk=min(replay.chunk_size(), SCORE_CHUNK))
    return TextScore(tuple(scored), total, len(ids) - 1, time.perf_counter() - started)
