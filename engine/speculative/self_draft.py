"""What drafts: a separate draft model, or the target drafting for itself (the self-draft).

The self-draft is the target's first n layers, then a head fitted to read the final layer's
answer off layer n's: a least-squares map A, b from layer n's normed residual to the final normed
hidden state (what the LM head reads), folded into the head's rows (W_head A, W_head b) and
kept as int8 rows; the head covers only the vocabulary's first V ids (a BPE vocabulary is in
merge order: frequent tokens first). It drafts only while its top probability is at least a
confidence threshold. The layer count n, the vocabulary cut V and the threshold are chosen by
measuring, on the target's own greedy replies to several dozen prompts, how often its drafts equal
the target's tokens (`calibrate`), once per model; the result is cached.

What the fit needs is data: the map has hidden^2 unknowns. Measured on the packaged SmolLM2-135M
(hidden 576, 30 layers), a draft from layer 12 agreed with the target's next token on 13% of
held-out reply positions fitted on 4 replies (~400 positions), 31% on 30 replies (3,000) and 34%
on 60 (6,000); drafting only at >= 50% confidence, 59% of its drafts agreed (on 37% of positions).
So the calibration sizes its replies by the hidden size (`calibration_replies`).

Why this and not layer skipping: measured on the packaged model, a draft's top-1 agreement was
5-12% keeping the first 4-16 layers as they are (early exit), 18% keeping 24; skipping middle
layers did no better (first 8 + last 16: 24%; every other middle layer: 6%).

On a model this small a self-draft does not pay on free chat: a draft forward costs about its
share of the weights (12 of 30 layers and its head: ~0.3 of a step) and a verified row ~0.2 more,
more than the ~60% agreement it reaches where it is confident saves. The draft tuner
(engine/speculative/adaptive.py) measures that and drafts only where it pays.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.cache_dirs import cache_root
from engine.kernels.gguf_weight import GGUFWeight
from engine.kernels.linear import KernelLinear
from engine.kernels.packing import quantize_int8_per_row
from engine.kernels.policy import KernelPolicy
from engine.kernels.weights import Int8RowWeight
from engine.model.layer_attention import AttentionSpec
from engine.model.llama_forward import unsupported_reason
from engine.model.loaded import LoadedModel
from engine.quant.base import model_weight_bytes
from engine.shapes import ModelShapes
from engine.speculative.adaptive import PRIOR_ROW_COST

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PLAN_VERSION = 2
# Candidate thresholds on the draft's top probability (0: draft whatever it believes).
CONFIDENCES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MIN_VOCAB = 4096  # the smallest vocabulary cut tried; then every power of two up to the whole
RIDGE = 1e-2  # the least-squares map's ridge, per sample (the fit has hidden^2 unknowns)
# What a verified draft row adds to a step, as a share of a one-row step, in the choice of a plan
# (the draft tuner measures it at run time: engine.speculative.adaptive.PRIOR_ROW_COST).
ROW_COST = PRIOR_ROW_COST


@dataclass(slots=True)
class DraftModel:
    """A model that drafts, as the drafter (engine/core/drafter.py) runs it."""

    model: PreTrainedModel
    name: str
    shapes: ModelShapes  # its layers, KV heads, head dim (its own KV pool)
    attention: tuple[AttentionSpec, ...]
    policy: KernelPolicy | None
    dtype: torch.dtype
    device: torch.device
    weight_bytes: int  # its own (a self-draft's fitted head; a draft model's weights)
    confidence: float = 0.0  # drafts stop at the first whose top probability is below this
    # its first layers that are the target's own (a self-draft: all of them), whose K/V the
    # drafter copies from the target's pool instead of computing them again
    target_layers: int = 0
    # what its KV pool stores when the engine's config says "auto" (LoadedModel.kv_dtype_for)
    kv_dtype_auto: str = "auto"

    def kv_dtype_for(self, requested: str) -> str:
        return self.kv_dtype_auto if requested == "auto" else requested


@dataclass(frozen=True, slots=True)
class SelfDraftPlan:
    """The self-draft chosen for one model, and what the calibration measured."""

    layers: int
    vocab: int
    confidence: float
    acceptance: float  # of the drafts it makes at that threshold, on held-out replies
    coverage: float  # the share of held-out positions where it is that confident
    cost: float = 0.0  # a draft forward's weight bytes over a decode step's
    positions: int = 0  # held-out reply positions it was judged on
    # (layers, vocab, confidence, acceptance, coverage, cost) of every candidate measured
    measured: tuple[tuple[int, int, float, float, float, float], ...] = field(default=())

    def describe(self) -> str:
        return (
            f"first {self.layers} layers + a fitted head over {self.vocab} ids, drafting at >= "
            f"{self.confidence:.0%} confidence: {self.acceptance:.0%} of its drafts agreed with the "
            f"target at calibration ({self.coverage:.0%} of {self.positions} positions drafted; a draft "
            f"reads {self.cost:.0%} of a step's weights)"
        )


def draft_model(loaded: LoadedModel, name: str) -> DraftModel:
    """A separate draft model (same tokenizer, checked by the caller), its head on its fast
    kernel (a draft needs no exact logits)."""
    model = _view(loaded.model, range(loaded.info.num_layers), _fast_head(loaded.model, loaded.policy))
    return DraftModel(
        model,
        name,
        ModelShapes.from_config(model.config),
        loaded.attention,
        loaded.policy,
        loaded.dtype,
        loaded.device,
        loaded.info.weight_bytes,
        kv_dtype_auto=loaded.kv_dtype_for("auto"),
    )


def first_layers_draft(loaded: LoadedModel, layers: int) -> DraftModel:
    """The target's first `layers` layers with its final norm and head (early exit, no fit)."""
    _check_layers(loaded, layers)
    model = _view(loaded.model, range(layers), _fast_head(loaded.model, loaded.policy))
    return _self(loaded, model, layers, f"self (first {layers} layers)", 0, 0.0)


