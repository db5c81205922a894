"""Tiny GGUF files for tests, written with gguf-py: a random 2-layer Llama whose linear weights
are stored in chosen GGUF types (every type kvk keeps, F32, and types no kernel keeps), so the
native loader, the block decoders and the kernels can be checked against gguf's own
dequantization offline. Types gguf-py cannot quantize (the K-quants, IQ4_XS) get random valid
blocks; they need rows of 256 weights (`hidden=256`)."""

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
    hidden: int = HIDDEN,
    output_type: Q | None = None,
) -> Path:
    """A Llama GGUF at `path`. `types` maps a tensor role ("attn_q", "attn_k", "attn_v",
    "attn_output", "ffn_gate", "ffn_up", "ffn_down") to its type (default Q4_1); the token
    embedding is `embedding_type`, tied to the head unless `output_type` gives the file an output
    tensor. `truncate_to` cuts the file (a broken download)."""
    types = types or {}
    ffn, head_dim = 2 * hidden, hidden // HEADS
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)

    def add(name: str, shape: tuple[int, ...], qtype: Q, scale: float = 0.05) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, data)
            return
        try:
            blocks = quantize(data, qtype)
        except NotImplementedError:  # gguf-py dequantizes these but cannot quantize them
            from engine.kernels.gguf_weight import random_blocks

            blocks = random_blocks(qtype, shape[0], shape[1], seed=int(rng.integers(1 << 30)))
        writer.add_tensor(name, blocks, raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, hidden), embedding_type, 0.5)
    if output_type is not None:
        add("output.weight", (VOCAB, hidden), output_type, 0.5)
    add("output_norm.weight", (hidden,), Q.F32, 0.1)
    shapes = {
        "attn_q": (HEADS * head_dim, hidden),
        "attn_k": (KV_HEADS * head_dim, hidden),
        "attn_v": (KV_HEADS * head_dim, hidden),
        "attn_output": (hidden, HEADS * head_dim),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(
                f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
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


# K-quants work in super-blocks of 256 inputs: their tiny Llama is this wide.
KQUANT_HIDDEN = 256

# A Q4_K_M-like mix (llama.cpp's: most layers Q4_K, attn_v and ffn_down Q6_K, a Q6_K embedding).
Q4_K_M_TYPES = {
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q4_K,
    "ffn_down": Q.Q6_K,
}


def write_kquant_llama(path: Path, types: dict[str, Q] | None = None, **kwargs) -> Path:
    """The tiny Llama at K-quant width, Q4_K_M's mix unless `types` says otherwise."""
    kwargs.setdefault("embedding_type", Q.Q6_K)
    return write_tiny_llama(path, types or Q4_K_M_TYPES, hidden=KQUANT_HIDDEN, **kwargs)
