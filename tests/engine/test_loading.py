"""Model loading: sources, the refusals (each with a clear message, before any weight is read),
the once-only conversion cache, and the real packaged model (slow)."""

from __future__ import annotations

import shutil

import pytest
import torch
from model_folders import (
    BERT_CONFIG,
    LLAMA_8B_CONFIG,
    VIT_CONFIG,
    fake_hf_cache,
    save_tiny_model,
    write_config,
)

from engine.cache_dirs import SOURCE_MARKER, is_converted, publish_atomically, source_fingerprint
from engine.config import ModelSpec
from engine.errors import ModelLoadError, describe_load_error
from engine.hub.cache import hf_cache_models
from engine.measure.memory import AVAILABLE_MEMORY_ENV
from engine.model import default_model
from engine.model.loading import load_model
from engine.model.sources import default_gguf_path


@pytest.fixture
def tiny_folder(tmp_path, default_tokenizer):
    return save_tiny_model(tmp_path / "tiny-llama", default_tokenizer)


def load_error(source: str, **spec) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(source, **{"device": "cpu", **spec}))
    message = str(info.value)
    assert "Traceback" not in message and "\n" not in message
    return message


# ---- the tokenizer ---------------------------------------------------------------------------
def test_default_tokenizer_has_smollm2_chat_format(default_tokenizer):
    assert len(default_tokenizer) == 49152
    assert default_tokenizer.eos_token == "<|im_end|>"
    text = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = default_tokenizer("The capital of France").input_ids
    assert default_tokenizer.decode(ids) == "The capital of France"


# ---- loading real (tiny) models --------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_folder_reports_progress_and_info(tiny_folder, dtype):
    stages = []
    loaded = load_model(
        ModelSpec(str(tiny_folder), dtype=dtype, device="cpu"), lambda s, f: stages.append((s, f))
    )
    assert loaded.dtype == getattr(torch, dtype) and loaded.device == torch.device("cpu")
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == "sdpa"
    info = loaded.info
    assert (info.name, info.source, info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (
        "tiny-llama",
        str(tiny_folder),
        2,
        4,
        2,
        16,
    )
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * (4 if dtype == "float32" else 2)
    fractions = [f for _, f in stages]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert loaded.tokenizer.eos_token == "<|im_end|>"


def test_loaded_folder_computes_the_same_logits_as_the_saved_model(tiny_folder):
    from tiny_models import make_tiny_llama

    loaded = load_model(ModelSpec(str(tiny_folder), device="cpu"))
    reference = make_tiny_llama(vocab_size=loaded.info.vocab_size)
    ids = torch.tensor([[1, 400, 2000, 31]])
    # the saved weights, bit for bit (the head too, kept in the kernels' own layout)
    assert torch.equal(loaded.model.lm_head.storage.dequantize(), reference.lm_head.weight)
    with torch.inference_mode():
        # the same logits to float32's rounding, not bit for bit: the kernels' GEMM (oneDNN) sums
        # in another order than nn.Linear's, by CPU (equal on one EPYC, not on CI's machine)
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def test_cached_repo_is_listed_and_loads_offline(hf_cache, tiny_folder):
    files = {p.name: p for p in tiny_folder.iterdir()}
    fake_hf_cache(hf_cache, "tiny-org/tiny-llama", files)
    fake_hf_cache(
        hf_cache,
        "google/bert-like",
        {"config.json": BERT_CONFIG, "model.safetensors": files["model.safetensors"]},
    )
    fake_hf_cache(hf_cache, "someone/config-only", {"config.json": LLAMA_8B_CONFIG})
    assert [m.source for m in hf_cache_models()] == ["tiny-org/tiny-llama"]  # what the picker lists
    loaded = load_model(ModelSpec("tiny-org/tiny-llama", device="cpu"))
    assert loaded.info.name == "tiny-org/tiny-llama" and loaded.info.num_layers == 2


def test_no_hf_cache_means_no_cached_models(hf_cache):
    shutil.rmtree(hf_cache)
    assert hf_cache_models() == []


# ---- refusals --------------------------------------------------------------------------------
def test_missing_path(tmp_path):
    message = load_error(str(tmp_path / "nowhere" / "model.gguf"))
    assert "does not exist" in message and str(tmp_path / "nowhere") in message


def test_repo_id_not_in_cache(hf_cache):
    message = load_error("nobody-here/no-such-model")
    assert (
        "not in the local Hugging Face cache" in message
        and "python -m engine models download nobody-here/no-such-model" in message
    )


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    assert "not a .gguf file" in load_error(str(path))


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 100)
    assert "not a readable GGUF file" in load_error(str(path))


