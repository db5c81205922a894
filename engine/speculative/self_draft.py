"""What drafts: a separate draft model, or the target drafting for itself (the self-draft).

A self-draft is one of two kinds, both fitted by least squares on the target's own greedy
replies and read by a head over the vocabulary's first V ids (a BPE vocabulary is in merge
order: frequent tokens first), kept at 8 bits (`draft_storage`):
  the first n layers   the target's first n layers, then a map A, b from layer n's normed
                       residual to the final normed hidden state (what the LM head reads), folded
                       into the head's rows (W_head A, W_head b); run as a model over a KV pool
                       whose K/V are copied from the target's (engine/core/drafter.py);
  the hidden state     no layer: a map from the final normed hidden state at the last position,
                       the embedding of the token drawn there and the residual entering a middle
                       layer there to the next position's hidden state, chained draft after draft
                       (HIDDEN; engine/speculative/hidden_draft.py).
It drafts only while its top probability is at least a confidence threshold. The kind, n, V and
the threshold are chosen by measuring, on the target's greedy replies to up to 240 prompts,
how often its drafts equal the target's tokens (`calibrate`), once per model; the result is
cached.

What the fit needs is data: a layer map has hidden^2 unknowns, the hidden-state map three times that.
Measured on the packaged SmolLM2-135M (hidden 576, 30 layers), a draft from layer 12 agreed with
the target's next token on 13% of held-out reply positions fitted on 4 replies (~400 positions),
31% on 30 replies (3,000) and 34% on 60 (6,000); the hidden-state draft, judged on the
speculation bench's chat prompts, 21% of the drafts it made at >= 40% confidence fitted on 5,900
rows, 30% on 12,000, 31% on 37,000. So the calibration sizes its replies by the hidden size
(`calibration_replies`) and fits its normal equations row block by row block (`_Normal`).

Why not layer skipping: measured on the packaged model, a draft's top-1 agreement was 5-12%
keeping the first 4-16 layers as they are (early exit), 18% keeping 24; skipping middle layers
did no better (first 8 + last 16: 24%; every other middle layer: 6%).

On a model this small a self-draft barely pays on free chat. The calibration picks the
hidden-state draft there (a first-6-layers draft agreed less and read 16% of a step's weights;
the hidden-state draft reads 3.7%), and its drafts the target keeps ~30% of the time on the
bench's chat (42% on held-out calibration replies), against a verified row's ~20% of a step and
a round's bookkeeping. The draft tuner (engine/speculative/adaptive.py) measures that and drafts
only where it pays.
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import nn

from engine.cache_dirs import cache_root
from engine.kernels import native
from engine.kernels.gguf_weight import GGUFWeight
from engine.kernels.linear import KernelLinear
from engine.kernels.packing import quantize_int8_per_row
from engine.kernels.policy import KernelPolicy
from engine.kernels.weights import Int8RowWeight, WeightStorage
from engine.model.layer_attention import AttentionSpec
from engine.model.llama_forward import unsupported_reason
from engine.model.loaded import LoadedModel
from engine.quant.base import model_weight_bytes
from engine.shapes import ModelShapes
from engine.speculative.adaptive import PRIOR_ROW_COST

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PLAN_VERSION = 5  # 5: the draft's rows as Q8_0 blocks on kvk (draft_storage)
# A plan's layer count for the hidden-state draft: no layer of its own, the target's last hidden
# state and the token drawn from it through a fitted map (engine/speculative/hidden_draft.py).
HIDDEN = 0
# Candidate thresholds on the draft's top probability (0: draft whatever it believes).
CONFIDENCES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MIN_VOCAB = 4096  # the smallest vocabulary cut tried; then every power of two up to the whole
RIDGE = 1e-3
# Replies a calibration generates at most (~1 min on the packaged model at 2 cores, once per model)
MAX_REPLIES = 240
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
    middle: int = 0  # the hidden-state draft: the layer whose input residual it reads too
    # (layers, vocab, confidence, acceptance, coverage, cost) of every candidate measured
    measured: tuple[tuple[int, int, float, float, float, float], ...] = field(default=())

    def describe(self) -> str:
        source = (
            f"the target's hidden state, layer {self.middle}'s input and its token through a fitted map + a head"
            if self.layers == HIDDEN
            else f"first {self.layers} layers + a fitted head"
        )
        return (
            f"{source} over {self.vocab} ids, drafting at >= "
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


def fitted_self_draft(loaded: LoadedModel, fitted: FittedDraft) -> DraftModel:
    """A layer draft (plan.layers >= 1) as a model the drafter runs."""
    plan, head = fitted.plan, fitted.head
    model = _view(loaded.model, range(plan.layers), head)
    return _self(
        loaded, model, plan.layers, f"self ({plan.describe()})", fitted.weight_bytes(), plan.confidence
    )


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
    if layers == HIDDEN and not own_forward_runs(loaded):
        raise ValueError(
            "the hidden-state self-draft needs kvscope's own forward (it keeps the hidden state)"
        )
    if not HIDDEN <= layers < total:
        raise ValueError(
            f"a self-draft needs 1..{total - 1} layers (or {HIDDEN}: the hidden state), got {layers}"
        )


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


Q8_0 = GGMLQuantizationType.Q8_0


def draft_storage(weight: torch.Tensor) -> WeightStorage:
    """A draft's rows at 8 bits: GGUF Q8_0 blocks (a float16 scale per 32 inputs) on kvk's
    kernels where this build has them, else int8 codes with a scale per row on torch's packed
    kernel. A draft runs right after a step's forward has streamed the model's weights through
    the caches, so its own weights come from memory: measured in the engine on the packaged
    model at 2 threads, its map and head took 69 and 95 us a draft (medians) as int8 rows on
    torch's kernel, 38 and 53 as Q8_0 blocks on kvk's."""
    if _as_q8_0(weight.shape[1]):
        blocks = quants.quantize(weight.float().numpy(), Q8_0)
        return GGUFWeight(Q8_0, blocks, weight.shape[1], lib=native.kernels())
    codes, scales = quantize_int8_per_row(weight)
    return Int8RowWeight(codes, scales)


def _as_q8_0(cols: int) -> bool:
    """Whether draft_storage keeps rows of `cols` weights as Q8_0 blocks on this build."""
    return native.kernels() is not None and cols % GGML_QUANT_SIZES[Q8_0][0] == 0


def draft_bytes(rows: int, cols: int) -> int:
    """What a draft's rows of `cols` weights read (draft_storage's layout on this build)."""
    if _as_q8_0(cols):
        block, nbytes = GGML_QUANT_SIZES[Q8_0]
        return rows * cols // block * nbytes
    return rows * (cols + 4)  # int8 codes and a float32 scale


def fitted_head(weight: torch.Tensor, bias: torch.Tensor | None, policy: KernelPolicy | None) -> KernelLinear:
    """W_head A (and W_head b) at 8 bits: the draft's head (or the hidden-state draft's map)."""
    return _draft_linear(draft_storage(weight), bias, policy)


def _draft_linear(
    storage: WeightStorage, bias: torch.Tensor | None, policy: KernelPolicy | None
) -> KernelLinear:
    policy = policy or KernelPolicy()
    policy.prepare([storage])  # its kernel table now, not at the first draft
    return KernelLinear(storage, bias, policy)


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


@dataclass(slots=True)
class _Normal:
    """Least squares y ~ x A^T + b kept as its normal equations, row block by row block (the
    rows themselves are not kept: a 1.7B model's calibration has tens of thousands of them)."""

    gram: torch.Tensor | None = None  # [D + 1, D + 1] float64: [x, 1]^T [x, 1]
    xty: torch.Tensor | None = None  # [D + 1, H] float64: [x, 1]^T y
    rows: int = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1).double()
        gram, xty = x1.T @ x1, x1.T @ y.double()
        self.gram = gram if self.gram is None else self.gram + gram
        self.xty = xty if self.xty is None else self.xty + xty
        self.rows += x.shape[0]

    def __add__(self, other: _Normal) -> _Normal:
        assert (
            self.gram is not None
            and self.xty is not None
            and other.gram is not None
            and other.xty is not None
        )
        return _Normal(self.gram + other.gram, self.xty + other.xty, self.rows + other.rows)

    def solve(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [H, D], b [H]), with a ridge of RIDGE per row."""
        assert self.gram is not None and self.xty is not None, "rows to fit"
        ridge = RIDGE * self.rows * torch.eye(self.gram.shape[0], dtype=self.gram.dtype)
        solution = torch.linalg.solve(self.gram + ridge, self.xty).float()  # [D + 1, H]
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


def calibration_replies(hidden: int, available: int, layers: int | None = None) -> int:
    """Replies to calibrate on: enough for ~20 positions per unknown of a row of the widest map
    fitted (a reply and its prompt are ~150 positions): the hidden-state draft's, 3 x hidden, a
    candidate whenever `layers` (the draft asked for) is None or HIDDEN; else a layer map's,
    hidden. Within the prompts there are. (On the packaged model the hidden-state draft's
    agreement on chat unlike the calibration's still grew from ~8 positions per unknown to ~16:
    22.5% -> 24.4% of positions, fitted on 87 replies and on 180.)"""
    inputs = 3 * hidden if layers is None or layers == HIDDEN else hidden
    return max(8, min(available, MAX_REPLIES, -(-2 * inputs // 15)))


def middle_layer(total: int) -> int:
    """The layer whose input residual the hidden-state draft reads beside the final hidden state:
    two thirds of the way up. Measured on the packaged model (30 layers, float maps fitted on 180
    replies), its first draft agreed with the target at 24.4% of the positions of 15 chat replies to
    prompts unlike the calibration's reading layer 20's, 23.1% layer 15's, 22.9% layer 10's,
    22.0% layer 25's, 20.1% none."""
    return max(1, min(total - 1, round(2 * total / 3)))


