"""kvscope's own forward for the Llama-shaped families (engine/model/forward_families.py: Llama,
Mistral, Ministral, Qwen2/2.5, Qwen3, Phi-3, Gemma 1/2/3, Granite, OLMo 2/3, SmolLM3, Seed-OSS).

transformers' modeling code is exact for every family, and the engine runs it for every family
(engine/core/runner.py) through the paged attention. For the Llama-shaped families this module
runs the same arithmetic with less per-op overhead: on the packaged 135M model a decode step
dispatches 66 aten ops per layer here (kernels and attention included) against 105 through
transformers' code on the same engine, each a few microseconds on a small CPU, at 30 layers;
and none of nn.Module's call machinery per layer. What it does per step:
  - RoPE cos/sin computed once per kind of layer (the model's own rotary module, so every rope
    scaling type holds; Gemma 3's local and global bases; none for SmolLM3's NoPE layers),
  - per layer: the family's norms, q/k/v (one matmul where the loader fused them or the family
    did, Phi-3; three where their weight formats differ), q/k norms where the family has them,
    RoPE in place, K/V written to the pool, paged attention for all sequences (with the layer's
    window and soft cap as probed at load), o_proj, gate/up (one matmul or two), act(gate) * up,
    down_proj, the residual adds (Granite's multiplier),
  - the final norm and the LM head on the rows that need logits only (Granite's logit scaling,
    Gemma's final soft cap).
Everything a family does not do costs nothing: the per-family description is read once, here at
construction, into per-layer slots that are None where a family has nothing.

It borrows the model's modules (weights are not copied, except Gemma's 1 + norm weight, a vector
per norm), so the model object keeps working as a transformers model (generate() as the
reference, quality runs, the self-draft's first layers). Linear layers, the embedding and the head
are called as modules while anything hooks them; norms and activations are computed from their
weights and functions. Parity with transformers is tested per family
(tests/engine/test_own_forward.py); `unsupported_reason` refuses the rest, which then run
through transformers' code.

Observing the forward: `__call__(..., observer=fn)` calls `fn(stage, hidden)` with the residual
stream of the rows that get logits (`logit_rows`, [R, hidden] in the model's dtype): stage 0 is
the embedding (what enters layer 0), stage i + 1 what layer i leaves. `final_logits(hidden)` turns
such a residual into logits the way the last layer's is (final norm, head, the family's scaling and
soft cap), which is what a logit lens needs. `edit=fn` replaces the residual stream of every row
after each stage by `fn(stage, x)` (before the observer sees it): steering adds a direction there.
With neither (the engine's hot path) nothing of it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from engine.kernels import native
from engine.kernels.gguf_weight import GGUFWeight
from engine.kernels.linear import FusedProjection
from engine.model.forward_families import FAMILIES, NormKind
from engine.model.fused_layers import FusedLayers
from engine.model.kv_storage import PagedKVStorage
from engine.model.layer_attention import AttentionSpec, LayerAttention
from engine.model.paged_attention import PagedBatch, attend

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Tensor = torch.Tensor
Norm = Callable[[Tensor], Tensor]
# observer(stage, hidden): the residual stream of the logit rows after stage (0: the embedding)
ResidualObserver = Callable[[int, Tensor], None]
# edit(stage, x): the residual stream of every row after stage, changed (steering adds a direction)
ResidualEdit = Callable[[int, Tensor], Tensor]

EXECUTOR = "kvscope's own forward"


class Unsupported(ValueError):
    """Why the forward cannot run a model exactly; str() says it in one line."""


@dataclass(slots=True)
class _Layer:
    # the family's norms by place (None: it has none there)
    before_attention: Norm | None
    after_attention: Norm | None
    before_mlp: Norm | None
    after_mlp: Norm | None
    # q|k|v in one matmul (qkv, qkv_sizes), or three (q_proj, k_proj, v_proj)
    qkv: nn.Module | None
    qkv_sizes: list[int]
    q_proj: nn.Module | None
    k_proj: nn.Module | None
    v_proj: nn.Module | None
    q_norm: Norm | None
    k_norm: Norm | None
    qk_norm_per_head: bool  # Qwen3, Gemma 3: over each head; OLMo 2: over the whole projection
    rope: int | None  # which of the step's RoPE tables; None: no RoPE (SmolLM3's NoPE layers)
    o_proj: nn.Module
    # gate|up in one matmul (gate_up, gate_up_sizes), or two
    gate_up: nn.Module | None
    gate_up_sizes: list[int]
    gate_proj: nn.Module | None
    up_proj: nn.Module | None
    down_proj: nn.Module
    act: Callable[[Tensor], Tensor]
    how: LayerAttention
    # Llama's float32 RMSNorms before attention and MLP as (weight, weight, eps), where the layer
    # has no other norm and no residual multiplier: on kvk, each residual add and the norm after
    # it run as one C call (layer_ops.c). None: the norms above, in torch.
    plain_norms: tuple[Tensor, Tensor, float] | None = None


@dataclass(slots=True)
class _Rope:
    """One kind of layer's RoPE for this step's positions, ready to apply in place."""

    cos: Tensor  # [T, 1, width]
    sin: Tensor  # [T, 1, width], its first half negated (see _rotate)
    half: int
    width: int  # rotated dims of each head (Phi-3's partial rotary: fewer than head_dim)

    def rows(self) -> tuple[Tensor, Tensor]:
        """cos and sin as [T, width] (kvk's RoPE reads them so)."""
        t = self.cos.shape[0]
        return self.cos.reshape(t, self.width), self.sin.reshape(t, self.width)


# RoPE types whose tables depend on the position alone (not on the sequence's length, as dynamic
# NTK and LongRoPE's do): their rows can be computed once per position and looked up.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class _RopeRows:
    """A static RoPE's rows for positions [0, n), computed by the model's own rotary module as one
    batch and looked up per step (transformers' rotary forward took ~0.17 ms a decode step). The
    same bits as computing a step's positions alone: every element is one multiply, then cos and
    sin elementwise, vectorised alike for any count of whole heads (tests/engine/test_own_forward.py
    compares them)."""

    def __init__(self, rotary: Callable[..., tuple[Tensor, Tensor]]):
        self.rotary = rotary
        self.table: _Rope | None = None

    def __call__(self, x: Tensor, positions: Tensor) -> _Rope:
        table = self.table
        top = int(positions.max()) + 1 if positions.numel() else 0
        if table is None or top > table.cos.shape[0] or table.cos.dtype != x.dtype:
            size = 256
            while size < top:
                size *= 2
            every = torch.arange(size, device=positions.device, dtype=positions.dtype)
            table = self.table = _rope_table(self.rotary, x[:1], every)
        return _Rope(
            table.cos.index_select(0, positions),
            table.sin.index_select(0, positions),
            table.half,
            table.width,
        )


def static_rope(rotary: object, width_multiple: int = 16) -> bool:
    """Whether `rotary`'s rows can be looked up by position: a static RoPE type, one for every
    layer, over whole vectors of dims (no elementwise tail that could round otherwise)."""
    kind = getattr(rotary, "rope_type", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    return (
        isinstance(kind, str)
        and kind in STATIC_ROPE_TYPES
        and isinstance(inv_freq, torch.Tensor)
        and (2 * inv_freq.numel()) % width_multiple == 0
    )


def unsupported_reason(
    model: PreTrainedModel, attention: Sequence[AttentionSpec] | None = None
) -> str | None:
    """Why this forward cannot run `model` exactly (it then runs through transformers), or None.
    `attention`: the load-time probe's per-layer specs, when there is one."""
    try:
        _Plan(model, attention)
    except Unsupported as exc:
        return str(exc)
    return None


def forward_note(model: PreTrainedModel, attention: Sequence[AttentionSpec] | None = None) -> str:
    """Which forward runs `model` and why, in the words ModelInfo.notes shows."""
    try:
        plan = _Plan(model, attention)
    except Unsupported as exc:
        return f"forward: transformers' ({exc})"
    return f"forward: {EXECUTOR} ({plan.describe()})"


class _Plan:
    """What the forward runs per layer, read off the model and its family's description once."""

    def __init__(self, model: PreTrainedModel, attention: Sequence[AttentionSpec] | None):
        config = model.config
        family = FAMILIES.get(config.model_type)
        if family is None:
            raise Unsupported(
                f"model type {config.model_type!r} is not one of kvscope's own forward's families"
            )
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            raise Unsupported("tensor-parallel pretraining slices (pretraining_tp > 1)")
        if getattr(config, "use_bidirectional_attention", False):
            raise Unsupported("bidirectional attention")
        inner: Any = getattr(model, "model", None)  # transformers' decoder: its attributes are dynamic
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not isinstance(getattr(inner, name, None), nn.Module):
                raise Unsupported(f"no {name} module where the family keeps it")
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Module) or not isinstance(getattr(head, "out_features", None), int):
            raise Unsupported("its LM head is not a linear layer")
        self.family = family
        self.embed: nn.Module = inner.embed_tokens
        self.rotary: nn.Module = inner.rotary_emb
        self.head: nn.Module = head
        self.dtype = next(model.parameters()).dtype
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.final_norm = self.norm(inner.norm, "final norm")
        # (weight, eps) of a float32 Llama final norm: on kvk, layer_ops.c computes it (one C call;
        # torch's rms_norm took ~0.1 ms for one row)
        final_weight = getattr(inner.norm, "weight", None)
        final_eps = getattr(inner.norm, "variance_epsilon", getattr(inner.norm, "eps", None))
        self.final_plain: tuple[Tensor, float] | None = (
            (final_weight.detach().contiguous(), final_eps)
            if family.norm == "llama"
            and self.dtype == torch.float32
            and isinstance(final_weight, torch.Tensor)
            and final_weight.dtype == torch.float32
            and isinstance(final_eps, float)
            else None
        )
        self.embedding_multiplier = _scalar(config, family.embedding_multiplier)
        self.residual_multiplier = _scalar(config, family.residual_multiplier)
        self.logits_divisor = _scalar(config, family.logits_divisor)
        self.final_softcap = _scalar(config, family.final_softcap, neutral=None)
        layers = list(inner.layers)[: config.num_hidden_layers]
        if attention is not None and len(attention) != len(layers):
            raise Unsupported(f"the attention probe saw {len(attention)} layers, the model has {len(layers)}")
        # RoPE kinds: None (one rotary for every layer) or Gemma 3's layer types
        self.rope_kinds: list[str | None] = []
        self.layers = [self.layer(i, layer, config, attention) for i, layer in enumerate(layers)]

    def layer(self, i: int, layer: Any, config: Any, attention: Sequence[AttentionSpec] | None) -> _Layer:
        family = self.family
        if type(layer).__name__ != family.decoder_layer:
            raise Unsupported(
                f"its decoder layers are {type(layer).__name__}, not the {family.decoder_layer} its parity test covers"
            )
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        d = self.head_dim

        def norm_at(place: str | None) -> Norm | None:
            return None if place is None else self.norm(getattr(layer, place, None), place)

        qkv_widths = [self.heads * d, self.kv_heads * d, self.kv_heads * d]
        qkv, qkv_sizes, qkv_parts = self.projections(
            attn, "qkv_proj", family.qkv_module, ("q_proj", "k_proj", "v_proj"), qkv_widths
        )
        q_proj, k_proj, v_proj = qkv_parts or (None, None, None)
        gate_up, gate_up_sizes, gate_up_parts = self.projections(
            mlp, "gate_up_proj", family.gate_up_module, ("gate_proj", "up_proj"), None
        )
        gate_proj, up_proj = gate_up_parts or (None, None)
        q_norm = k_norm = None
        per_head = True
        if family.qk_norm:
            q_norm, k_norm = (
                self.norm(getattr(attn, "q_norm", None), "q_norm"),
                self.norm(getattr(attn, "k_norm", None), "k_norm"),
            )
            width = int(attn.q_norm.weight.numel())
            if width not in (d, self.heads * d):
                raise Unsupported(f"a q norm over {width} dims, neither a head nor the projection")
            per_head = width == d
        rope: int | None = None
        if not (family.rope_switch is not None and not getattr(attn, family.rope_switch)):
            kind = config.layer_types[i] if family.rope_by_layer_type else None
            if kind not in self.rope_kinds:
                self.rope_kinds.append(kind)
            rope = self.rope_kinds.index(kind)
        spec = attention[i] if attention is not None else AttentionSpec()
        if spec.sinks:
            raise Unsupported(f"layer {i} attends with sinks, which this forward does not pass to attention")
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        if not isinstance(act, nn.Module):
            raise Unsupported("its MLP has no activation module")
        down, o_proj = getattr(mlp, "down_proj", None), getattr(attn, "o_proj", None)
        if not isinstance(down, nn.Module) or not isinstance(o_proj, nn.Module):
            raise Unsupported("no down_proj or o_proj where the family keeps them")
        scaling = getattr(attn, "scaling", None)
        if not isinstance(scaling, float):
            raise Unsupported("its attention has no scaling of its own")
        return _Layer(
            norm_at(family.before_attention),
            norm_at(family.after_attention),
            norm_at(family.before_mlp),
            norm_at(family.after_mlp),
            qkv,
            qkv_sizes,
            q_proj,
            k_proj,
            v_proj,
            q_norm,
            k_norm,
            per_head,
            rope,
            o_proj,
            gate_up,
            gate_up_sizes,
            gate_proj,
            up_proj,
            down,
            _activation(act),
            LayerAttention(scaling=scaling, window=spec.window, softcap=spec.softcap),
            self.plain_norms(layer, family),
        )

    def plain_norms(self, layer: Any, family: Any) -> tuple[Tensor, Tensor, float] | None:
        """(before-attention weight, before-MLP weight, eps) where the layer's only norms are Llama's
        float32 RMSNorms at those two places with one eps, else None."""
        if (
            self.dtype != torch.float32
            or family.norm != "llama"
            or family.after_attention is not None
            or family.after_mlp is not None
            or family.before_attention is None
            or family.before_mlp is None
            or self.residual_multiplier is not None
        ):
            return None
        norms = [getattr(layer, family.before_attention, None), getattr(layer, family.before_mlp, None)]
        weights = [getattr(n, "weight", None) for n in norms]
        eps = {getattr(n, "variance_epsilon", getattr(n, "eps", None)) for n in norms}
        if (
            not all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in weights)
            or len(eps) != 1
        ):
            return None
        (value,) = eps
        if not isinstance(value, float):
            return None
        first, second = (cast(Tensor, w).detach().contiguous() for w in weights)
        return first, second, value

    @staticmethod
    def projections(
        owner: nn.Module,
        fused_name: str,
        own_name: str | None,
        names: tuple[str, ...],
        sizes: list[int] | None,
    ) -> tuple[nn.Module | None, list[int], list[nn.Module]]:
        """(one module, its output sizes, []) where the projections are one matmul (fused at
        load, or by the family's own module, whose `sizes` are given or its halves), else
        (None, [], each projection)."""
        fused = getattr(owner, fused_name, None)
        if isinstance(fused, FusedProjection):
            return fused.linear, list(fused.sizes), []
        if own_name is not None:
            module = getattr(owner, own_name, None)
            width = getattr(module, "out_features", None)
            if not isinstance(module, nn.Module) or not isinstance(width, int):
                raise Unsupported(f"no {own_name} linear layer where the family keeps it")
            sizes = sizes or [width // 2, width - width // 2]
            if sum(sizes) != width:
                raise Unsupported(f"its {own_name} has {width} outputs, not {sum(sizes)}")
            return module, sizes, []
        parts = [getattr(owner, n, None) for n in names]
        modules = [p for p in parts if isinstance(p, nn.Module)]
        if len(modules) != len(names):
            raise Unsupported(f"no {'/'.join(names)} projections where the family keeps them")
        return None, [], modules

    def norm(self, module: object, place: str) -> Norm:
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
            raise Unsupported(f"its {place} is not an RMSNorm ({type(module).__name__})")
        return _rms_norm(weight, eps, self.family.norm, self.dtype)

    def describe(self) -> str:
        """The note's parenthesis: the family, and where projections run as separate matmuls
        (with their weights' formats: mixed formats, or one without a fused storage)."""
        parts = [self.family.decoder_layer.removesuffix("DecoderLayer")]
        for name, split in (
            (
                "q/k/v",
                [(layer.q_proj, layer.k_proj, layer.v_proj) for layer in self.layers if layer.qkv is None],
            ),
            ("gate/up", [(layer.gate_proj, layer.up_proj) for layer in self.layers if layer.gate_up is None]),
        ):
            if split:
                formats = sorted({_format(module) for modules in split for module in modules})
                parts.append(
                    f"{name} as separate matmuls in {len(split)} of {len(self.layers)} layers "
                    f"({', '.join(formats)})"
                )
        return "; ".join(parts)


def _format(module: nn.Module | None) -> str:
    """A projection's weight format as the kernel table names it (its class for other layers)."""
    storage = getattr(module, "storage", None)
    kind = getattr(storage, "kind", None)
    return kind if isinstance(kind, str) and kind else type(module).__name__


class LlamaForward:
    def __init__(self, model: PreTrainedModel, attention: Sequence[AttentionSpec] | None = None):
        """`attention[i]`: layer i's attention as the load-time probe saw transformers call it
        (engine/model/layer_attention.py): its sliding window and logit soft cap."""
        plan = _Plan(model, attention)
        self.model = model
        self.plan = plan
        self.embed = plan.embed
        self.rotary = plan.rotary
        self.head = plan.head
        self.head_dim = plan.head_dim
        self.heads = plan.heads
        self.kv_heads = plan.kv_heads
        self.layers = plan.layers
        self.final_norm = plan.final_norm
        self.embedding_multiplier = plan.embedding_multiplier
        self.residual_multiplier = plan.residual_multiplier
        self.logits_divisor = plan.logits_divisor
        self.final_softcap = plan.final_softcap
        # the final norm's output of the last forward's logit rows (what the head read): the
        # hidden-state drafter (engine/speculative/hidden_draft.py) drafts from it
        self.last_normed: Tensor | None = None
        # a layer m > 0 whose input residual (x entering layer m) the same rows keep too, in
        # last_middle: the hidden-state drafter reads it beside the final norm's output
        self.keep_middle = 0
        self.last_middle: Tensor | None = None
        self.rope_functions: list[Callable[[Tensor, Tensor], _Rope]] = (
            [_RopeRows(self.rotary)]
            if plan.rope_kinds == [None] and static_rope(self.rotary)
            else [
                functools.partial(
                    _rope_table,
                    self.rotary if kind is None else functools.partial(self.rotary, layer_type=kind),
                )
                for kind in plan.rope_kinds
            ]
        )
        self.kvk = _kvk_of(plan)
        if self.kvk is not None and plan.final_plain is not None:
            self.final_norm = functools.partial(_kvk_norm, self.kvk, *plan.final_plain)
        # every layer a C call, where the model is plain enough (engine/model/fused_layers.py)
        self.fused = (
            FusedLayers.build(self.kvk, plan.layers, plan.heads, plan.kv_heads, plan.head_dim)
            if self.kvk is not None
            else None
        )

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: Tensor,  # [T]
        positions: Tensor,  # [T]
        batch: PagedBatch,
        logit_rows: Tensor,  # [R] rows whose logits are needed
        observer: ResidualObserver | None = None,
        edit: ResidualEdit | None = None,
    ) -> Tensor:
        storage: PagedKVStorage = batch.storage
        d, heads = self.head_dim, self.heads
        x: Tensor = _call(self.embed, input_ids)  # [T, hidden]
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        ropes = [rope_rows(x, positions) for rope_rows in self.rope_functions]
        slots = batch.slot_rows()  # where each layer writes the new tokens' K/V
        tokens = x.shape[0]
        residual_multiplier = self.residual_multiplier
        if edit is not None:
            x = edit(0, x)
        if observer is not None:
            observer(0, x.index_select(0, logit_rows))
        kvk = self.kvk
        fused = self.fused
        if (
            fused is not None
            and observer is None
            and edit is None
            and not _global_hooks()
            and fused.usable(storage, batch, tokens)
        ):
            middle = (self.keep_middle, logit_rows) if self.keep_middle else None
            x, self.last_middle = fused.run(x.contiguous(), ropes, storage, batch, slots, middle)
            return self._logits(x, logit_rows)
        pending: Tensor | None = None  # the last layer's MLP output, added into x by the next norm
        for index, layer in enumerate(self.layers):
            plain = layer.plain_norms if kvk is not None else None
            if plain is not None:
                assert kvk is not None
                x, h = kvk.add_rms_norm(x, plain[0], plain[2], pending)  # x += pending; h = norm(x)
                pending = None
            else:
                if pending is not None:
                    x, pending = x + pending, None
                h = x if layer.before_attention is None else layer.before_attention(x)
            if index == self.keep_middle:  # x is the residual entering this layer
                self.last_middle = x.index_select(0, logit_rows)
            # qk [T, heads + kv_heads, d], a tensor of our own: RoPE applies in place; K and V lie
            # side by side after it (kv [T, 2, kv_heads, d]) and go to the pool in one write
            if layer.qkv is not None and layer.q_norm is None:  # one matmul's output as it is
                qkv = _call(layer.qkv, h)
                q_width, k_width, _ = layer.qkv_sizes
                qk = qkv[:, : q_width + k_width].view(tokens, -1, d)  # q's heads, then k's
                kv = qkv[:, q_width:].view(tokens, 2, -1, d)
            else:
                if layer.qkv is not None:
                    q, k, v = _call(layer.qkv, h).split_with_sizes(layer.qkv_sizes, dim=-1)
                else:  # their weight formats differ: three matmuls
                    assert layer.q_proj is not None and layer.k_proj is not None and layer.v_proj is not None
                    q, k, v = _call(layer.q_proj, h), _call(layer.k_proj, h), _call(layer.v_proj, h)
                if layer.q_norm is not None:
                    assert layer.k_norm is not None, "q and k norms come together"
                    if layer.qk_norm_per_head:
                        q, k = layer.q_norm(q.view(tokens, -1, d)), layer.k_norm(k.view(tokens, -1, d))
                    else:
                        q, k = layer.q_norm(q), layer.k_norm(k)
                # one tensor in the fused layout: one op, as a concatenation of q and k alone would be
                joined = torch.cat((q.view(tokens, -1, d), k.view(tokens, -1, d), v.view(tokens, -1, d)), 1)
                qk = joined[:, : heads + self.kv_heads]
                kv = joined[:, heads:].view(tokens, 2, -1, d)
            if layer.rope is not None:
                if kvk is not None:
                    kvk.rope_(qk, *ropes[layer.rope].rows())
                else:
                    _rotate(qk, ropes[layer.rope], d)
            storage.write_kv(index, slots, kv)
            o = attend(storage, index, qk[:, :heads], batch, layer.how)
            a = _call(layer.o_proj, o.reshape(tokens, -1))
            if plain is not None:
                assert kvk is not None
                x, h = kvk.add_rms_norm(x, plain[1], plain[2], a)  # x += a; h = norm(x)
            else:
                if layer.after_attention is not None:
                    a = layer.after_attention(a)
                x = x + a if residual_multiplier is None else x + a * residual_multiplier
                h = x if layer.before_mlp is None else layer.before_mlp(x)
            if layer.gate_up is not None and kvk is not None and layer.act is torch.nn.functional.silu:
                gated = kvk.silu_mul(_call(layer.gate_up, h))  # as the fused layer computes it
            elif layer.gate_up is not None:
                gate, up = _call(layer.gate_up, h).split_with_sizes(layer.gate_up_sizes, dim=-1)
                gated = layer.act(gate) * up
            else:
                assert layer.gate_proj is not None and layer.up_proj is not None
                gated = layer.act(_call(layer.gate_proj, h)) * _call(layer.up_proj, h)
            y = _call(layer.down_proj, gated)
            if layer.after_mlp is not None:
                y = layer.after_mlp(y)
            if plain is not None and observer is None and edit is None:
                pending = y  # the add is exact either way: the next layer's norm does it
            else:
                x = x + y if residual_multiplier is None else x + y * residual_multiplier
                if edit is not None:
                    x = edit(index + 1, x)
            if observer is not None:
                observer(index + 1, x.index_select(0, logit_rows))
        if pending is not None:
            x = x + pending
        return self._logits(x, logit_rows)

    def _logits(self, x: Tensor, logit_rows: Tensor) -> Tensor:
        if logit_rows.numel() == 0:  # a prefill chunk that does not finish its prompt samples nothing
            width = cast(int, self.head.out_features)  # a linear head's vocabulary size
            self.last_normed = x.new_zeros((0, x.shape[1]))
            return x.new_zeros((0, width))
        normed = self.final_norm(x.index_select(0, logit_rows))
        self.last_normed = normed  # what the head read, kept for a drafter that reads it
        return self.head_logits(normed)

    def final_logits(self, hidden: Tensor) -> Tensor:
        """[R, hidden] residual stream -> [R, vocab] logits: the final norm, the head, the family's
        logit scaling (Granite) and soft cap (Gemma 2/3), as transformers computes them."""
        return self.head_logits(self.final_norm(hidden))

    def head_logits(self, normed: Tensor) -> Tensor:
        """The head and what follows it, from the final norm's output."""
        logits: Tensor = _call(self.head, normed)
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _kvk_of(plan: _Plan) -> native.Kvk | None:
    """kvk's library where every projection of every layer runs on it (a GGUF file kept at its
    bits), for the layer ops it fuses (layer_ops.c); None otherwise: torch's ops, as transformers
    rounds them."""
    lib = native.kernels()
    if lib is None or plan.dtype != torch.float32:
        return None
    for layer in plan.layers:
        modules = [layer.qkv, layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
        modules += [layer.gate_up, layer.gate_proj, layer.up_proj, layer.down_proj]
        for module in modules:
            if module is None:
                continue
            storages = getattr(module, "storages", None)
            if storages is None or not all(isinstance(st, GGUFWeight) for st in storages()):
                return None
    return lib


def _kvk_norm(kvk: native.Kvk, weight: Tensor, eps: float, x: Tensor) -> Tensor:
    return kvk.add_rms_norm(x.contiguous(), weight, eps)[1]


def _rope_table(rotary: Callable[..., tuple[Tensor, Tensor]], x: Tensor, positions: Tensor) -> _Rope:
    cos, sin = rotary(x[None], positions[None])  # [1, T, width]
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # broadcast over heads
    width = cos.shape[-1]
    half = width // 2
    # rotate_half(x) * sin == roll(x, width/2) * (sin with its first half negated), exactly: one
    # roll per layer instead of a negation and a concatenation
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return _Rope(cos, sin, half, width)


def _rotate(qk: Tensor, rope: _Rope, head_dim: int) -> None:
    """RoPE on q's and k's heads in place (on their first `rope.width` dims: Phi-3's partial rotary)."""
    part = qk if rope.width == head_dim else qk[..., : rope.width]
    rotated = part.roll(rope.half, -1)
    part.mul_(rope.cos).addcmul_(rotated, rope.sin)


def _scalar(config: object, name: str | None, neutral: float | None = 1.0) -> float | None:
    """A family's multiplier from its config, None where there is none or it is neutral (x * 1.0
    is x: skipping it changes nothing)."""
    if name is None:
        return None
    value = getattr(config, name, None)
    if value is None or float(value) == neutral:
        return None
    return float(value)


def _rms_norm(weight: Tensor, eps: float, kind: NormKind, dtype: torch.dtype) -> Norm:
    """The family's RMSNorm (normalized in float32, its weight applied where the family applies it)."""
    with torch.no_grad():
        if kind == "gemma":
            weight = 1.0 + weight.detach().float()  # Gemma's norms scale by 1 + weight, in float32
        elif kind == "olmo":
            weight = weight.detach().float()  # OLMo 2 applies its weight before the cast
    width = (int(weight.numel()),)
    if dtype == torch.float32 or kind != "llama":
        fused = functools.partial(torch.rms_norm, normalized_shape=width, weight=weight, eps=eps)
        if dtype == torch.float32:
            return fused
        return lambda x: fused(x.float()).to(x.dtype)
    # Llama in half precision: normalized in float32, cast, then its weight in the model's dtype
    return lambda x: weight * torch.rms_norm(x.float(), width, None, eps).to(x.dtype)


def _activation(act: nn.Module) -> Callable[[Tensor], Tensor]:
    """The MLP's activation as a function: torch's own for the common ones, else the module's."""
    name = type(act).__name__
    if name in ("SiLUActivation", "SiLU"):
        return torch.nn.functional.silu
    inner = getattr(act, "act", None)  # transformers' GELU modules keep the function they apply
    if name in ("GELUTanh", "GELUActivation") and callable(inner):
        return cast(Callable[[Tensor], Tensor], inner)
    return cast(Callable[[Tensor], Tensor], act.forward)


def _call(module: nn.Module, x: Tensor) -> Tensor:
    """module(x) without nn.Module's call machinery when nothing hooks the module: that machinery
    costs ~4 µs a call, and a decode token makes 120+ of them."""
    if module._forward_hooks or module._forward_pre_hooks or _global_hooks():
        out: Tensor = module(x)
        return out
    result: Tensor = module.forward(x)
    return result


def _global_hooks() -> bool:
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)
