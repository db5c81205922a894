"""int8 KV cache: quantized on write, dequantized on gather, close to the fp32 pool, and
several times more blocks in the same budget."""

import pytest
import torch
from test_paged_attention import paged_forward
from tiny_models import make_tiny_llama

from engine.bench.quality import greedy_agreement
from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.model.kv_storage import PagedKVStorage
from engine.request import Request

VOCAB = 500


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(vocab_size=VOCAB, seed=3)


def storage_for(model, kv_dtype, num_blocks=16, block_size=8):
    cfg = model.config
    return PagedKVStorage(
        cfg.num_hidden_layers,
        num_blocks,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
        torch.float32,
        "cpu",
        kv_dtype=kv_dtype,
    )


def test_write_then_gather_is_within_half_a_step_per_token_and_head():
    storage = PagedKVStorage(1, 4, 4, 2, 8, torch.float32, "cpu", kv_dtype="int8")
    torch.manual_seed(0)
    key = torch.randn(6, 2, 8) * torch.tensor([0.01, 30.0])[None, :, None]  # heads of very different range
    value = torch.randn(6, 2, 8)
    value[2] = 0.0  # an all-zero token must come back as zeros, not NaN
    slots = torch.tensor([13, 14, 15, 4, 5, 6])  # block 3 then block 1, as a block table would place them
    storage.write(0, storage.slot_rows(slots), key, value)
    assert storage.k[0].dtype == torch.int8 and storage.k_scale[0].dtype == torch.float16
    # table [3, 1], 6 tokens: rows are slots 12..15 then 4..5; slot 12 was never written
    k, v = (t.transpose(0, 1) for t in storage.gather(0, torch.tensor([3, 1]), 6, torch.float32))
    assert k.shape == (6, 2, 8)
    step_k = key.abs().amax(-1, keepdim=True) / 127
    step_v = value.abs().amax(-1, keepdim=True) / 127
    # half a quantization step, plus the float16 rounding of the scale
    assert ((k[1:] - key[:5]).abs() <= step_k[:5] * 0.51 + 1e-7).all()
    assert ((v[1:] - value[:5]).abs() <= step_v[:5] * 0.51 + 1e-7).all()
    assert torch.equal(v[3], torch.zeros(2, 8))
    assert torch.equal(k[0], torch.zeros(2, 8))


def test_int8_logits_are_close_to_the_fp32_pool(model):
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (29,)).tolist()
    decode = torch.randint(0, VOCAB, (6,)).tolist()
    table = [9, 2, 14, 5, 11]
    results = {}
    for kv_dtype in ("auto", "int8"):
        storage = storage_for(model, kv_dtype)
        logits = [paged_forward(model, storage, [(prompt[:20], 0, table)])]
        logits.append(
            paged_forward(model, storage, [(prompt[20:], 20, table)])
        )  # a chunk after cached int8 K/V
        for i, tok in enumerate(decode):
            logits.append(paged_forward(model, storage, [([tok], 29 + i, table)]))
        results[kv_dtype] = torch.cat(logits)
    fp, q = results["auto"], results["int8"]
    relative = ((q - fp).norm() / fp.norm()).item()
    assert 0 < relative < 0.01  # measured ~0.2%
    assert (q.argmax(-1) == fp.argmax(-1)).float().mean() >= 0.95


def test_copy_block_copies_codes_and_scales(model):
    storage = storage_for(model, "int8", num_blocks=4, block_size=4)
    paged_forward(model, storage, [(list(range(4)), 0, [2])])
    storage.copy_block(2, 0)
    for pools in (storage.k, storage.v, storage.k_scale, storage.v_scale):
        assert pools[1][0].abs().sum() > 0 and torch.equal(pools[1][0], pools[1][2])  # block 0 = block 2


def test_bytes_per_block_counts_the_scales():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, block 16.
    fp32 = PagedKVStorage.block_bytes(30, 16, 3, 64, torch.float32)
    bf16 = PagedKVStorage.block_bytes(30, 16, 3, 64, torch.bfloat16)
    int8 = PagedKVStorage.block_bytes(30, 16, 3, 64, torch.float32, "int8")
    assert int8 == 2 * 30 * 16 * 3 * (64 + 2)
    assert fp32 / int8 == pytest.approx(256 / 66) and bf16 / int8 == pytest.approx(128 / 66)
    storage = PagedKVStorage(2, 3, 16, 2, 16, torch.float32, "cpu", kv_dtype="int8")
    tensors = storage.k + storage.v + storage.k_scale + storage.v_scale
    assert storage.total_bytes == sum(t.numel() * t.element_size() for t in tensors)


def test_the_same_budget_holds_several_times_the_blocks(tiny_loaded):
    budget = 2**20
    fp32 = LLMEngine(tiny_loaded, EngineConfig(kv_budget_bytes=budget))
    int8 = LLMEngine(tiny_loaded, EngineConfig(kv_budget_bytes=budget, kv_dtype="int8"))
    assert int8.storage.total_bytes <= budget and fp32.storage.total_bytes <= budget
    # head_dim 16 here: 18 bytes per head-token instead of 64
    assert int8.kv.pool.num_blocks >= 3 * fp32.kv.pool.num_blocks
    assert int8.kv_stats().bytes_per_block == int8.storage.bytes_per_block


def test_greedy_output_agrees_with_the_fp32_cache(tiny_loaded):
    prompts = ["Tell me about the sea.", "What is two plus two?", "Write a poem about autumn leaves."]
    outputs = {}
    for kv_dtype in ("auto", "int8"):
        events = []
        engine = LLMEngine(tiny_loaded, EngineConfig(kv_budget_bytes=2**20, kv_dtype=kv_dtype), events.append)
        params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(Request.chat(prompt, sampling=params))
        while engine.has_work():
            engine.step()
        finished = sorted((e for e in events if isinstance(e, RequestFinished)), key=lambda e: e.request_id)
        outputs[kv_dtype] = [list(e.token_ids) for e in finished]
    agreements = [greedy_agreement(a, b) for a, b in zip(outputs["auto"], outputs["int8"])]
    assert len(agreements) == 3
    assert sum(a.common_prefix for a in agreements) / sum(a.length for a in agreements) >= 0.9


def test_prefix_cached_int8_blocks_reproduce_the_first_answer(tiny_loaded):
    """A second identical request reads the first one's cached int8 blocks: same tokens."""
    events = []
    engine = LLMEngine(tiny_loaded, EngineConfig(kv_budget_bytes=2**20, kv_dtype="int8"), events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    text = "Repeat after me: the quick brown fox jumps over the lazy dog, twice over."
    for _ in range(2):
        engine.add_request(Request.chat(text, sampling=params))
        while engine.has_work():
            engine.step()
    first, second = [e for e in events if isinstance(e, RequestFinished)]
    assert second.stats.cached_prompt_tokens > 0
    assert first.token_ids == second.token_ids
