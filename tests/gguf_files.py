"""Tiny GGUF files for tests, written with gguf-py: a random 2-layer Llama whose linear weights
are stored in chosen GGUF types (Q4_0, Q4_1, Q8_0, F32...), so the native loader, the block
decoders and the kernels can be checked against gguf's own dequantization offline."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 256
HEAD_DIM = HIDDEN // HEADS


def write_tiny_llama(
    path: Path,
    types: dict[str, Q] | None = None,
    *,
    embedding_type: Q = Q.Q8_0,
    seed: int = 0,
    truncate_to: int | None = None,
) -> Path:
    """A Llama GGUF at `path`. `types` maps a tensor role ("attn_q", "attn_k", "attn_v",
    "attn_output", "ffn_gate", "ffn_up", "ffn_down") to its type (default Q4_1); the tied token
    embedding is `embedding_type`. `truncate_to` cuts the file (a broken download)."""
    types = types or {}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)

    def add(name: str, shape: tuple[int, ...], qtype: Q, scale: float = 0.05) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, data)
            return
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), embedding_type, 0.5)
    add("output_norm.weight", (HIDDEN,), Q.F32, 0.1)
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(
                f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            )
        for role, shape in shapes.items():
            add(f"blk.{layer}.{role}.weight", shape, types.get(role, Q.Q4_1), 0.2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate_to is not None:
        data = path.read_bytes()
        path.write_bytes(data[:truncate_to])
    return path
