"""inspect-model: figures from config/metadata only, checked against hand-computed numbers."""

from __future__ import annotations

import pytest
from model_folders import LLAMA_8B_CONFIG, write_config

from engine.config import ConfigError
from engine.errors import ModelLoadError
from engine.measure.memory import AVAILABLE_MEMORY_ENV
from engine.model.gguf_plan import kvk_here
from engine.model.inspect import inspect_model
from engine.model.sources import default_gguf_path

GiB = 2**30


@pytest.fixture
def llama_8b(tmp_path):
    """A folder holding only config.json (plus unreadable 'weights' that must never be opened)."""
    folder = write_config(tmp_path / "llama-8b", LLAMA_8B_CONFIG)
    (folder / "model.safetensors").write_bytes(b"not weights")
    return folder


def test_8b_class_config_in_float16(llama_8b):
    report = inspect_model(str(llama_8b), dtype="float16", context=131072, budget_gib=32)
    assert (report["num_layers"], report["num_heads"], report["num_kv_heads"], report["head_dim"]) == (
        32,
        32,
        8,
        128,
    )
    # K and V x 32 layers x 8 KV heads x 128 x 2 bytes = 131072 B = 128 KiB per token.
    assert report["kv_bytes_per_token"] == 131072
    # 128 KiB x 131072 tokens = 16 GiB.
    assert report["kv_bytes_for_context"] == 16 * GiB
    # Per layer: q,o 4096x4096 each, k,v 4096x1024 each, MLP 3x4096x14336, two norms of 4096
    # = 218,112,000; x32 = 6,979,584,000; untied embedding + head 2x128256x4096 = 1,050,673,152;
    # final norm 4096 -> 8,030,261,248 parameters, 2 bytes each.
    assert report["params"] == 8_030_261_248
    assert report["weight_bytes"] == 16_060_522_496
    # (32 GiB - weights) // 128 KiB = 18,299,215,872 // 131072 = 139,611 tokens.
    assert report["max_context_tokens_in_budget"] == 139_611
    assert report["weights_fit_in_budget"] and report["budget_bytes"] == 32 * GiB


def test_budget_smaller_than_the_weights_leaves_no_context(llama_8b):
    report = inspect_model(str(llama_8b), dtype="bfloat16", budget_gib=10)
    assert not report["weights_fit_in_budget"] and report["max_context_tokens_in_budget"] == 0
    assert report["context"] == 131072  # the model's own maximum when none is given


def test_default_budget_is_available_memory(llama_8b, monkeypatch):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(20 * GiB))
    report = inspect_model(str(llama_8b), dtype="float32")
    assert report["budget_bytes"] == 20 * GiB and report["budget_source"].startswith("available")
    # float32: 4 bytes per parameter (29.9 GiB) does not fit 20 GiB.
    assert report["weight_bytes"] == 4 * 8_030_261_248 and report["max_context_tokens_in_budget"] == 0


def smollm2_figures(report):
    return {
        k: report[k]
        for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")
    }


SMOLLM2 = {
    "num_layers": 30,
    "num_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "vocab_size": 49152,
}


def test_default_model():
    report = inspect_model("default", dtype="float32", context=2048, budget_gib=1)
    assert smollm2_figures(report) == SMOLLM2
    assert report["architecture"] == "LlamaForCausalLM" and report["max_position_embeddings"] == 8192
    # the packaged GGUF at its own bits: its K/V in float16 (engine.shapes.auto_kv_dtype)
    assert report["kv_dtype"] == "float16"
    assert report["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23040
    assert report["kv_bytes_for_context"] == 23040 * 2048
    assert report["max_context_tokens_in_budget"] == (GiB - report["weight_bytes"]) // 23040


def test_gguf_metadata_gives_the_same_shapes(tmp_path, monkeypatch):
    """Before the default is converted (empty cache) its GGUF metadata is read instead."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "empty-cache"))
    from_gguf = inspect_model("default", dtype="bfloat16")
    assert from_gguf["path"] == str(default_gguf_path())
    assert smollm2_figures(from_gguf) == SMOLLM2
    monkeypatch.delenv("KVSCOPE_CACHE_DIR")
    from_folder = inspect_model("default", dtype="bfloat16")
    for key in ("params", "weight_bytes", "kv_bytes_per_token", "max_position_embeddings", "architecture"):
        assert from_gguf[key] == from_folder[key], key


def test_missing_source(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        inspect_model(str(tmp_path / "absent"))


def test_corrupt_config(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{ nope")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        inspect_model(str(folder))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"dtype": "int3"}, "dtype must be one of"),
        ({"context": 0}, "at least 1 token"),
        ({"budget_gib": -1}, "more than 0"),
    ],
)
def test_bad_numbers(llama_8b, kwargs, expected):
    with pytest.raises(ConfigError, match=expected):
        inspect_model(str(llama_8b), **kwargs)


def test_a_gguf_counts_its_own_bits_where_a_load_keeps_them():
    native = inspect_model("default", dtype="float32")
    dequantized = inspect_model("default", dtype="float32", quantization="none")
    assert native["weights_as"] == "native" and dequantized["weights_as"] == "float32"
    # per type as the loader holds it: with the kvk kernels every tensor's blocks as the file has
    # them (memory-mapped, the head reading the embedding's: no copy), the F32 norms in float32
    plan = native["weight_plan"]
    lines = {t["type"]: (t["held"], t["as"], t["tensors"]) for t in plan["types"]}
    kept = ("kept", "q4_1", 210) if kvk_here() is not None else ("kept", "int4-g32", 210)
    assert lines == {
        "Q4_1": kept,
        "Q8_0": ("kept", "q8_0", 1),
        "F32": ("dequantized", "float32", 61),
    }
    assert plan["head_copy_bytes"] == 0
    assert native["weight_bytes"] == plan["file_bytes"]  # Q4_1 in int4 groups is its 0.625 bytes too
    assert plan["file_bytes"] < default_gguf_path().stat().st_size  # the tensors, not the metadata
    assert dequantized["weight_bytes"] == dequantized["params"] * 4  # ~513 MiB, every tensor in float32
    # K/V in float16 at the file's bits (as llama.cpp keeps them), in float32 for the twin
    assert (native["kv_dtype"], dequantized["kv_dtype"]) == ("float16", "float32")
    assert native["kv_bytes_per_token"] * 2 == dequantized["kv_bytes_per_token"]
