"""FLOPs and bytes of one engine step, computed from the model's shapes and the step's sequences,
and the roof they are placed under (the utilisation figures, MFU and MBU, are engine.units').

Only matrix multiplications are counted as FLOPs (the q/k/v/o projections, the gated MLP, the
attention scores and weighted sums, the LM head): they are >99% of the arithmetic, and what the
measured matmul peak is a peak of. Norms, RoPE, SiLU and softmax are left out.

Bytes are what a step must move from memory at least once: every weight it uses, the K/V it
reads and the K/V it writes. Activations are not counted: their traffic depends on how the
kernels fuse and what stays in cache, not on the model, and for a decode step they are a tiny
share of the weights.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.events import StepCost
from engine.shapes import ModelShapes


def step_cost(
    shapes: ModelShapes,
    seq_shapes: Iterable[tuple[int, int]],
    weight_dtype_bytes: int | float,
    kv_dtype_bytes: int | float,
    logit_rows: int | None = None,
    linear_weight_bytes: int | float | None = None,
) -> StepCost:
    """FLOPs and bytes of one forward over `seq_shapes`: per scheduled sequence (query tokens this
    step, context tokens after the step), as in `StepStats.seq_shapes`.

    `logit_rows` is how many rows the LM head computes (the engine runs it only for sequences
    that sample this step); None means one per sequence. `*_dtype_bytes` may be fractional for
    packed quantized formats. `linear_weight_bytes`, when the engine knows it, is what the step's
    linear kernels actually read (layers and LM head; a dense path over quantized weights reads
    its temporary dense copy too): it replaces the estimate from the dtype."""
    seqs = [(int(q), int(c)) for q, c in seq_shapes]
    for q, c in seqs:
        if q < 1 or c < q:
            raise ValueError(f"a sequence shape needs 1 <= query tokens <= context tokens, got ({q}, {c})")
    rows = len(seqs) if logit_rows is None else logit_rows
    tokens = sum(q for q, _ in seqs)
    s = shapes
    h, layers = s.hidden_size, s.num_layers
    q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

    # Weights per layer. GQA: k and v project to only kv_heads x head_dim.
    qkvo_params = h * q_width + 2 * h * kv_width + q_width * h
    mlp_params = 3 * h * s.intermediate_size  # gate, up, down
    norm_params = 2 * h

    # A multiply-accumulate is 2 FLOPs; every token goes through every projection of every layer.
    flops_qkvo = 2 * tokens * layers * qkvo_params
    flops_mlp = 2 * tokens * layers * mlp_params
    # Causal attention: in a chunk of n new tokens after `past` cached ones, query j sees
    # past + j + 1 keys. Per query head and key: head_dim MACs for the score and head_dim for
    # the weighted sum of values.
    keys_attended = sum(q * (c - q) + q * (q + 1) // 2 for q, c in seqs)
    flops_attention = 2 * 2 * layers * s.num_heads * s.head_dim * keys_attended
    flops_lm_head = 2 * rows * h * s.vocab_size

    # Every layer weight is read once per step however many tokens use it: that reuse is what
    # makes big batches and prefill compute-bound. The embedding is a gather: only the rows of
    # this step's tokens. The LM head is a matmul over the whole [vocab, hidden] matrix, read in
    # full whenever any row needs logits, even when it is tied to the embedding (the gather
    # touched only a few rows of it, long evicted from cache by the time the head runs).
    bytes_layers = (
        layers * (qkvo_params + mlp_params + norm_params) + h
    ) * weight_dtype_bytes  # + final norm
    bytes_embedding_rows = tokens * h * weight_dtype_bytes
    bytes_lm_head = s.vocab_size * h * weight_dtype_bytes if rows > 0 else 0
    if linear_weight_bytes is not None:
        # measured by the kernels: matmul weights of layers and head; the norms stay estimated
        bytes_layers = (layers * norm_params + h) * weight_dtype_bytes + linear_weight_bytes
        bytes_lm_head = 0

    # The element count from ModelShapes (the KV formula's home), scaled by any element size
    # (fractional for quantized caches with their scales).
    kv_per_token = s.kv_elements_per_token * kv_dtype_bytes
    # Each sequence reads the K/V of its whole context (the new tokens' included: attention runs
    # after they are written) and writes the K/V of its new tokens.
    kv_read = sum(c for _, c in seqs) * kv_per_token
    kv_write = tokens * kv_per_token

    breakdown = {
        "tokens": tokens,
        "logit_rows": rows,
        "keys_attended": keys_attended,
        "flops_qkvo": flops_qkvo,
        "flops_mlp": flops_mlp,
        "flops_attention": flops_attention,
        "flops_lm_head": flops_lm_head,
        "bytes_layer_weights": bytes_layers,
        "bytes_embedding_rows": bytes_embedding_rows,
        "bytes_lm_head": bytes_lm_head,
        "bytes_kv_read": kv_read,
        "bytes_kv_write": kv_write,
    }
    return StepCost(
        flops=flops_qkvo + flops_mlp + flops_attention + flops_lm_head,
        weight_bytes=bytes_layers + bytes_embedding_rows + bytes_lm_head,
        kv_read_bytes=kv_read,
        kv_write_bytes=kv_write,
        breakdown=breakdown,
    )


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: at `intensity` FLOP/byte a step can reach at most min(peak, intensity x bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


def bound(intensity: float, ridge: float) -> str:
    """Which roof limits a step: left of the ridge (peak / bandwidth) memory, right of it compute."""
    return "compute-bound" if intensity >= ridge else "memory-bound"
