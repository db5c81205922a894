"""kvscope's own forward for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2...).

transformers' modeling code is exact for every family, and the engine runs it for every family
(engine/core/runner.py) through the paged attention. For the Llama family, which the packaged
model belongs to, this module runs the same arithmetic with a fraction of the per-op overhead: on
a 135M-parameter model a decode step is ~120 small ops per layer in the generic code and ~25
here, which at 30 layers is several milliseconds a token. What it does per step:
  - RoPE cos/sin computed once (the model's own rotary module, so every rope scaling type holds),
  - per layer: RMSNorm, one fused q/k/v matmul, (Qwen3: q/k RMSNorm), RoPE, K/V written to the
    pool, paged attention for all sequences, o_proj, RMSNorm, one fused gate/up matmul, SiLU x up,
    down_proj; residuals,
  - the final norm and the LM head on the rows that need logits only.
It borrows the model's modules (weights are not copied), so the model object keeps working as a
transformers model (generate() as the reference, quality runs, the self-draft's first layers).
Parity with transformers is tested for each family it accepts; `unsupported_reason` refuses the
rest, which then run through transformers' code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from engine.kernels.linear import FusedProjection
from engine.model.kv_storage import PagedKVStorage
from engine.model.layer_attention import LayerAttention
from engine.model.paged_attention import PagedBatch, attend

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class _RMSNorm(Protocol):
    """What the forward reads of a family's RMSNorm (unsupported_reason checks both are there)."""

    weight: torch.Tensor
    variance_epsilon: float


@dataclass(slots=True)
class _Layer:
    input_norm: _RMSNorm
    qkv: FusedProjection
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o_proj: nn.Module
    post_norm: _RMSNorm
    gate_up: FusedProjection
    down_proj: nn.Module
    how: LayerAttention


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why this forward cannot run `model` exactly (it then runs through transformers), or None."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not in kvscope's Llama-family forward"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "tensor-parallel pretraining slices (pretraining_tp > 1)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb"):
        return "no rotary embedding module"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(getattr(attn, "qkv_proj", None), FusedProjection):
            return "q/k/v projections not fused (mixed weight formats)"
        if not isinstance(getattr(mlp, "gate_up_proj", None), FusedProjection):
            return "gate/up projections not fused (mixed weight formats)"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon") or not hasattr(norm, "weight"):
                return f"norm {type(norm).__name__} is not an RMSNorm"
    return None


class LlamaForward:
    def __init__(self, model: PreTrainedModel, windows: tuple[int | None, ...]):
        """`windows[i]`: layer i's sliding window as the load-time probe read it from the
        family's own attention (engine/model/layer_attention.py), None for full attention."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        inner = model.model
        config = model.config
        self.model = model
        self.embed: nn.Module = inner.embed_tokens
        self.rotary: nn.Module = inner.rotary_emb
        self.norm: _RMSNorm = inner.norm
        self.head: nn.Module = model.lm_head
        self.head_dim: int = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.layers: list[_Layer] = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    layer.input_layernorm,
                    attn.qkv_proj,
                    getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None),
                    attn.o_proj,
                    layer.post_attention_layernorm,
                    mlp.gate_up_proj,
                    mlp.down_proj,
                    LayerAttention(scaling=attn.scaling, window=windows[i]),
                )
            )

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: PagedBatch,
        logit_rows: torch.Tensor,  # [R] rows whose logits are needed
    ) -> torch.Tensor:
        storage: PagedKVStorage = batch.storage
        d = self.head_dim
        x: torch.Tensor = _call(self.embed, input_ids)  # [T, hidden]
        cos, sin = self.rotary(x[None], positions[None])  # [1, T, d]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # broadcast over heads
        # rotate_half(x) * sin == roll(x, d/2) * (sin with its first half negated), exactly: one
        # roll per layer instead of a negation and a concatenation
        half = d // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        slots = batch.slot_rows()  # where each layer writes the new tokens' K/V
        tokens = x.shape[0]
        for index, layer in enumerate(self.layers):
            h = _rms_norm(layer.input_norm, x)
            qkv = _call(layer.qkv.linear, h)  # [T, q | k | v], a tensor of our own: RoPE applies in place
            q_width, k_width, _ = layer.qkv.sizes
            qk = qkv[:, : q_width + k_width].view(tokens, -1, d)  # q's heads, then k's
            if layer.q_norm is not None:
                assert layer.k_norm is not None, "q and k norms come together (Qwen3)"
                heads = q_width // d
                qk[:, :heads] = layer.q_norm(qk[:, :heads])
                qk[:, heads:] = layer.k_norm(qk[:, heads:])
            rotated = qk.roll(half, -1)
            qk.mul_(cos).addcmul_(rotated, sin)
            storage.write_kv(index, slots, qkv[:, q_width:].view(tokens, 2, -1, d))
            o = attend(storage, index, qkv[:, :q_width].view(tokens, -1, d), batch, layer.how)
            x = x + _call(layer.o_proj, o.reshape(o.shape[0], -1))
            h = _rms_norm(layer.post_norm, x)
            gate, up = _call(layer.gate_up.linear, h).split_with_sizes(list(layer.gate_up.sizes), dim=-1)
            x = x + _call(layer.down_proj, F.silu(gate) * up)
        if logit_rows.numel() == 0:  # a prefill chunk that does not finish its prompt samples nothing
            width = cast(int, self.head.out_features)  # a linear head's vocabulary size
            return x.new_zeros((0, width))
        x = _rms_norm(self.norm, x.index_select(0, logit_rows))
        logits: torch.Tensor = _call(self.head, x)
        return logits


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) without nn.Module's call machinery when nothing hooks the module: that machinery
    costs ~4 µs a call, and a decode token makes 120+ of them."""
    if module._forward_hooks or module._forward_pre_hooks or _global_hooks():
        out: torch.Tensor = module(x)
        return out
    result: torch.Tensor = module.forward(x)
    return result


def _global_hooks() -> bool:
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


def _rms_norm(norm: _RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm (float32 inside, weight applied in the input dtype)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)
