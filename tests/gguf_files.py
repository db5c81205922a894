"""Tiny GGUF files for tests, written with gguf-py: a random 2-layer Llama whose linear weights
are stored in chosen GGUF types (Q4_0, Q4_1, Q8_0, F32, and the K-quants Q2_K..Q6_K as random
blocks), so the native loader, the block decoders, the kernels and the fit estimates can be
checked against gguf's own dequantization offline."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 256
HEAD_DIM = HIDDEN // HEADS
# K-quants work in super-blocks of 256 inputs: their tiny Llama is this wide.
KQUANT_HIDDEN, KQUANT_FFN = 256, 512

# gguf-py cannot quantize to K-quants, but any bytes are valid codes: random blocks whose float16
# super-block scales (d, and dmin where the type has one: their byte offsets in a block) are set
# so that the weights come out near `scale` (the divisor: the type's largest code product).
_KQUANT_SCALES = {
    Q.Q2_K: ((80, 82), 45),
    Q.Q3_K: ((108,), 128),
    Q.Q4_K: ((0, 2), 945),
    Q.Q5_K: ((0, 2), 1953),
    Q.Q6_K: ((208,), 4096),
}
KQUANT_TYPES = tuple(_KQUANT_SCALES)


def random_kquant_blocks(
    rng: np.random.Generator, rows: int, cols: int, qtype: Q, scale: float
) -> np.ndarray:
    """[rows, bytes] of random `qtype` blocks with sane super-block scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    offsets, largest = _KQUANT_SCALES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(scale / largest).tobytes(), dtype=np.uint8)
    for offset in offsets:
        raw[..., offset : offset + 2] = d
    return raw.reshape(rows, -1)


def write_tiny_llama(
    path: Path,
    types: dict[str, Q] | None = None,
    *,
    embedding_type: Q = Q.Q8_0,
    seed: int = 0,
    truncate_to: int | None = None,
    output_type: Q | None = None,
    hidden: int = HIDDEN,
    ffn: int = FFN,
    vocab: int = VOCAB,
) -> Path:
    """A Llama GGUF at `path`. `types` maps a tensor role ("attn_q", "attn_k", "attn_v",
    "attn_output", "ffn_gate", "ffn_up", "ffn_down") to its type (default Q4_1); the token
    embedding is `embedding_type`, tied to the head unless `output_type` gives the head a tensor
    of its own. K-quant types need `hidden` and `ffn` multiples of 256 (KQUANT_HIDDEN, KQUANT_FFN).
    `truncate_to` cuts the file (a broken download)."""
    types = types or {}
    rng = np.random.default_rng(seed)
    head_dim = hidden // HEADS
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
    writer.add_vocab_size(vocab)

    def add(name: str, shape: tuple[int, ...], qtype: Q, scale: float = 0.05) -> None:
        if qtype in _KQUANT_SCALES:
            writer.add_tensor(name, random_kquant_blocks(rng, *shape, qtype, scale), raw_dtype=qtype)
            return
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, data)
            return
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), embedding_type, 0.5)
    if output_type is not None:
        add("output.weight", (vocab, hidden), output_type, 0.2)
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
    return write_tiny_llama(path, types or Q4_K_M_TYPES, hidden=KQUANT_HIDDEN, ffn=KQUANT_FFN, **kwargs)