def hidden_draft_input(final: torch.Tensor, embedded: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
    """The hidden-state draft's input rows: the final normed hidden state, the embedding of the
    token drawn from it and the residual entering the middle layer at its position, each at unit
    RMS. The map's rows share one scale across their inputs (int8 rows; a Q8_0 block's 32):
    unscaled, the packaged model's embeddings (RMS 0.11, against 1.9 for the hidden state) took
    coefficients 9x the others', and int8 rounding lost 2 points of agreement on chat (30.6% ->
    28.3% of confident drafts); at unit RMS it loses none. (The three parts scaled as one
    [rows, 3, hidden] tensor: a draft runs with the caches cold, where each small op costs.)"""
    parts = torch.stack([final, embedded, middle], 1)
    return (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True).clamp_min(1e-12))).flatten(1)


def net_saving(acceptance: float, coverage: float, cost: float) -> float:
    """Target steps a draft forward saves, expected: where it is confident (coverage) a draft
    saves a step when kept (acceptance) and costs a verified row (ROW_COST) either way, and the
    forward itself costs `cost` of a step wherever it runs."""
    return coverage * (acceptance - ROW_COST) - cost


@dataclass(slots=True)
class FittedDraft:
    """A calibrated self-draft: its plan, its head, and for the hidden-state draft its map."""

    plan: SelfDraftPlan
    head: KernelLinear  # [vocab cut, hidden]: the draft's logits
    # the hidden-state draft's map [hidden, 2 hidden] (engine/speculative/hidden_draft.py); None
    # for a layer draft, whose map is folded into its head
    map: KernelLinear | None = None

    def weight_bytes(self) -> int:
        """What it holds of its own: its head's rows and its map's."""
        modules = (self.head,) if self.map is None else (self.head, self.map)
        return sum(t.numel() * t.element_size() for m in modules for s in _storages(m) for t in s.tensors())