def fitted_self_draft(loaded: LoadedModel, plan: SelfDraftPlan, head: nn.Module) -> DraftModel:
    model = _view(loaded.model, range(plan.layers), head)
    weights = sum(t.numel() * t.element_size() for s in _storages(head) for t in s.tensors())
    return _self(loaded, model, plan.layers, f"self ({plan.describe()})", weights, plan.confidence)


def _self(
    loaded: LoadedModel, model: PreTrainedModel, layers: int, name: str, weights: int, confidence: float
) -> DraftModel:
    attention = loaded.attention[:layers] if loaded.attention else ()
    return DraftModel(
        model,
        name,
        ModelShapes.from_config(model.config),
        attention,
        loaded.policy,
        loaded.dtype,
        loaded.device,
        weights,
        confidence,
        target_layers=layers,
        kv_dtype_auto=loaded.kv_dtype_for("auto"),
    )


def _check_layers(loaded: LoadedModel, layers: int) -> None:
    total = loaded.info.num_layers
    if not 1 <= layers < total:
        raise ValueError(f"a self-draft needs 1..{total - 1} layers, got {layers}")


def _storages(module: nn.Module) -> tuple[Any, ...]:
    return module.storages() if isinstance(module, KernelLinear) else ()


# ---- the model as a draft sees it ------------------------------------------------------------
def _view(model: PreTrainedModel, layers: Sequence[int] | range, head: nn.Module) -> PreTrainedModel:
    """A shallow copy of `model` with only `layers` (shared, not copied) and `head` as its LM
    head: kvscope's forward and transformers' code both run it."""
    inner: Any = model.model
    keep = list(layers)
    draft_inner = copy.copy(inner)
    draft_inner._modules = dict(inner._modules)
    draft_inner._modules["layers"] = nn.ModuleList([inner.layers[i] for i in keep])
    config = copy.deepcopy(inner.config)
    config.num_hidden_layers = len(keep)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in keep]
    draft_inner.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft._modules["model"] = draft_inner
    head_name = next((n for n, m in model.named_children() if m is model.get_output_embeddings()), "lm_head")
    draft._modules[head_name] = head
    draft.config = config
    return draft


def _fast_head(model: PreTrainedModel, policy: KernelPolicy | None) -> nn.Module:
    """The head on its storage's fast kernel (the exact head recomputes what a draft does not
    need): the same weights as a plain kernel layer."""
    head = model.get_output_embeddings()
    if isinstance(head, KernelLinear):
        return KernelLinear(head.storage, head.bias, policy or head.policy)
    assert isinstance(head, nn.Module)
    return head


def head_rows(model: PreTrainedModel, rows: int) -> torch.Tensor:
    """The LM head's first `rows` rows as float32 [rows, hidden]: the weights every kernel reads."""
    head = model.get_output_embeddings()
    storage = getattr(head, "storage", None)
    ids = torch.arange(rows)
    if isinstance(storage, GGUFWeight):
        return storage.rows(ids)
    rows_of = getattr(storage, "rows", None)
    if rows_of is not None:
        return rows_of(ids, torch.float32)  # type: ignore[no-any-return]
    if storage is not None:
        return storage.dequantize(torch.float32)[:rows]  # type: ignore[no-any-return]
    weight = getattr(head, "weight", None)
    assert isinstance(weight, torch.Tensor), "an LM head with weights"
    return weight.detach().float()[:rows]


