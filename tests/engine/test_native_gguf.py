"""`--quantization native`: GGUF blocks read with their codes exact (gguf's own dequantization
bit for bit), the model they make close to its dequantized twin, batched decoding equal to lone
decoding, and clear messages for files that cannot be kept or read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_files import VOCAB, write_tiny_llama
from tiny_models import IdTokenizer

from engine.config import EngineConfig, ModelSpec, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.errors import ModelLoadError
from engine.events import RequestFinished
from engine.kernels import gguf_blocks
from engine.kernels.linear import KernelLinear
from engine.kernels.policy import KernelPolicy
from engine.model.gguf_native import QuantEmbedding, load_native
from engine.model.loaded import LoadedModel
from engine.model.loading import load_model, resolve_scheme
from engine.model.sources import resolve_source
from engine.request import Request


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Any bytes are a valid block, except float16 scales that are not finite: set those."""
    rng = np.random.default_rng(seed)
    block_size, type_size = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q4_K: (256, 144), Q.Q8_0: (32, 34)}[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    halves = {Q.Q4_0: 1, Q.Q4_1: 2, Q.Q4_K: 2, Q.Q8_0: 1}[qtype]
    scales = (rng.random((rows, cols // block_size, halves)) * 0.1).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, cols // block_size, 2 * halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_codes_and_scales_reproduce_gguf_bit_for_bit(qtype):
    rows, cols = 8, 512
    for blocks in (
        random_blocks(qtype, rows, cols),
        *(
            [quantize(np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float32), qtype)]
            if qtype != Q.Q4_K
            else []
        ),
    ):
        codes, scale, offset = gguf_blocks.decode_int4(blocks, qtype, cols)
        assert codes.dtype == np.uint8 and codes.max() <= 15
        mine = gguf_blocks.dequantize_int4(codes, scale, offset, qtype)
        assert np.array_equal(
            mine.view(np.uint32), dequantize(blocks, qtype).reshape(rows, cols).view(np.uint32)
        )


def test_q8_0_codes_and_scales_reproduce_gguf_bit_for_bit():
    rows, cols = 8, 128
    blocks = quantize(np.random.default_rng(4).standard_normal((rows, cols)).astype(np.float32), Q.Q8_0)
    storage = gguf_blocks.q8_storage(blocks, cols)
    assert np.array_equal(
        storage.dequantize().numpy().view(np.uint32), dequantize(blocks, Q.Q8_0).view(np.uint32)
    )


def test_int4_storage_holds_the_codes_unchanged():
    rows, cols = 64, 256
    blocks = random_blocks(Q.Q4_1, rows, cols, seed=5)
    storage = gguf_blocks.int4_storage(blocks, Q.Q4_1, cols)
    codes, _, _ = gguf_blocks.decode_int4(blocks, Q.Q4_1, cols)
    assert np.array_equal(storage.codes().numpy(), codes)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return write_tiny_llama(path, {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "ffn_down": Q.Q8_0})


def reference_model(path):
    """The same file dequantized by transformers' own GGUF loader: the 'none' twin."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_native_model_keeps_the_blocks_and_matches_its_dequantized_twin(tiny_gguf):
    model, report = load_native(tiny_gguf, torch.float32, KernelPolicy(), lambda s, f: None)
    assert report.kept == {"Q4_1": 10, "Q4_0": 2, "Q8_0": 3}  # 2 layers x (5 Q4_1, q, down), embedding
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert (
        isinstance(model.lm_head, KernelLinear) and model.lm_head.storage is model.model.embed_tokens.storage
    )
    attn = model.model.layers[0].self_attn
    assert (
        attn.q_proj.storage.kind == "int4-g32" and model.model.layers[0].mlp.down_proj.storage.kind == "q8_0"
    )
    twin = reference_model(tiny_gguf)
    # the weights are the file's exactly (q/k rows in transformers' order, llama.cpp's RoPE
    # permutation undone), so only the kernels' bfloat16 activations differ
    for name in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.mlp.down_proj",
    ):
        want = twin.get_submodule(name).weight
        got = model.get_submodule(name).storage.dequantize()
        assert float((got - want).abs().max() / want.abs().max()) < 5e-3, name
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        got, want = model(ids).logits.float(), twin(ids).logits.float()
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def native_loaded(path) -> LoadedModel:
    model, report = load_native(path, torch.float32, KernelPolicy(), lambda s, f: None)
    loaded = LoadedModel.from_model(
        model, IdTokenizer(VOCAB), name="tiny-native", source=str(path), scheme="native"
    )
    return loaded


def run(loaded, prompts, **config):
    events = []
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=128, **config), events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    ids = [engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)) for p in prompts]
    while engine.has_work():
        engine.step()
    done = {e.request_id: e.token_ids for e in events if isinstance(e, RequestFinished)}
    return [done[i] for i in ids], engine


def test_batched_native_decoding_equals_lone_native_decoding(tiny_gguf):
    loaded = native_loaded(tiny_gguf)
    prompts = [list(range(5, 30)), [7, 8, 9], list(range(60, 71))]
    together, engine = run(loaded, prompts)
    assert engine.runner.executor == "kvscope Llama-family forward"
    alone = [run(loaded, [p])[0][0] for p in prompts]
    assert together == alone


def test_step_stats_name_the_kernels_and_count_the_bytes_they_read(tiny_gguf):
    loaded = native_loaded(tiny_gguf)
    events = []
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=64), events.append)
    engine.add_request(
        Request(
            prompt_token_ids=tuple(range(5, 20)), sampling=SamplingParams(temperature=0.0, max_new_tokens=3)
        )
    )
    while engine.has_work():
        engine.step()
    from engine.events import StepStats

    decode = [e for e in events if isinstance(e, StepStats) and e.decode_tokens][-1]
    assert "int4-g32/" in decode.kernel and "q8_0/" in decode.kernel
    # what each layer's matmul reads: its storage, or for the head its per-row scout
    read = [
        getattr(m, "scout", None) or m.storage for m in loaded.model.modules() if isinstance(m, KernelLinear)
    ]
    packed_bytes = sum({id(s): s.nbytes for s in read}.values())
    assert decode.cost is not None and decode.logit_rows == 1
    assert decode.cost.breakdown["bytes_layer_weights"] >= packed_bytes


def test_a_tensor_type_without_a_kernel_is_dequantized_and_said(tmp_path):
    path = write_tiny_llama(tmp_path / "q5.gguf", {"attn_v": Q.Q5_0})
    model, report = load_native(path, torch.float32, KernelPolicy(), lambda s, f: None)
    assert report.dequantized["Q5_0"] == 2
    assert "dequantized (no kernel keeps them): Q5_0 x2" in report.summary()
    assert type(model.model.layers[0].self_attn.v_proj) is torch.nn.Linear


def test_a_truncated_gguf_is_a_message_not_a_traceback(tmp_path):
    whole = write_tiny_llama(tmp_path / "whole.gguf")
    size = whole.stat().st_size
    cut = write_tiny_llama(tmp_path / "cut.gguf", truncate_to=size - 500)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(ModelSpec(str(cut), device="cpu"))


def test_auto_means_native_for_gguf_sources_and_none_for_folders(tiny_gguf, tmp_path):
    assert resolve_scheme("auto", resolve_source(str(tiny_gguf))) == "native"
    folder = tmp_path / "folder"
    folder.mkdir()
    assert resolve_scheme("auto", resolve_source(str(folder))) == "none"
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_scheme("native", resolve_source(str(folder)))


def test_the_own_forward_still_runs_the_hooks_someone_registered(tiny_gguf):
    """kvscope's forward skips nn.Module's call machinery for speed only while nothing hooks a
    layer: a registered hook still sees every call."""
    loaded = native_loaded(tiny_gguf)
    o_proj = loaded.model.model.layers[0].self_attn.o_proj
    seen = []
    handle = o_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    try:
        tokens, engine = run(loaded, [list(range(5, 12))])
    finally:
        handle.remove()
    assert engine.runner.executor == "kvscope Llama-family forward"
    assert seen == [7] + [1] * (len(tokens[0]) - 1)  # the prefill's 7 rows, then one per decode
