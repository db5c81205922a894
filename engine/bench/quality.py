"""How far a quantized model is from its full-precision reference, token by token.

Both models read the same tokens (teacher forcing: each position sees the true prefix, not the
model's own guesses), and at every position we compare the two next-token distributions:
KL(reference || quantized) in nats, whether their top-1 tokens agree, and each model's negative
log-likelihood of the token that actually follows (whose mean gives the perplexity).

Entry points: `eval_token_ids(tokenizer)` (the shipped evaluation text), `compare_logits` /
`compare_models` over engine.model.logits' teacher-forced logits -> QualityReport, `layer_output_errors` (each quantized layer against its reference layer) and
`greedy_agreement` for two generated token sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from engine.model.logits import teacher_forced_logits
from engine.quant.base import decoder_linears
from engine.resources import resource
from engine.results import QualityReport

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EVAL_TEXT_PATH = resource("engine/data/eval_text.txt")
# Positions compared per slice: bounds the float32 temporaries to ~ROWS x vocab at a time.
ROWS_PER_SLICE = 256


def eval_text() -> str:
    return EVAL_TEXT_PATH.read_text(encoding="utf-8")


def eval_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The shipped evaluation text as plain prose tokens (no chat template, no special tokens)."""
    return list(tokenizer(eval_text(), add_special_tokens=False)["input_ids"])


def compare_logits(reference: torch.Tensor, quantized: torch.Tensor, token_ids: list[int]) -> QualityReport:
    """reference/quantized: logits [T, vocab] over `token_ids` (T tokens); compares the T - 1
    predictions of the tokens that follow."""
    if reference.shape != quantized.shape or reference.shape[0] != len(token_ids):
        raise ValueError(
            f"logits {tuple(reference.shape)} and {tuple(quantized.shape)} do not both cover "
            f"{len(token_ids)} tokens"
        )
    targets = torch.tensor(token_ids[1:], dtype=torch.long, device=reference.device)
    kl, agree, ref_nll, q_nll = [], [], [], []
    for start in range(0, len(targets), ROWS_PER_SLICE):
        stop = min(start + ROWS_PER_SLICE, len(targets))
        log_p = F.log_softmax(reference[start:stop].float(), dim=-1)
        log_q = F.log_softmax(quantized[start:stop].float(), dim=-1)
        # rounding can leave a tiny negative sum where the distributions are equal
        kl += (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0).tolist()
        agree += (log_p.argmax(-1) == log_q.argmax(-1)).tolist()
        target = targets[start:stop, None]
        ref_nll += (-log_p.gather(-1, target)[:, 0]).tolist()
        q_nll += (-log_q.gather(-1, target)[:, 0]).tolist()
    return QualityReport(tuple(kl), tuple(agree), tuple(ref_nll), tuple(q_nll))


def compare_models(
    reference_model: PreTrainedModel,
    quantized_model: PreTrainedModel,
    token_ids: list[int],
    kv_dtype: str = "auto",
) -> QualityReport:
    """Teacher-forced comparison of two models on `token_ids` (e.g. the current conversation);
    `kv_dtype` applies to the quantized model only, the reference always runs in full precision."""
    ref = teacher_forced_logits(reference_model, token_ids)
    quant = teacher_forced_logits(quantized_model, token_ids, kv_dtype)
    return compare_logits(ref, quant.to(ref.device), token_ids)


@torch.no_grad()
def layer_output_errors(
    reference_model: torch.nn.Module, quantized_model: torch.nn.Module, rows: int = 8, seed: int = 0
) -> dict[str, float]:
    """Per decoder linear (by name): the relative L2 error of the quantized model's layer output
    against the reference model's layer, on one fixed standard-normal input per layer.

    This isolates what a scheme did to each layer (the evaluation-text KL mixes every layer and
    the model's own sensitivity), so a near-zero KL can be told apart from a layer that was never
    quantized: a scheme whose grid reproduces the loaded weights shows an error at float rounding
    level (~1e-7), an untouched layer exactly 0."""

    generator = torch.Generator().manual_seed(seed)
    param = next(reference_model.parameters())
    errors: dict[str, float] = {}
    for name, reference in decoder_linears(reference_model):
        layer = quantized_model.get_submodule(name)
        # a plain int attribute of every linear-like layer (nn.Module's typing says Tensor | Module)
        width = cast(int, reference.in_features)
        x = torch.randn(rows, width, generator=generator).to(param.device, param.dtype)
        want = reference(x).float()
        errors[name] = ((layer(x).float() - want).norm() / want.norm()).item()
    return errors


@dataclass(frozen=True, slots=True)
class GreedyAgreement:
    common_prefix: int  # tokens equal before the first difference
    same_position: int  # positions holding the same token (meaningful until they diverge)
    length: int  # tokens compared (the shorter sequence)

    @property
    def prefix_fraction(self) -> float:
        return self.common_prefix / self.length if self.length else 1.0

    @property
    def position_fraction(self) -> float:
        return self.same_position / self.length if self.length else 1.0


def greedy_agreement(reference_ids: list[int], other_ids: list[int]) -> GreedyAgreement:
    length = min(len(reference_ids), len(other_ids))
    same = [a == b for a, b in zip(reference_ids, other_ids)]
    prefix = same.index(False) if False in same else length
    return GreedyAgreement(prefix, sum(same), length)