@dataclass(slots=True)
class _Candidate:
    """One candidate's data: its fit (x -> y) on the fitted replies and on the held-out ones
    (the plan's map is fitted on both once the plan is chosen), what it is judged on (x of
    the held-out replies' positions -> their tokens)."""

    fit: _Normal = field(default_factory=_Normal)
    held: _Normal = field(default_factory=_Normal)
    held_x: list[torch.Tensor] = field(default_factory=list)
    held_tokens: list[torch.Tensor] = field(default_factory=list)


def calibrate(loaded: LoadedModel, calibration: Calibration, layers: int | None = None) -> FittedDraft:
    """Fit each candidate's map on three quarters of the replies, measure its agreement with the
    target's tokens on the other quarter at each vocabulary cut and confidence, and keep the
    candidate that saves the most target steps per draft forward (`net_saving`: on a small model
    every candidate may lose; the tuner then drafts rarely, and this is the one that loses least),
    its map fitted again on every reply (agreement grows with the rows: on the bench's chat the
    packaged model's hidden-state draft had 21% of its drafts at >= 40% confidence kept fitted on
    5,900 rows, 30% on 12,000).
    The candidates (or only `layers`): the hidden-state draft (HIDDEN, where kvscope's own
    forward runs the target: it keeps the hidden state) and the first n layers at each count of
    `candidate_layers`."""
    model = loaded.model
    inner: Any = model.model
    total = loaded.info.num_layers
    if layers is not None:
        candidates = [layers]
    else:
        candidates = [*([HIDDEN] if own_forward_runs(loaded) else []), *candidate_layers(total)]
    for n in candidates:
        _check_layers(loaded, n)
    deep = [n for n in candidates if n != HIDDEN]
    middle = middle_layer(total)
    norm = _final_norm(model)
    embed = model.get_input_embeddings()
    data = {n: _Candidate() for n in candidates}
    few = len(calibration.sequences) < 4  # then every reply is fitted on, the odd ones judged too
    for index, (ids, start) in enumerate(zip(calibration.sequences, calibration.reply_starts)):
        states, final = _states(model, ids, [*deep, middle])
        fit = index % 4 != 3 or few  # fit on every position: prompts, replies
        held = index % 4 == 3 or (few and index % 2 == 1)  # judge on replies
        tokens = torch.tensor(ids)
        for n, d in data.items():
            if n == HIDDEN:  # x_p = [f_p, e(token p + 1), m_p] -> f_(p + 1), judged on token p + 2
                x = hidden_draft_input(final[:-2], _embedded(embed, tokens[1:-1]), states[middle][:-2])
                y, rows, first = final[1:-1], slice(start - 1, len(ids) - 2), start + 1
            else:  # x_p = layer n's normed residual -> f_p, judged on token p + 1
                x, y, rows, first = norm(states[n]), final, slice(start - 1, len(ids) - 1), start
            if fit:
                d.fit.add(x, y)
            if held:
                d.held.add(x, y)
                d.held_x.append(x[rows])
                d.held_tokens.append(tokens[first:])
    vocab_size = loaded.info.vocab_size
    w_head = head_rows(model, vocab_size)
    hidden = w_head.shape[1]
    head_bias = getattr(model.get_output_embeddings(), "bias", None)
    bias_rows = head_bias.detach().float() if isinstance(head_bias, torch.Tensor) else None
    # a decode step reads every layer's weights and the head's once; a draft its layers' (or the
    # hidden draft's map) and its own head's (draft_bytes)
    layer_bytes = [model_weight_bytes(layer) for layer in inner.layers]
    step_bytes = sum(layer_bytes) + model_weight_bytes(model.get_output_embeddings())
    measured: list[tuple[int, int, float, float, float, float]] = []
    best: tuple[float, int, int, float, float, float, float, int] | None = None
    for n, d in data.items():
        a, b = d.fit.solve()
        logits = (torch.cat(d.held_x) @ a.T + b) @ w_head.T
        if bias_rows is not None:
            logits = logits + bias_rows
        targets = torch.cat(d.held_tokens)
        own = draft_bytes(hidden, 3 * hidden) if n == HIDDEN else sum(layer_bytes[:n])
        for vocab in candidate_vocabs(vocab_size):
            probs = torch.softmax(logits[:, :vocab], -1)
            top, pick = probs.max(-1)
            agree = pick == targets
            cost = (own + draft_bytes(vocab, hidden)) / step_bytes
            for tau in CONFIDENCES:
                drafted = top >= tau
                coverage = float(drafted.float().mean())
                acceptance = float(agree[drafted].float().mean()) if bool(drafted.any()) else 0.0
                measured.append((n, vocab, tau, acceptance, coverage, cost))
                key = (net_saving(acceptance, coverage, cost), n, vocab, tau, acceptance, coverage, cost)
                if best is None or key > best[:7]:
                    best = (*key, int(targets.numel()))
    assert best is not None
    _, n, vocab, tau, acceptance, coverage, cost, positions = best
    plan = SelfDraftPlan(
        n, vocab, tau, acceptance, coverage, cost, positions, middle if n == HIDDEN else 0, tuple(measured)
    )
    chosen = data[n]
    a, b = chosen.fit.solve() if few else (chosen.fit + chosen.held).solve()
    bias = None if bias_rows is None else bias_rows[:vocab]
    if n == HIDDEN:
        return FittedDraft(
            plan, fitted_head(w_head[:vocab], bias, loaded.policy), fitted_head(a, b, loaded.policy)
        )
    folded = w_head[:vocab] @ b
    return FittedDraft(
        plan,
        fitted_head(w_head[:vocab] @ a, folded if bias is None else folded + bias, loaded.policy),
    )