def fitted_head(weight: torch.Tensor, bias: torch.Tensor | None, policy: KernelPolicy | None) -> KernelLinear:
    """W_head A (and W_head b) as int8 rows: the draft's head."""
    codes, scales = quantize_int8_per_row(weight)
    return KernelLinear(Int8RowWeight(codes, scales), bias, policy or KernelPolicy())


# ---- calibration -----------------------------------------------------------------------------
@dataclass(slots=True)
class Calibration:
    """The target's own greedy replies, as full token sequences with where each reply starts."""

    sequences: list[list[int]]
    reply_starts: list[int]


@torch.inference_mode()
def _states(
    model: PreTrainedModel, ids: list[int], layers: Sequence[int]
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Layer outputs (the residual after layer i - 1, at i in `layers`) and the final normed
    hidden state, float32 [positions, hidden], from one forward of transformers' code."""
    inner: Any = model.model
    out = inner(
        input_ids=torch.tensor([ids], device=model.device), use_cache=False, output_hidden_states=True
    )
    states = out.hidden_states
    return {i: states[i][0].float() for i in layers}, states[-1][0].float()


def _fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least squares y ~ x A^T + b with a ridge: (A [H, H], b [H])."""
    ones = torch.ones(x.shape[0], 1, dtype=x.dtype)
    x1 = torch.cat([x, ones], 1)
    gram = x1.T @ x1 + RIDGE * x.shape[0] * torch.eye(x1.shape[1], dtype=x.dtype)
    solution = torch.linalg.solve(gram.double(), (x1.T @ y).double()).float()  # [H + 1, H]
    return solution[:-1].T.contiguous(), solution[-1].contiguous()


def candidate_layers(total: int) -> list[int]:
    """Layer counts worth measuring: a fifth to a half of the model."""
    return sorted({max(1, min(total - 1, round(total * f))) for f in (0.2, 0.25, 1 / 3, 0.4, 0.5)})


def candidate_vocabs(vocab_size: int) -> list[int]:
    """Vocabulary cuts worth measuring: MIN_VOCAB and every power of two after it, then all."""
    cuts, n = [], MIN_VOCAB
    while n < vocab_size:
        cuts.append(n)
        n *= 2
    return [*cuts, vocab_size]


def calibration_replies(hidden: int, available: int) -> int:
    """Replies to calibrate on: enough for ~10 positions per unknown of a row of the map (a
    reply and its prompt are ~100 positions), within the prompts there are."""
    return max(8, min(available, -(-10 * hidden // 100)))


def net_saving(acceptance: float, coverage: float, cost: float) -> float:
    """Target steps a draft forward saves, expected: where it is confident (coverage) a draft
    saves a step when kept (acceptance) and costs a verified row (ROW_COST) either way, and the
    forward itself costs `cost` of a step wherever it runs."""
    return coverage * (acceptance - ROW_COST) - cost


def calibrate(
    loaded: LoadedModel, calibration: Calibration, layers: int | None = None
) -> tuple[SelfDraftPlan, KernelLinear]:
    """Fit a self-draft's map at each candidate layer count (or at `layers`) on three quarters of
    the replies, measure its agreement with the target's tokens on the other quarter at each
    vocabulary cut and confidence, and keep the candidate that saves the most target steps per
    draft forward (`net_saving`: on a small model every candidate may lose; the tuner then
    drafts rarely, and this is the one that loses least)."""
    model = loaded.model
    inner: Any = model.model
    total = loaded.info.num_layers
    candidates = [layers] if layers is not None else candidate_layers(total)
    for n in candidates:
        _check_layers(loaded, n)
    norm = _final_norm(model)
    fit_x: dict[int, list[torch.Tensor]] = {n: [] for n in candidates}
    fit_y: list[torch.Tensor] = []
    held: list[tuple[dict[int, torch.Tensor], torch.Tensor]] = []
    for index, (ids, start) in enumerate(zip(calibration.sequences, calibration.reply_starts)):
        states, final = _states(model, ids, candidates)
        if index % 4 != 3 or len(calibration.sequences) < 4:  # fit on every position: prompts, replies
            for n in candidates:
                fit_x[n].append(norm(states[n]))
            fit_y.append(final)
        if index % 4 == 3 or (len(calibration.sequences) < 4 and index % 2):  # judge on replies:
            rows = slice(start - 1, len(ids) - 1)  # position p - 1 predicts token p
            held.append(({n: norm(states[n][rows]) for n in candidates}, torch.tensor(ids[start:])))
    vocab_size = loaded.info.vocab_size
    w_head = head_rows(model, vocab_size)
    hidden = w_head.shape[1]
    head_bias = getattr(model.get_output_embeddings(), "bias", None)
    # a decode step reads every layer's weights and the head's once; a draft its layers' and its
    # own head's (int8 codes and a float32 scale per row)
    layer_bytes = [model_weight_bytes(layer) for layer in inner.layers]
    step_bytes = sum(layer_bytes) + model_weight_bytes(model.get_output_embeddings())
    y = torch.cat(fit_y)
    targets = torch.cat([t for _, t in held])
    measured: list[tuple[int, int, float, float, float, float]] = []
    best: tuple[float, int, int, float, float, float, float] | None = None
    maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for n in candidates:
        a, b = maps[n] = _fit(torch.cat(fit_x[n]), y)
        logits = (torch.cat([states[n] for states, _ in held]) @ a.T + b) @ w_head.T
        for vocab in candidate_vocabs(vocab_size):
            probs = torch.softmax(logits[:, :vocab], -1)
            top, pick = probs.max(-1)
            agree = pick == targets
            cost = (sum(layer_bytes[:n]) + vocab * (hidden + 4)) / step_bytes
            for tau in CONFIDENCES:
                drafted = top >= tau
                coverage = float(drafted.float().mean())
                acceptance = float(agree[drafted].float().mean()) if bool(drafted.any()) else 0.0
                measured.append((n, vocab, tau, acceptance, coverage, cost))
                key = (net_saving(acceptance, coverage, cost), n, vocab, tau, acceptance, coverage, cost)
                if best is None or key > best:
                    best = key
    assert best is not None
    _, n, vocab, tau, acceptance, coverage, cost = best
    a, b = maps[n]
    weight = w_head[:vocab] @ a
    bias = w_head[:vocab] @ b
    if isinstance(head_bias, torch.Tensor):
        bias = bias + head_bias.detach().float()[:vocab]
    plan = SelfDraftPlan(n, vocab, tau, acceptance, coverage, cost, int(targets.numel()), tuple(measured))
    return plan, fitted_head(weight, bias, loaded.policy)


def _final_norm(model: PreTrainedModel) -> Any:
    inner: Any = model.model
    norm = inner.norm

    def apply(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = norm(x.to(next(model.parameters()).dtype)).float()
        return out

    return apply


# ---- the plan, kept per model ----------------------------------------------------------------
def model_key(loaded: LoadedModel) -> str:
    """A model's identity for the cached plan: what it is and which weights."""
    info = loaded.info
    text = f"{info.name}|{info.source}|{info.quantization}|{info.weight_bytes}|{info.dtype}|{info.num_layers}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _plan_file(loaded: LoadedModel) -> Path:
    return cache_root() / "self-draft" / f"{model_key(loaded)}.json"


def load_plan(loaded: LoadedModel) -> tuple[SelfDraftPlan, KernelLinear] | None:
    """The cached plan and its head for `loaded`, or None."""
    path = _plan_file(loaded)
    try:
        raw = json.loads(path.read_text())
        tensors = torch.load(path.with_suffix(".pt"), weights_only=True)
    except (OSError, ValueError, RuntimeError):
        return None
    if raw.get("version") != PLAN_VERSION:
        return None
    fields = raw["plan"]
    fields["measured"] = tuple(tuple(m) for m in fields["measured"])
    plan = SelfDraftPlan(**fields)
    return plan, KernelLinear(
        Int8RowWeight(tensors["codes"], tensors["scales"]), tensors["bias"], loaded.policy or KernelPolicy()
    )


def save_plan(loaded: LoadedModel, plan: SelfDraftPlan, head: KernelLinear) -> None:
    storage = head.storage
    assert isinstance(storage, Int8RowWeight)
    path = _plan_file(loaded)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        codes, scales = storage.tensors()[:2]
        torch.save({"codes": codes, "scales": scales, "bias": head.bias}, path.with_suffix(".pt"))
        path.write_text(json.dumps({"version": PLAN_VERSION, "plan": asdict(plan)}))
    except OSError:
        pass  # an unwritable cache only costs a new calibration next time


def own_forward_runs(loaded: LoadedModel) -> bool:
    return unsupported_reason(loaded.model, loaded.attention or None) is None
