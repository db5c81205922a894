"""The fit estimate is what the load does: engine.model.gguf_plan says per GGUF tensor type what a
native load holds (kept at its bits as which storage, or dequantized to which dtype, and the LM
head's extra copy), the loader decides through the same table, and the estimate is held against
real loads of the packaged model and of K-quant files (whatever the loader keeps today), together
with the process's memory, whose runtime part is measured."""

from __future__ import annotations

import gc

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import KQUANT_HIDDEN, VOCAB, write_kquant_llama

from engine.config import EngineConfig, ModelSpec
from engine.core.service import Engine
from engine.events import MemorySample, ModelLoaded
from engine.model import gguf_plan, loading
from engine.model.inspect import inspect_model
from engine.model.runtime_memory import give_back_freed_memory, runtime_estimate

MIB = 2**20
POOL = 64 * MIB
TOLERANCE = 0.10


@pytest.fixture
def kquant_files(tmp_path):
    tied = write_kquant_llama(tmp_path / "tiny-Q4_K_M.gguf")
    untied = write_kquant_llama(
        tmp_path / "tiny-Q2_K-Q3_K-Q5_K.gguf",
        {"attn_q": Q.Q5_K, "attn_k": Q.Q3_K, "attn_v": Q.Q2_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_K},
        embedding_type=Q.Q8_0,
        output_type=Q.Q6_K,
    )
    return tied, untied


@pytest.fixture
def any_tokenizer(monkeypatch, default_tokenizer):
    """The tiny files carry no tokenizer: loads take the packaged model's (the weights are what
    these tests weigh)."""
    original = loading._load_tokenizer
    monkeypatch.setattr(
        loading, "_load_tokenizer", lambda src: default_tokenizer if src.kind == "gguf" else original(src)
    )


def lines_of(plan) -> dict[str, tuple[str, str, int]]:
    return {line.ggml_type: (line.kind, line.held_as, line.tensors) for line in plan.lines}


def test_the_plan_says_per_type_what_a_native_load_holds(kquant_files):
    tied, untied = kquant_files
    plan = gguf_plan.plan_file(tied, "float32")
    assert lines_of(plan) == {
        "Q4_K": ("kept", "int4-g32", 10),  # q, k, o, gate, up of 2 layers
        "Q6_K": ("dequantized", "float32", 5),  # v, down of 2 layers and the embedding
        "F32": ("dequantized", "float32", 5),  # the norms
    }
    assert plan.head_copy_bytes == 0  # tied to a dequantized embedding: the head is that tensor
    q4k = next(line for line in plan.lines if line.ggml_type == "Q4_K")
    # int4 groups of 32: half a byte a weight and a bfloat16 scale and zero per group
    assert q4k.held_bytes == q4k.file_bytes // 144 * 256 * 5 // 8
    plan = gguf_plan.plan_file(untied, "bfloat16")
    assert lines_of(plan)["Q8_0"] == ("kept", "q8_0", 1)  # the embedding's blocks, looked up as they are
    assert lines_of(plan)["Q6_K"] == ("dequantized", "bfloat16", 1)  # the head, dequantized
    assert plan.head_copy_bytes == 0  # a dense head needs no copy
    # the transformers path: every tensor in the dtype
    assert {
        kind for kind, _, _ in lines_of(gguf_plan.plan_file(untied, "float32", native=False)).values()
    } == {"dequantized"}


def test_a_q8_0_head_counts_its_per_row_copy(tmp_path):
    path = write_kquant_llama(tmp_path / "q8-head.gguf", embedding_type=Q.Q8_0)
    plan = gguf_plan.plan_file(path, "float32")
    assert plan.head_copy_bytes == (
        gguf_plan.per_row_int8_bytes(VOCAB, KQUANT_HIDDEN) if "q8_0" in gguf_plan.HEAD_COPIES else 0
    )


def load(source: str) -> tuple[ModelLoaded, MemorySample]:
    events: list = []
    engine = Engine(
        EngineConfig(model=ModelSpec(source, "float32", "cpu"), kv_budget_bytes=POOL), sink=events.append
    )
    engine.start()
    try:
        assert engine.wait_until_loaded(600) is not None, engine.load_error
    finally:
        engine.shutdown()
    loaded = next(e for e in events if isinstance(e, ModelLoaded))
    memory = next(e for e in events if isinstance(e, MemorySample))
    return loaded, memory


def assert_close(estimated: int, measured: int, what: str) -> None:
    assert abs(estimated - measured) <= TOLERANCE * measured, (
        f"{what}: estimated {estimated / MIB:.1f} MiB, measured {measured / MIB:.1f} MiB"
    )


def estimate_then_load(source: str) -> None:
    # the engine before is gone (the app collects a replaced engine before the next load)
    gc.collect()
    give_back_freed_memory()
    est = inspect_model(source, dtype="float32")
    runtime = runtime_estimate()
    loaded, memory = load(source)
    process = runtime.process_with(est["weight_bytes"] + POOL)
    print(  # shown with -s: the figures the app puts side by side
        f"{source}: weights {est['weight_bytes'] / MIB:.1f} -> {loaded.info.weight_bytes / MIB:.1f} MiB, "
        f"process {process / MIB:.0f} -> {memory.process_bytes / MIB:.0f} MiB"
    )
    assert_close(est["weight_bytes"], loaded.info.weight_bytes, f"{source}: weights")
    # the process: the measured runtime beside the planned weights and the pool asked for
    assert_close(process, memory.process_bytes, f"{source}: process")


def test_the_weights_estimate_holds_for_k_quant_files(kquant_files, any_tokenizer):
    for path in kquant_files:
        est = inspect_model(str(path), dtype="float32")
        loaded, _ = load(str(path))
        assert_close(est["weight_bytes"], loaded.info.weight_bytes, path.name)
        assert est["weights_as"] == "native"


@pytest.mark.slow
def test_estimate_and_measured_within_10_percent_for_the_packaged_model_and_k_quant_files(
    kquant_files, any_tokenizer
):
    """Weights and the whole process, as the app shows them side by side after a load: the
    packaged model (loaded once first, so the runtime is this process's, measured), then the
    K-quant files beside the same runtime."""
    load("default")
    estimate_then_load("default")
    for path in kquant_files:
        estimate_then_load(str(path))
