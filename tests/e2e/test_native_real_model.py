"""The packaged SmolLM2 at its own bits (Q4_1 layers, Q8_0 embedding and head) against its
dequantized float32 twin on the evaluation text: kvk's 16-bit activations leave the
distributions all but equal, the dense bfloat16 prefill kernel close; batched decoding equals
lone."""

from __future__ import annotations

import pytest

from engine.bench.quality import compare_logits, eval_token_ids
from engine.config import EngineConfig, ModelSpec, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.model.inspect import inspect_model
from engine.model.loading import load_model
from engine.model.logits import teacher_forced_logits
from engine.request import Request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def native():
    return load_model(ModelSpec("default", dtype="float32", device="cpu"))


def test_native_is_the_default_for_the_packaged_gguf_and_keeps_its_blocks(native):
    assert native.info.quantization == "native"
    assert native.info.notes[0] == "kept at their own bits: Q4_1 x210, Q8_0 x1"
    assert native.info.notes[1].startswith("GGUF kernels: kvk ")
    # ~92 MiB against 513: the file's blocks, the head reading the embedding's (one copy)
    assert native.info.weight_bytes < native.info.weight_bytes_before / 5
    head = native.model.lm_head
    assert [s.kind for s in head.storages()] == ["q8_0"]
    assert head.storage is native.model.model.embed_tokens.storage
    # the fit estimate the picker shows (no weights read) is the loaded figure, within the file's
    # metadata (the tokenizer's ~1.7 MB)
    estimate = inspect_model("default", dtype="float32")["weight_bytes"]
    # within 2% either way: on this tree the estimate came out 256 bytes under the load (96,576,768
    # against 96,577,024; not yet explained), where it used to be over
    assert abs(estimate - native.info.weight_bytes) < 0.02 * estimate


@pytest.mark.parametrize(
    ("kernel", "max_kl", "top1"),
    # kvk: each row as generation computes a new token (the file's blocks, activations in 16-bit
    # codes, the head in float32); measured on the 404 predictions: mean KL 3.3e-7, top-1
    # 100%. dense-bf16: a long prefill chunk through a bfloat16 matmul of the layer rounded to
    # bfloat16: mean KL 1.7e-4, top-1 99.0% (4 near-ties flip). One plane of 8 bits (llama.cpp's
    # activations) measured 2.1e-3 and 97.0%.
    [("kvk", 5e-6, 0.995), ("dense-bf16", 5e-4, 0.985)],
)
def test_native_q4_1_against_its_float32_twin_on_the_eval_text(
    native, default_loaded, monkeypatch, kernel, max_kl, top1
):
    ids = eval_token_ids(native.tokenizer)
    reference = teacher_forced_logits(default_loaded.model, ids)
    monkeypatch.setattr(
        native.policy,
        "choose",
        lambda storage, rows: kernel if kernel in storage.kernels() else storage.kernels()[0],
    )
    report = compare_logits(reference, teacher_forced_logits(native.model, ids), ids)
    assert report.mean_kl <= max_kl
    assert report.top1_agreement >= top1


def test_batched_native_decoding_equals_lone_native_decoding(native):
    prompts = ["Name three colours.", "Why is the sky blue?", "Write a haiku about rain."]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)

    def run(texts):
        events = []
        engine = LLMEngine(native, EngineConfig(), events.append)
        ids = [engine.add_request(Request.chat(t, sampling=params)) for t in texts]
        while engine.has_work():
            engine.step()
        done = {e.request_id: e.token_ids for e in events if isinstance(e, RequestFinished)}
        return [done[i] for i in ids]

    assert run(prompts) == [run([p])[0] for p in prompts]