@pytest.mark.parametrize("keep", [4096, -1_000_000], ids=["header-cut", "tensor-data-cut"])
def test_truncated_gguf(tmp_path, keep):
    data = default_gguf_path().read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:keep])
    assert "not a readable GGUF file" in load_error(str(path))


def _write_gguf(path, arch: str, **metadata) -> str:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_of_an_architecture_transformers_cannot_load(tmp_path):
    message = load_error(_write_gguf(tmp_path / "rwkv.gguf", "rwkv7", block_count=2))
    assert "holds a 'rwkv7' model" in message and "cannot load from GGUF" in message


def test_gguf_of_an_encoder_decoder_model(tmp_path):
    message = load_error(_write_gguf(tmp_path / "t5.gguf", "t5", block_count=2, embedding_length=8))
    assert "cannot be loaded as a chat model" in message and "does not generate text" in message


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "no config.json" in load_error(str(tmp_path / "empty"))


def test_config_that_is_not_json(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_si')
    assert "not valid JSON" in load_error(str(folder))


def test_garbage_safetensors(tiny_folder):
    (tiny_folder / "model.safetensors").write_bytes(
        b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + b"\xff" * 512
    )
    message = load_error(str(tiny_folder))
    assert "could not be read" in message and "corrupt or truncated" in message


def test_config_without_weights(tmp_path):
    cfg = {**LLAMA_8B_CONFIG, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64}
    folder = write_config(tmp_path / "config-only", {**cfg, "num_attention_heads": 4, "head_dim": 16})
    assert "no weight files" in load_error(str(folder))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (BERT_CONFIG, "encodes or classifies text"),
        ({k: v for k, v in BERT_CONFIG.items() if k != "architectures"}, "is an encoder"),
        (VIT_CONFIG, "does not generate text"),
        ({**LLAMA_8B_CONFIG, "model_type": "quantum-llama-9000"}, "not one this version of transformers"),
        (
            {**LLAMA_8B_CONFIG, "model_type": "custom-thing", "auto_map": {"AutoModel": "x.Y"}},
            "custom Python code",
        ),
        ({"hidden_size": 8}, "no 'model_type'"),
    ],
    ids=["bert", "bert-without-architectures", "vit", "unknown-type", "remote-code", "no-model-type"],
)
def test_folder_that_is_not_a_loadable_causal_lm(tmp_path, config, expected):
    folder = write_config(tmp_path / "model", config)
    message = load_error(str(folder))
    assert "cannot be loaded as a chat model" in message and expected in message


def test_model_too_big_for_memory_is_refused_before_loading(tmp_path, monkeypatch):
    folder = write_config(tmp_path / "llama-8b", LLAMA_8B_CONFIG)  # no weights: the check comes first
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(8 * 2**30))
    message = load_error(str(folder), dtype="bfloat16")
    # 8,030,261,248 parameters x 2 bytes = 14.96 GiB, written "15.0 GiB" (engine.units) > 8 GiB.
    assert "will not fit" in message and "15.0 GiB" in message and "8.0 GiB" in message


def test_available_memory_parameter_overrides_the_probe(tiny_folder):
    with pytest.raises(ModelLoadError, match="will not fit"):
        load_model(ModelSpec(str(tiny_folder), device="cpu"), available_bytes=1024)


