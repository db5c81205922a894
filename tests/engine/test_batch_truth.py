"""Batch truth (issue 24): a greedy reply is the same alone, batched beside many others, chunked,
prefix-cached and preempted, because every path a row takes computes it alone: the weight
kernels give each row the same bits at any row count (oneDNN float32 given a lone row twice),
the head's exact recompute too, a prompt's chunks end at fixed positions and take the kernel
of its whole length, decode attention is batch invariant. Here on the tiny model at float32
and at packed int4 (the native path's kernels); tests/e2e/test_batch_truth_real_model.py does
the packaged model at its own bits and in float32."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished, TokenGenerated
from engine.kernels.linear import _per_row_products
from engine.kernels.packing import quantize_int4_groups, quantize_int8_per_row
from engine.kernels.weights import DenseWeight, Int4GroupWeight, Int8RowWeight, onednn_linear_available
from engine.model.loaded import LoadedModel
from engine.request import Request


def storages() -> dict[str, object]:
    torch.manual_seed(0)
    w = torch.randn(384, 256) * 0.02
    return {
        "dense-fp32": DenseWeight(w),
        "int4-g32": Int4GroupWeight(*quantize_int4_groups(w, 32)),
        "int8-row": Int8RowWeight(*quantize_int8_per_row(w)),
    }


@pytest.mark.parametrize("kind", ["dense-fp32", "int4-g32", "int8-row"])
def test_every_kernel_the_policy_can_choose_computes_each_row_alone(kind):
    storage = storages()[kind]
    if kind == "dense-fp32" and not onednn_linear_available():
        pytest.skip("oneDNN's packed layout is not in this torch")
    x = torch.randn(200, 256)
    kernels = [k for k in storage.kernels() if k != "dense-fp32" or kind == "dense-fp32"]
    for kernel in kernels:  # (MKL's float32 path over quantized weights is not row-invariant: never chosen
        full = storage.matmul(kernel, x)  # for a prefill by prompt length below 8 rows; see policy)
        for rows in (1, 2, 3, 7, 16, 64, 199):
            assert torch.equal(storage.matmul(kernel, x[:rows]), full[:rows]), (kernel, rows)
        assert torch.equal(storage.matmul(kernel, x[50:90]), full[50:90]), kernel


def test_the_heads_exact_recompute_gives_a_lone_row_the_bits_it_gets_among_others():
    torch.manual_seed(1)
    weights, hidden = torch.randn(9, 64, 96), torch.randn(9, 96)
    together = _per_row_products(weights, hidden)
    for r in range(9):
        assert torch.equal(_per_row_products(weights[r : r + 1], hidden[r : r + 1]), together[r : r + 1])


@pytest.fixture(scope="module", params=["float32", "int4"])
def model(request, tiny_loaded):
    if request.param == "float32":
        return tiny_loaded
    from tiny_models import make_tiny_llama

    from engine.quant.schemes import quantize_model

    fresh = make_tiny_llama(vocab_size=len(tiny_loaded.tokenizer))  # the same random weights
    quantized = quantize_model(fresh, "int4-weight-only")
    return LoadedModel.from_model(quantized, tiny_loaded.tokenizer, name="tiny-int4", source="test")


def prompts(count: int = 8, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(rng.choice([2, 5, 13, 31, 60, 97]))] for _ in range(count)]


def greedy(
    model, batch: list[list[int]], engine: LLMEngine | None = None, **config
) -> tuple[list, LLMEngine]:
    events: list = []
    if engine is None:
        engine = LLMEngine(
            model, EngineConfig(**{"block_size": 4, "num_blocks": 512, **config}), events.append
        )
    engine.sink = events.append
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    ids = [engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)) for p in batch]
    while engine.has_work():
        engine.step()
    done = {e.request_id: list(e.token_ids) for e in events if isinstance(e, RequestFinished)}
    return [done[i] for i in ids], engine


@pytest.fixture(scope="module")
def alone(model):
    return [greedy(model, [p], enable_prefix_caching=False)[0][0] for p in prompts()]


@pytest.mark.parametrize(
    "config",
    [
        {"enable_prefix_caching": False},  # everything batched, decodes beside prefill chunks
        {"enable_prefix_caching": False, "prefill_chunk_size": 16},  # prompts in many chunks
        {"enable_prefix_caching": False, "max_num_batched_tokens": 40},  # chunks that wait their turn
        {"enable_prefix_caching": False, "max_num_seqs": 3},  # a queue
    ],
    ids=["batched", "chunked", "tight-budget", "queued"],
)
def test_many_concurrent_sequences_of_mixed_lengths_equal_their_replies_alone(model, alone, config):
    together, _ = greedy(model, prompts(), **config)
    assert together == alone


def test_prefix_cached_replies_equal_their_replies_alone(model, alone):
    """The second time round every prompt's full blocks come from the cache: the first chunk
    starts at a block boundary and ends where the prompt's own chunk would."""
    _, engine = greedy(model, prompts(), prefill_chunk_size=16)
    again, engine = greedy(model, prompts(), engine=engine)
    assert engine.kv.hit_tokens > 0
    assert again == alone


def test_preempted_replies_and_when_they_may_differ(model, alone):
    """A pool too small for everyone preempts: the newest sequence's blocks go and its tokens so
    far are recomputed later as a prefill (their K/V through the prefill path: its attention
    chunks rather than the decode attention). At float32 that is the same to the last bit here;
    packed int4 reads activations as bfloat16 either way, so the two paths agree too; the
    packaged model says what it does in tests/e2e/test_batch_truth_real_model.py."""
    together, engine = greedy(model, prompts(), num_blocks=60, enable_prefix_caching=False)
    assert engine.scheduler.preemptions > 0
    assert together == alone


def logprobs(model, prompt: list[int], engine: LLMEngine | None = None) -> tuple[list[float], LLMEngine]:
    events: list = []
    if engine is None:
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=512), events.append)
    engine.sink = events.append
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=tuple(prompt), sampling=params))
    while engine.has_work():
        engine.step()
    return [e.logprob for e in events if isinstance(e, TokenGenerated)], engine


@pytest.mark.parametrize("length", [30, 21, 17])
def test_a_prefix_cache_hit_leaves_a_short_tail_the_bits_of_its_prompt_alone(model, length):
    """The cached prompt's last rows (2 to 5 of them here) are a prefill's rows: they take the
    attention the whole prompt's chunk took alone (SDPA), not the row-by-row decode path a
    chunk that short would get by its row count. Checked to the bit on the reply's log-probs
    (the packaged model's greedy replies had differed: tokens are too coarse a check here)."""
    prompt = [(7 * i + 11) % 4000 + 5 for i in range(length)]
    reference, _ = logprobs(model, prompt)
    _, engine = logprobs(model, prompt)
    cached, engine = logprobs(model, prompt, engine)
    assert engine.kv.hit_tokens > 0
    assert cached == reference
