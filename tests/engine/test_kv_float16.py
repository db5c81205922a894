"""A GGUF kept at its own bits keeps its K/V in float16 (engine.shapes.auto_kv_dtype): the pool,
every estimate of its size and the quality comparisons agree on it; a float32 model keeps float32."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from gguf_files import write_tiny_llama
from tiny_models import IdTokenizer

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.kernels import native
from engine.kernels.policy import KernelPolicy
from engine.model.gguf_native import load_native
from engine.model.inspect import inspect_model
from engine.model.loaded import LoadedModel
from engine.request import Request
from engine.shapes import auto_kv_dtype, kv_bytes_per_token


def test_auto_is_float16_only_for_own_bits_computed_in_float32():
    assert auto_kv_dtype("float32", native_bits=True) == "float16"
    assert auto_kv_dtype("float32", native_bits=False) == "float32"  # parity with transformers
    assert auto_kv_dtype("bfloat16", native_bits=True) == "bfloat16"
    assert kv_bytes_per_token(30, 3, 64, "float32", "float16") == kv_bytes_per_token(30, 3, 64, "float16")
    assert kv_bytes_per_token(30, 3, 64, "float32", "float16") * 2 == kv_bytes_per_token(30, 3, 64, "float32")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("kv16") / "tiny.gguf")
    model, _ = load_native(path, torch.float32, KernelPolicy(), lambda s, f: None)
    return path, LoadedModel.from_model(
        model, IdTokenizer(256), name="tiny", source=str(path), scheme="native"
    )


def test_a_gguf_at_its_own_bits_keeps_float16_kv_and_says_so(gguf):
    path, loaded = gguf
    info = loaded.info
    assert (info.dtype, info.kv_dtype, info.kv_stored_as("auto"), info.kv_stored_as("int8")) == (
        "float32",
        "float16",
        "float16",
        "int8",
    )
    half = kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, "float16")
    assert info.kv_bytes_per_token == half
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=40))
    assert all(pair.dtype == torch.float16 for pair in engine.storage.kv)
    assert engine.storage.bytes_per_block == 4 * half
    # the estimate before a load counts the pool the load will make
    if native.kernels() is not None:  # (without kvk the file is not kept at its bits here)
        assert inspect_model(str(path), context=100)["kv_bytes_per_token"] == half
    # int8 stays what it was asked to be
    int8 = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=40, kv_dtype="int8"))
    assert int8.storage.kv[0].dtype == torch.int8


def test_a_float32_model_keeps_a_float32_pool(tiny_loaded):
    info = tiny_loaded.info
    assert (info.dtype, info.kv_dtype, tiny_loaded.kv_dtype_for("auto")) == ("float32", "float32", "auto")
    engine = LLMEngine(tiny_loaded, EngineConfig(block_size=4, num_blocks=40))
    assert engine.storage.kv[0].dtype == torch.float32


def test_the_float16_pool_holds_the_float32_values_rounded(gguf):
    """What the pool holds after a reply is its K/V as a float32 pool would hold them, rounded to
    float16: the same computation, only the storage's precision (greedy tokens the same here)."""
    _, loaded = gguf
    prompt = Request(
        prompt_token_ids=tuple(range(5, 25)), sampling=SamplingParams(temperature=0.0, max_new_tokens=6)
    )
    replies, pools = [], []
    for stored in ("float16", "float32"):
        subject = dataclasses.replace(loaded, info=dataclasses.replace(loaded.info, kv_dtype=stored))
        engine = LLMEngine(subject, EngineConfig(block_size=4, num_blocks=40, enable_prefix_caching=False))
        (end,) = engine.run([prompt])
        replies.append(end.token_ids)
        pools.append(engine.storage.kv[0][:, :6].clone())  # the first layer's first blocks
    assert replies[0] == replies[1]
    assert pools[0].dtype == torch.float16 and pools[1].dtype == torch.float32
    # layer 0's K/V come from the embeddings alone: the float32 values, rounded to nearest even
    assert torch.equal(pools[0], pools[1].to(torch.float16))


def test_float16_can_be_asked_for_whatever_the_model(tiny_loaded):
    """--kv-dtype float16 on a float32 model: half the pool, its K/V the float32 ones rounded."""
    from engine.cli.args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--kv-dtype", "float16"]).kv_dtype == "float16"
    info = tiny_loaded.info
    assert info.kv_stored_as("float16") == "float16" and info.kv_stored_as("auto") == "float32"
    prompt = Request(
        prompt_token_ids=tuple(range(5, 25)), sampling=SamplingParams(temperature=0.0, max_new_tokens=4)
    )
    pools = {}
    for kv in ("auto", "float16"):
        engine = LLMEngine(tiny_loaded, EngineConfig(block_size=4, num_blocks=40, kv_dtype=kv))
        (end,) = engine.run([prompt])
        assert len(end.token_ids) == 4
        pools[kv] = engine.storage
    assert pools["float16"].kv[0].dtype == torch.float16
    assert pools["float16"].bytes_per_block * 2 == pools["auto"].bytes_per_block
    assert torch.equal(pools["float16"].kv[0][:, :5], pools["auto"].kv[0][:, :5].to(torch.float16))