def _embedded(embed: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The target's input embedding of `tokens`, float32 [n, hidden] (the hidden-state draft's
    second input; its module as the forward calls it)."""
    with torch.inference_mode():
        out: torch.Tensor = embed(tokens)
    return out.float()


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


def load_plan(loaded: LoadedModel) -> FittedDraft | None:
    """The cached plan and its head (and map) for `loaded`, or None."""
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

    def linear(prefix: str) -> KernelLinear:
        return _draft_linear(_stored_storage(tensors, prefix), tensors[f"{prefix}bias"], loaded.policy)

    has_map = any(key.startswith("map_") for key in tensors)
    return FittedDraft(SelfDraftPlan(**fields), linear(""), linear("map_") if has_map else None)


def _stored_storage(tensors: dict[str, torch.Tensor], prefix: str) -> WeightStorage:
    """A cached draft's rows as save_plan kept them: Q8_0 blocks (on kvk; as int8 rows where this
    build has no kvk) or int8 rows."""
    if f"{prefix}codes" in tensors:
        return Int8RowWeight(tensors[f"{prefix}codes"], tensors[f"{prefix}scales"])
    blocks = tensors[f"{prefix}{Q8_0.name}"].numpy()
    kvk = native.kernels()
    if kvk is not None:
        cols = blocks.shape[1] // GGML_QUANT_SIZES[Q8_0][1] * GGML_QUANT_SIZES[Q8_0][0]
        return GGUFWeight(Q8_0, blocks, cols, lib=kvk)
    codes, scales = quantize_int8_per_row(torch.from_numpy(quants.dequantize(blocks, Q8_0)))
    return Int8RowWeight(codes, scales)


def save_plan(loaded: LoadedModel, fitted: FittedDraft) -> None:
    path = _plan_file(loaded)
    tensors: dict[str, torch.Tensor | None] = {}
    for prefix, module in (("", fitted.head), ("map_", fitted.map)):
        if module is None:
            continue
        storage = module.storage
        if isinstance(storage, GGUFWeight):
            tensors[f"{prefix}{Q8_0.name}"] = torch.from_numpy(storage.parts[0])
        else:
            assert isinstance(storage, Int8RowWeight)
            tensors[f"{prefix}codes"], tensors[f"{prefix}scales"] = storage.tensors()[:2]
        tensors[f"{prefix}bias"] = module.bias
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, path.with_suffix(".pt"))
        path.write_text(json.dumps({"version": PLAN_VERSION, "plan": asdict(fitted.plan)}))
    except OSError:
        pass  # an unwritable cache only costs a new calibration next time


def own_forward_runs(loaded: LoadedModel) -> bool:
    return unsupported_reason(loaded.model, loaded.attention or None) is None
