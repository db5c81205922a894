"""FLOPs and bytes of one engine step, computed from the model's shapes and the step's sequences,
and the utilisation figures (MFU, MBU) that compare a measured step with the device's limits.

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
from dataclasses import dataclass

from engine.events import StepCost
from engine.model.shapes import ModelShapes


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


# ---- utilisation -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Utilisation:
    value: float  # achieved / limit: 0.25 means a quarter of the measured limit
    achieved: float  # FLOP/s or bytes/s
    how: str  # the formula with this measurement's numbers, for a tooltip


def mfu(flops: float, seconds: float, peak_flops: float) -> Utilisation:
    """Model FLOPs utilisation: the step's counted FLOPs per second over the measured matmul peak."""
    _check_positive(seconds, "the step time")
    _check_positive(peak_flops, "the peak FLOP/s")
    achieved = flops / seconds
    value = achieved / peak_flops
    how = (
        f"MFU = FLOPs / time / peak = {si(flops, 'FLOP')} / {duration(seconds)} / "
        f"{si(peak_flops, 'FLOP/s')} (measured matmul peak) = {si(achieved, 'FLOP/s')} / "
        f"{si(peak_flops, 'FLOP/s')} = {value:.1%}"
    )
    return Utilisation(value, achieved, how)


def mbu(nbytes: float, seconds: float, bandwidth: float) -> Utilisation:
    """Memory bandwidth utilisation: the step's bytes moved per second over the measured bandwidth."""
    _check_positive(seconds, "the step time")
    _check_positive(bandwidth, "the memory bandwidth")
    achieved = nbytes / seconds
    value = achieved / bandwidth
    how = (
        f"MBU = bytes / time / bandwidth = {si(nbytes, 'B')} / {duration(seconds)} / "
        f"{si(bandwidth, 'B/s')} (measured copy bandwidth) = {si(achieved, 'B/s')} / "
        f"{si(bandwidth, 'B/s')} = {value:.1%}"
    )
    return Utilisation(value, achieved, how)


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: at `intensity` FLOP/byte a step can reach at most min(peak, intensity x bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


def bound(intensity: float, ridge: float) -> str:
    """Which roof limits a step: left of the ridge (peak / bandwidth) memory, right of it compute."""
    return "compute-bound" if intensity >= ridge else "memory-bound"


def _check_positive(value: float, what: str) -> None:
    if not value > 0:
        raise ValueError(f"{what} must be positive, got {value}")


# ---- formatting for the `how` strings ---------------------------------------------------------
_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float, unit: str) -> str:
    """3 significant digits with a decimal SI prefix: si(1.5e9, 'B/s') -> '1.50 GB/s'."""
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
