"""FLOP and byte counts of a step against hand-computed values, and the MFU/MBU formulas."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import StepStats
from engine.measure.roofline import attainable_flops, bound, step_cost
from engine.request import Request
from engine.shapes import ModelShapes
from engine.units import mbu, mfu


def tiny(num_kv_heads: int = 2, tied: bool = True) -> ModelShapes:
    """2 layers, hidden 64, MLP 128, 4 query heads of 16 over `num_kv_heads` KV heads, vocab 1000."""
    return ModelShapes(
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        vocab_size=1000,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
    )


# Per layer (GQA, 2 KV heads): q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12,288 projection weights;
# gate/up/down 3 x 64x128 = 24,576 MLP weights; two norms 128. Two layers + final norm 64 = 74,048.
LAYER_WEIGHTS = 2 * (12_288 + 24_576 + 128) + 64
KV_ELEMS_PER_TOKEN = 2 * 2 * 2 * 16  # K and V x 2 layers x 2 KV heads x head_dim 16 = 128


def test_decode_step_by_hand():
    cost = step_cost(tiny(), [(1, 10)], weight_dtype_bytes=4, kv_dtype_bytes=4)
    b = cost.breakdown
    assert b["flops_qkvo"] == 2 * 1 * 2 * 12_288 == 49_152
    assert b["flops_mlp"] == 2 * 1 * 2 * 24_576 == 98_304
    # One query over 10 keys; per layer and head: 16 MACs for the score, 16 for the value sum.
    assert b["keys_attended"] == 10
    assert b["flops_attention"] == 2 * 2 * 2 * 4 * 16 * 10 == 5_120
    assert b["flops_lm_head"] == 2 * 64 * 1000 == 128_000
    assert cost.flops == 280_576

    assert b["bytes_layer_weights"] == LAYER_WEIGHTS * 4 == 296_192
    assert b["bytes_embedding_rows"] == 64 * 4  # one gathered row, not the 1000 x 64 table
    assert b["bytes_lm_head"] == 1000 * 64 * 4  # tied, yet read whole by the head's matmul
    assert cost.kv_read_bytes == 10 * KV_ELEMS_PER_TOKEN * 4 == 5_120
    assert cost.kv_write_bytes == 1 * KV_ELEMS_PER_TOKEN * 4 == 512
    assert cost.weight_bytes == 296_192 + 256 + 256_000
    assert cost.bytes_total == 558_080
    assert cost.intensity == pytest.approx(280_576 / 558_080)


def test_prefill_and_chunk_attention_by_hand():
    # A whole 8-token prompt: query j sees j + 1 keys -> 1 + 2 + ... + 8 = 36.
    prefill = step_cost(tiny(), [(8, 8)], 4, 4)
    assert prefill.breakdown["keys_attended"] == 36
    assert prefill.flops == 8 * (49_152 + 98_304) + 4 * 2 * 4 * 16 * 36 + 128_000 == 1_326_080
    assert prefill.weight_bytes == 296_192 + 8 * 64 * 4 + 256_000
    assert prefill.kv_read_bytes == prefill.kv_write_bytes == 8 * 512
    # A 4-token chunk after 8 cached tokens: query j sees 8 + j + 1 keys -> 9 + 10 + 11 + 12 = 42.
    chunk = step_cost(tiny(), [(4, 12)], 4, 4, logit_rows=0)
    assert chunk.breakdown["keys_attended"] == 42
    # A chunk that does not finish its prompt samples nothing: no LM head FLOPs or bytes.
    assert chunk.breakdown["flops_lm_head"] == chunk.breakdown["bytes_lm_head"] == 0
    assert chunk.kv_read_bytes == 12 * 512 and chunk.kv_write_bytes == 4 * 512


def test_gqa_narrows_k_v_projections_and_the_kv_cache():
    gqa, mha = step_cost(tiny(2), [(1, 10)], 4, 4), step_cost(tiny(4), [(1, 10)], 4, 4)
    # MHA: k and v are 64x64 instead of 64x32: 2 x 64 x 32 more weights per layer, 2 FLOPs each.
    assert mha.breakdown["flops_qkvo"] - gqa.breakdown["flops_qkvo"] == 2 * 2 * (2 * 64 * 32)
    assert mha.kv_read_bytes == 2 * gqa.kv_read_bytes
    # Attention FLOPs follow the query heads: the same for both.
    assert mha.breakdown["flops_attention"] == gqa.breakdown["flops_attention"]
    # The KV size agrees with ModelShapes' formula (the single source of it).
    assert gqa.kv_write_bytes == tiny(2).kv_bytes_per_token("float32")
    assert step_cost(tiny(2), [(1, 10)], 2, 2).kv_write_bytes == tiny(2).kv_bytes_per_token("bfloat16")


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_agree_with_the_parameter_count(tied):
    shapes = tiny(tied=tied)
    b = step_cost(shapes, [(1, 1)], 2, 2).breakdown
    embedding_table = 1000 * 64 * 2
    # Tied: the layers, the final norm and one vocab x hidden matrix are all the parameters;
    # untied adds the separate embedding table. Either way a step reads the head once.
    expected = b["bytes_layer_weights"] + b["bytes_lm_head"] + (0 if tied else embedding_table)
    assert expected == shapes.params * 2


def test_decode_is_memory_bound_and_prefill_compute_bound():
    shapes = tiny()
    decode = step_cost(shapes, [(1, 64)], 4, 4)
    prefill = step_cost(shapes, [(512, 512)], 4, 4)
    # fp32 decode: each weight (4 bytes) does one multiply-add (2 FLOPs) -> about 0.5 FLOP/byte.
    assert 0.45 < decode.intensity < 0.55
    # bf16 halves the bytes and doubles it.
    assert 0.9 < step_cost(shapes, [(1, 64)], 2, 2).intensity < 1.1
    assert prefill.intensity > 50 * decode.intensity


def test_batching_raises_decode_intensity():
    shapes = tiny()
    one = step_cost(shapes, [(1, 64)], 4, 4)
    eight = step_cost(shapes, [(1, 64)] * 8, 4, 4)
    assert eight.flops == 8 * one.flops
    # The weights are read once for all eight; only the KV traffic grows per sequence.
    assert eight.weight_bytes - one.weight_bytes == 7 * 64 * 4  # seven more embedding rows
    assert eight.kv_read_bytes == 8 * one.kv_read_bytes
    assert eight.intensity > 5 * one.intensity


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="query tokens"):
        step_cost(tiny(), [(5, 3)], 4, 4)
    with pytest.raises(ValueError, match="query tokens"):
        step_cost(tiny(), [(0, 3)], 4, 4)


def test_mfu_and_mbu_spell_out_their_numbers():
    compute = mfu(flops=1e9, seconds=0.01, peak_flops=4e11)
    assert compute.value == pytest.approx(0.25) and compute.achieved == pytest.approx(1e11)
    assert "1 GFLOP / 10 ms / 400 GFLOP/s" in compute.how and compute.how.endswith("25.0%")
    memory = mbu(nbytes=3e8, seconds=0.02, bandwidth=2e10)
    assert memory.value == pytest.approx(0.75) and memory.achieved == pytest.approx(1.5e10)
    assert "300 MB / 20 ms / 20 GB/s" in memory.how and memory.how.endswith("75.0%")
    with pytest.raises(ValueError):
        mfu(1e9, 0.0, 1e11)


def test_roofline_and_ridge():
    peak, bandwidth = 1e11, 2e10  # ridge at 5 FLOP/byte
    assert attainable_flops(0.5, peak, bandwidth) == 1e10  # on the bandwidth slope
    assert attainable_flops(50, peak, bandwidth) == peak  # under the compute roof
    assert bound(0.5, peak / bandwidth) == "memory-bound"
    assert bound(50, peak / bandwidth) == "compute-bound"


def test_logit_rows_per_step_from_a_real_engine(tiny_loaded):
    """A 40-token prompt in chunks of 16: two chunks sample nothing, the last samples once,
    then each decode step samples once: the rows the runner computed, in StepStats."""
    events: list = []
    config = EngineConfig(num_blocks=16, prefill_chunk_size=16, enable_prefix_caching=False)
    engine = LLMEngine(tiny_loaded, config, events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=tuple(range(100, 140)), sampling=params))
    while engine.has_work():
        engine.step()
    steps = [(e, e.logit_rows) for e in events if isinstance(e, StepStats)]
    assert [(s.seq_shapes, rows) for s, rows in steps] == [
        (((16, 16),), 0),
        (((16, 32),), 0),
        (((8, 40),), 1),
        (((1, 41),), 1),
        (((1, 42),), 1),
    ]
