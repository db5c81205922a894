"""A model's logits over given tokens in one forward, outside the step loop: every position of a
text (teacher forcing: each position sees the true prefix; the quality comparisons) or the next
token after a context (what-if). With an int8 KV cache the forward runs through the paged
attention with an int8 pool, so the attention reads the same quantized K/V the engine would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.limits import blocks_for_tokens
from engine.model.kv_storage import PagedKVStorage, SeqSlice
from engine.model.layer_attention import probe_attention
from engine.model.paged_attention import PagedBatch, PagedCache, paged_attention
from engine.shapes import ModelShapes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KV_BLOCK_SIZE = 16


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
    shapes = ModelShapes.from_config(model.config)
    n = ids.shape[1]
    num_blocks = blocks_for_tokens(n, KV_BLOCK_SIZE)
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


@torch.inference_mode()
def context_logits(model: PreTrainedModel, token_ids: Sequence[int], kv_dtype: str = "auto") -> torch.Tensor:
    """float32 logits [vocab] of the token that follows `token_ids`, from one forward."""
    if kv_dtype != "auto":
        return teacher_forced_logits(model, list(token_ids), kv_dtype)[-1]
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    logits: torch.Tensor = model(input_ids=ids, logits_to_keep=1).logits
    return logits[0, -1].float()