def test_float16_on_cpu_is_refused(tiny_folder):
    assert "float16 is not offered on the CPU" in load_error(str(tiny_folder), dtype="float16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(tiny_folder):
    assert "cuda" in load_error(str(tiny_folder), device="cuda")


def test_describe_load_error():
    assert describe_load_error(ModelLoadError("The file is gone.")) == "The file is gone."
    message = describe_load_error(RuntimeError("boom\nsecond line"))
    assert "unexpected error" in message and "RuntimeError: boom" in message and "\n" not in message


# ---- the once-only conversion cache ----------------------------------------------------------
def test_publish_atomically_stamps_and_replaces(tmp_path):
    target = tmp_path / "cache" / "model"
    publish_atomically(target, "v1", lambda d: (d / "weights").write_text("one"))
    assert is_converted(target, "v1") and not is_converted(target, "v2")
    publish_atomically(target, "v2", lambda d: (d / "weights").write_text("two"))
    assert (target / "weights").read_text() == "two" and is_converted(target, "v2")
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no temp folders left


def test_failed_conversion_leaves_the_previous_folder_and_no_half_folder(tmp_path):
    target = tmp_path / "model"
    publish_atomically(target, "v1", lambda d: (d / "weights").write_text("one"))

    def dies_half_way(folder):
        (folder / "weights").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        publish_atomically(target, "v2", dies_half_way)
    assert (target / "weights").read_text() == "one" and is_converted(target, "v1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_folder_without_marker_is_not_converted(tmp_path):
    (tmp_path / "model").mkdir()
    assert not is_converted(tmp_path / "model", "anything")


def test_fingerprint_follows_the_source_file(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"a" * 10)
    before = source_fingerprint(source)
    source.write_bytes(b"b" * 11)
    assert source_fingerprint(source) != before


def test_default_model_dir_converts_once_and_again_when_the_gguf_changes(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    fake_gguf = tmp_path / "packaged.gguf"
    fake_gguf.write_bytes(b"version one")
    conversions = []

    def fake_convert(gguf, target):
        conversions.append(gguf.read_bytes())
        (target / "config.json").write_text("{}")

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: fake_gguf)
    monkeypatch.setattr(
        default_model, "read_gguf_config", lambda path: LlamaConfig(hidden_size=64, intermediate_size=64)
    )
    monkeypatch.setattr(default_model, "_convert_gguf_to_folder", fake_convert)

    folder = default_model.default_model_dir()
    assert folder == tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert default_model.default_model_dir() == folder
    assert conversions == [b"version one"]
    fake_gguf.write_bytes(b"version two!")
    default_model.default_model_dir()
    assert conversions == [b"version one", b"version two!"]
    assert (folder / SOURCE_MARKER).read_text() == source_fingerprint(fake_gguf)


# ---- the real packaged model -----------------------------------------------------------------
@pytest.mark.slow
def test_default_model_is_smollm2_and_answers(default_loaded):
    info = default_loaded.info
    assert (
        info.name,
        info.architecture,
        info.num_layers,
        info.num_heads,
        info.num_kv_heads,
        info.head_dim,
    ) == (
        "SmolLM2-135M-Instruct",
        "LlamaForCausalLM",
        30,
        9,
        3,
        64,
    )
    assert info.params == 134_515_008  # SmolLM2-135M: every weight once, the tied head not twice
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    tok = default_loaded.tokenizer
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = default_loaded.model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, inputs["input_ids"].shape[1] :])


@pytest.mark.slow
def test_gguf_source_matches_the_converted_default(default_loaded):
    """Loading the GGUF directly and loading the converted folder give the same network."""
    direct = load_model(ModelSpec(str(default_gguf_path()), device="cpu", quantization="none"))
    assert direct.info.name == "SmolLM2-135M-Instruct.Q4_1"
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    with torch.inference_mode():
        assert torch.allclose(direct.model(ids).logits, default_loaded.model(ids).logits, atol=1e-5)
