"""How far a quantized model is from its full-precision reference, token by token.

Both models read the same tokens (teacher forcing: each position sees the true prefix, not the
model's own guesses), and at every position we compare the two next-token distributions:
KL(reference || quantized) in nats, whether their top-1 tokens agree, and each model's negative
log-likelihood of the token that actually follows (whose mean gives the perplexity).

Entry points: `eval_token_ids(tokenizer)` (the shipped evaluation text), `teacher_forced_logits`
(one forward, optionally through the paged int8 KV cache), `compare_logits` / `compare_models`
-> QualityReport, `layer_output_errors` (each quantized layer against its reference layer) and
`greedy_agreement` for two generated token sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from engine.resources import resource

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EVAL_TEXT_PATH = resource("engine/data/eval_text.txt")
# Positions compared per slice: bounds the float32 temporaries to ~ROWS x vocab at a time.
ROWS_PER_SLICE = 256
KV_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class QualityReport:
    """Per predicted position i (the token after position i of the input): i = 0 .. n-1."""

    kl: tuple[float, ...]  # KL(reference || quantized), nats
    top1_agree: tuple[bool, ...]
    reference_nll: tuple[float, ...]  # -log p_ref(actual next token)
    quantized_nll: tuple[float, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.kl)

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / len(self.kl)

    @property
    def max_kl(self) -> float:
        return max(self.kl)

    @property
    def top1_agreement(self) -> float:
        return sum(self.top1_agree) / len(self.top1_agree)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(sum(self.reference_nll) / len(self.reference_nll))

    @property
    def quantized_perplexity(self) -> float:
        return math.exp(sum(self.quantized_nll) / len(self.quantized_nll))


def eval_text() -> str:
    return EVAL_TEXT_PATH.read_text(encoding="utf-8")


def eval_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The shipped evaluation text as plain prose tokens (no chat template, no special tokens)."""
    return list(tokenizer(eval_text(), add_special_tokens=False)["input_ids"])


@torch.no_grad()
def teacher_forced_logits(
    model: PreTrainedModel, token_ids: list[int], kv_dtype: str = "auto"
) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of one forward over `token_ids`.

    kv_dtype 'auto' is a plain transformers forward; 'int8' runs through kvscope's paged
    attention with an int8 KV pool, so the attention reads the same quantized K/V the engine
    would (every position's keys are written to the pool and read back from it)."""
    if len(token_ids) < 2:
        raise ValueError("Quality needs at least two tokens (one to read, one to predict).")
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    if kv_dtype == "auto":
        logits: torch.Tensor = model(input_ids=ids).logits
        return logits[0].float()
    return _paged_logits(model, ids, kv_dtype)


def _paged_logits(model: PreTrainedModel, ids: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    from engine.kv.attention import PagedBatch, PagedCache, SeqSlice, paged_attention
    from engine.kv.storage import PagedKVStorage
    from engine.model.layer_attention import probe_attention
    from engine.model.shapes import ModelShapes

    shapes = ModelShapes.from_config(model.config)
    n = ids.shape[1]
    num_blocks = -(-n // KV_BLOCK_SIZE)
    param = next(model.parameters())
    storage = PagedKVStorage(
        shapes.num_layers,
        num_blocks,
        KV_BLOCK_SIZE,
        shapes.num_kv_heads,
        shapes.head_dim,
        param.dtype,
        param.device,
        kv_dtype=kv_dtype,
        # each layer as its family attends (windows that live only in the mask included)
        layers=probe_attention(model, shapes),
    )
    positions = torch.arange(n, device=param.device)
    batch = PagedBatch(storage, positions, [SeqSlice(0, n, n, slice(0, num_blocks))])
    with paged_attention(model, batch):
        out = model(input_ids=ids, position_ids=positions[None], cache=PagedCache(), paged_batch=batch)
    logits: torch.Tensor = out.logits
    return logits[0].float()


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
    from engine.quant.base import decoder_linears

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
