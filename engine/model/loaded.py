"""A model ready to serve: the module, its tokenizer and what the app shows about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.events import ModelInfo
from engine.kernels.linear import KernelLinear, fuse_projections, repack_for_kernels, repacked_notes
from engine.kernels.policy import KernelPolicy
from engine.model.layer_attention import AttentionSpec, probe_attention
from engine.model.llama_forward import forward_note
from engine.quant.base import model_param_count, model_weight_bytes
from engine.quant.schemes import NONE, NativeGguf, quantization_of
from engine.shapes import ModelShapes, auto_kv_dtype
from engine.text.chat_template import chat_note

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


# Set on a served model: its kernel table, so a model wrapped twice is fused once.
POLICY_ATTRIBUTE = "kvscope_policy"


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel  # a transformers *ForCausalLM in eval mode
    tokenizer: PreTrainedTokenizerBase  # with a chat template
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype
    # the kernel table shared by the model's linear layers (engine.kernels.policy)
    policy: KernelPolicy | None = None
    # Per layer: sliding window, soft cap, sinks, as transformers calls the attention (probed at load)
    attention: tuple[AttentionSpec, ...] = ()

    def kv_dtype_for(self, requested: str) -> str:
        """The pool format of a config's kv_dtype: "int8" as asked; "auto" as this model's pools
        store it (info.kv_dtype: "float16" for a GGUF at its own bits, else "auto", its dtype)."""
        stored = self.info.kv_dtype
        return stored if requested == "auto" and stored and stored != self.info.dtype else requested

    @staticmethod
    def from_model(
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str,
        source: str,
        load_seconds: float = 0.0,
        scheme: str | None = None,
    ) -> LoadedModel:
        """Wrap a loaded transformers model for serving: its linear layers become kernel-choosing
        layers with q/k/v and gate/up fused (once; the model stays a working transformers model)."""
        model.eval()
        policy = getattr(model, POLICY_ATTRIBUTE, None)
        if policy is None:
            policy = KernelPolicy()
            fuse_projections(model, policy)
            # the table first: its probe layers are freed before the panels take their memory
            policy.prepare([s for m in model.modules() if isinstance(m, KernelLinear) for s in m.storages()])
            repack_for_kernels(model)
            setattr(model, POLICY_ATTRIBUTE, policy)
        param = next(model.parameters())
        dtype_name = str(param.dtype).removeprefix("torch.")
        shapes = ModelShapes.from_config(model.config)
        # parameters, buffers (packed codes and scales) and bitsandbytes' quantization state
        weight_bytes = model_weight_bytes(model)
        record = quantization_of(model)
        quantization = scheme or (record.scheme if record else NONE)
        kv_dtype = auto_kv_dtype(dtype_name, native_bits=quantization == NativeGguf.name)
        attention = probe_attention(model, shapes)
        info = ModelInfo(
            name=name,
            source=source,
            architecture=shapes.architecture,
            dtype=dtype_name,
            device=str(param.device),
            num_layers=shapes.num_layers,
            num_heads=shapes.num_heads,
            num_kv_heads=shapes.num_kv_heads,
            head_dim=shapes.head_dim,
            hidden_size=shapes.hidden_size,
            vocab_size=shapes.vocab_size,
            max_position_embeddings=shapes.max_position_embeddings,
            params=model_param_count(model),
            weight_bytes=weight_bytes,
            kv_bytes_per_token=shapes.kv_bytes_per_token(dtype_name, kv_dtype),
            load_seconds=load_seconds,
            quantization=quantization,
            weight_bytes_before=record.bytes_before if record else weight_bytes,
            shapes=shapes,
            weight_bytes_per_param=weight_bytes / max(1, shapes.params),
            chat_note=chat_note(tokenizer),
            kv_dtype=kv_dtype,
            notes=_notes(model, policy, attention),
        )
        return LoadedModel(model, tokenizer, info, param.device, param.dtype, policy, attention)


def _notes(
    model: PreTrainedModel, policy: KernelPolicy, attention: tuple[AttentionSpec, ...]
) -> tuple[str, ...]:
    """How the model runs, in the words the app and the CLI show."""

    forward = forward_note(model, attention)
    threads = f"{torch.get_num_threads()} engine threads (torch intra-op)"
    kernels = [f"kernels {line}" for line in policy.describe()]
    return (forward, threads, *kernels, *repacked_notes(model), BATCH_TRUTH_NOTE)


# What a greedy reply depends on (README, "Batch truth"; tests/engine/test_batch_truth.py,
# tests/e2e/test_batch_truth_real_model.py and tests/e2e/test_speculative_exact.py).
BATCH_TRUTH_NOTE = (
    "batch truth: a greedy reply is the same alone, batched, chunked, prefix-cached, preempted and "
    "with speculative decoding (every kernel computes each row alone; a prompt's chunks end at fixed "
    "positions; a speculative round's rows attend as their decodes; a cached block serves only prompts "
    "whose kernels computed it alike); it may differ on another machine (its kernel table), after a "
    "kernel table timed on a busy machine (it serves only its own run) and between native bits and float32"
)
