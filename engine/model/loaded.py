"""A model ready to serve: the module, its tokenizer and what the app shows about it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.events import ModelInfo
from engine.model.chat_template import chat_note
from engine.model.layer_attention import LayerAttention, probe_attention
from engine.model.shapes import ModelShapes
from engine.quant.base import model_weight_bytes
from engine.quant.schemes import NONE, quantization_of


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object  # a transformers tokenizer with a chat template
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype
    # Per layer: sliding window, soft cap, sinks, as transformers calls the attention (probed at load)
    attention: tuple[LayerAttention, ...] = ()

    @staticmethod
    def from_model(model, tokenizer, *, name: str, source: str, load_seconds: float = 0.0) -> LoadedModel:
        model.eval()
        param = next(model.parameters())
        dtype_name = str(param.dtype).removeprefix("torch.")
        shapes = ModelShapes.from_config(model.config)
        # parameters, buffers (packed codes and scales) and bitsandbytes' quantization state
        weight_bytes = model_weight_bytes(model)
        record = quantization_of(model)
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
            params=sum(p.numel() for p in model.parameters()),
            weight_bytes=weight_bytes,
            kv_bytes_per_token=shapes.kv_bytes_per_token(dtype_name),
            load_seconds=load_seconds,
            quantization=record.scheme if record else NONE,
            weight_bytes_before=record.bytes_before if record else weight_bytes,
            shapes=shapes,
            weight_bytes_per_param=weight_bytes / max(1, shapes.params),
            chat_note=chat_note(tokenizer),
        )
        return LoadedModel(model, tokenizer, info, param.device, param.dtype, probe_attention(model, shapes))
