"""`--quantization native`: GGUF tensors kept as the file's blocks (every common type, on kvk's
kernels; the int4/Q8_0 torch layouts on the slower path, their codes exact), the model they make
close to its dequantized twin, an exact head, batched decoding equal to lone decoding, and clear
messages for files that cannot be kept or read."""

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
from engine.kernels import gguf_blocks, native
from engine.kernels.gguf_weight import GGUFWeight
from engine.kernels.linear import FusedProjection, KernelHead, KernelLinear, StackedLinear
from engine.kernels.policy import KernelPolicy
from engine.model.gguf_native import QuantEmbedding, load_native
from engine.model.llama_forward import EXECUTOR
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


def maps_the_file(array: np.ndarray) -> bool:
    """Whether the array is a view of a file mapping (not a copy in memory)."""
    import mmap

    base: object = array
    while isinstance(base, np.ndarray):
        if isinstance(base, np.memmap):
            return True
        base = base.base
    return isinstance(base, mmap.mmap)


def reference_model(path):
    """The same file dequantized by transformers' own GGUF loader: the 'none' twin."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_native_model_keeps_the_blocks_and_matches_its_dequantized_twin(tiny_gguf):
    model, report = load_native(tiny_gguf, torch.float32, KernelPolicy(), lambda s, f: None)
    assert report.kept == {"Q4_1": 10, "Q4_0": 2, "Q8_0": 3}  # 2 layers x (5 Q4_1, q, down), embedding
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    # one copy of the tied head: the embedding's blocks
    assert isinstance(model.lm_head, KernelHead) and model.lm_head.storage is model.model.embed_tokens.storage
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.storage.kind == "q4_0" and model.model.layers[0].mlp.down_proj.storage.kind == "q8_0"
    # the blocks are views of the file's mapping, not copies
    assert isinstance(attn.q_proj.storage, GGUFWeight) and maps_the_file(attn.q_proj.storage.parts[0])
    twin = reference_model(tiny_gguf)
    # the weights are the file's exactly (q/k rows in transformers' order, llama.cpp's RoPE
    # permutation undone by the kernel's row map), so only the kernels' 16-bit activations differ
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
    assert engine.runner.executor == EXECUTOR
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
    assert "q4_1/kvk" in decode.kernel and "q8_0/exact" in decode.kernel  # the layers, the exact head
    read = [s for m in loaded.model.modules() if isinstance(m, KernelLinear) for s in m.storages()]
    packed_bytes = sum({id(s): s.nbytes for s in read}.values())
    assert decode.cost is not None and decode.logit_rows == 1
    assert decode.cost.breakdown["bytes_layer_weights"] >= packed_bytes


def test_a_tensor_type_without_a_kernel_is_dequantized_to_bfloat16_and_said(tmp_path):
    path = write_tiny_llama(tmp_path / "mxfp4.gguf", {"attn_v": Q.MXFP4})
    model, report = load_native(path, torch.float32, KernelPolicy(), lambda s, f: None)
    assert report.dequantized["MXFP4"] == 2
    assert "dequantized to bfloat16 (no kernel keeps them): MXFP4 x2" in report.summary()
    v_proj = model.model.layers[0].self_attn.v_proj
    assert isinstance(v_proj, KernelLinear) and v_proj.storage.kind == "dense-bf16"  # never float32
    assert report.dequantized_bytes == 2 * v_proj.out_features * v_proj.in_features * 2


def test_without_kvk_the_slower_path_keeps_what_torch_kernels_hold_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "kernels", lambda: None)
    path = write_tiny_llama(tmp_path / "slow.gguf", {"attn_q": Q.Q4_0, "attn_v": Q.Q5_0})
    model, report = load_native(path, torch.float32, KernelPolicy(), lambda s, f: None)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.storage.kind == "int4-g32" and attn.k_proj.storage.kind == "int4-g32"
    assert attn.v_proj.storage.kind == "dense-bf16" and report.dequantized["Q5_0"] == 2
    assert any(note.startswith("slower path:") for note in report.notes)
    assert model.model.embed_tokens.storage.kind == "q8_0"  # the torch Q8_0 block layout


def test_a_k_quant_file_is_kept_whole_with_mixed_fused_projections(tmp_path):
    """A Q4_K_M-like file: Q4_K layers with Q6_K v and down projections, a Q6_K output tensor and a
    Q4_K embedding: every tensor at its own bits, q/k/v and gate/up fused across the formats, the
    head exact, the model close to its dequantized twin, batched equal to alone."""
    types = {r: Q.Q4_K for r in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
    types |= {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}
    path = write_tiny_llama(
        tmp_path / "q4km.gguf", types, hidden=256, embedding_type=Q.Q4_K, output_type=Q.Q6_K
    )
    model, report = load_native(path, torch.float32, KernelPolicy(), lambda s, f: None)
    assert report.kept == {"Q4_K": 11, "Q6_K": 5} and not report.dequantized.get("Q4_K")
    loaded = LoadedModel.from_model(model, IdTokenizer(VOCAB), name="q4km", source=str(path), scheme="native")
    attn = loaded.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedProjection) and isinstance(attn.qkv_proj.linear, StackedLinear)
    # q and k (Q4_K) one kernel call over both tensors' rows, v (Q6_K) another
    q_and_k, v = attn.qkv_proj.linear.parts
    assert (q_and_k.storage.kind, v.storage.kind) == ("q4_k", "q6_k")
    assert q_and_k.out_features == attn.q_proj.out_features + attn.k_proj.out_features
    assert loaded.model.lm_head.storage.kind == "q6_k"
    twin = reference_model(path)
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        got, want = model(ids).logits.float(), twin(ids).logits.float()
    assert float((got - want).norm() / want.norm()) < 3e-2
    prompts = [list(range(5, 30)), [7, 8, 9], list(range(60, 71))]
    together, engine = run(loaded, prompts)
    assert engine.runner.executor == "kvscope's own forward"
    assert together == [run(loaded, [p])[0][0] for p in prompts]


def test_a_truncated_gguf_is_a_message_not_a_traceback(tmp_path):
    whole = write_tiny_llama(tmp_path / "whole.gguf")
    size = whole.stat().st_size
    cut = write_tiny_llama(tmp_path / "cut.gguf", truncate_to=size - 500)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(ModelSpec(str(cut), device="cpu"))


def test_a_gguf_larger_than_free_memory_is_refused_before_loading_with_its_estimate(tiny_gguf):
    with pytest.raises(ModelLoadError, match="will not fit: its weights need about"):
        load_model(ModelSpec(str(tiny_gguf), device="cpu", quantization="native"), available_bytes=1024)


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
    assert engine.runner.executor == EXECUTOR
    assert seen == [7] + [1] * (len(tokens[0]) - 1)  # the prefill's 7 rows, then one per decode


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """The conversion reads kvscope's own parse of the header, and its result is kept: the second
    load does not convert again, and both tokenize as transformers does (the packaged GGUF)."""
    from transformers import AutoTokenizer

    from engine.model import gguf_tokenizer
    from engine.model.sources import default_gguf_path

    tiny_chat_gguf = default_gguf_path()
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    first = gguf_tokenizer.load_gguf_tokenizer(tiny_chat_gguf)
    converted = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        AutoTokenizer,
        "from_pretrained",
        lambda *a, **k: converted.append(k.get("gguf_file")) or real(*a, **k),
    )
    second = gguf_tokenizer.load_gguf_tokenizer(tiny_chat_gguf)
    assert converted == [None]  # read from the cached folder, not converted from the GGUF
    reference = real(tiny_chat_gguf.parent, gguf_file=tiny_chat_gguf.name)
    for text in ("Hello, world!", "two  spaces\tand a tab"):
        assert first(text)["input_ids"] == second(text)["input_ids"] == reference(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    rendered = second.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
