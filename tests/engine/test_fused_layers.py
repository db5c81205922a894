"""The decoder layers in one C call (engine/model/fused_layers.py) compute what the own forward computes
op by op, to the last bit: logits, K/V, tokens, the step's kernel record; and it steps aside for
whatever it does not cover (a probe, a quantized pool)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import HEADS, HIDDEN, KV_HEADS, LAYERS, write_tiny_llama
from logit_rows import record_logit_rows
from tiny_models import IdTokenizer

from engine.bench.decode_split import decode_split
from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFailed, StepStats
from engine.kernels import native
from engine.kernels.policy import KernelPolicy
from engine.model.gguf_native import load_native
from engine.model.loaded import LoadedModel
from engine.request import Request

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="kvk is not built here")


def tiny_gguf(path, types=None):
    model, _ = load_native(write_tiny_llama(path, types), torch.float32, KernelPolicy(), lambda s, f: None)
    loaded = LoadedModel.from_model(model, IdTokenizer(256), name="tiny", source=str(path), scheme="native")
    loaded.policy.choose = lambda storage, rows: "kvk" if "kvk" in storage.kernels() else storage.kernels()[0]
    return loaded


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("fused") / "tiny.gguf")


PROMPTS = [[5 + i for i in range(30)], [7, 8, 9, 10], list(range(40, 52))]


def run(loaded, fused, config=None, observe=False, middles=None):
    """Every logits row by (sequence, position), each step's kernels and cost, the engine; with
    `middles` (a dict) the residual entering layer 1 at each of those rows lands in it."""
    stats = []
    engine = LLMEngine(
        loaded, config or EngineConfig(block_size=4, num_blocks=150, prefill_chunk_size=7), stats.append
    )
    if not fused:
        engine.runner.own_forward.fused = None
    if middles is not None:  # layer 1's input at every step (the engine sets it only for a drafter)
        engine.runner.own_forward.keep_middle = 1
        engine._keep_middle = lambda batch: None
    logits = record_logit_rows(engine, (lambda stage, hidden: None) if observe else None, middles)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params))
        for _ in range(i + 1):  # arrivals while others decode
            engine.step()
    while engine.has_work():
        engine.step()
    records = [(e.kernel, e.cost) for e in stats if isinstance(e, StepStats)]
    return logits, records, engine


@pytest.mark.parametrize(
    "types",
    [
        None,
        {"attn_v": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0},
        {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_0, "ffn_down": Q.Q4_0},
    ],
    ids=["one format", "formats side by side (as Q4_K_M's Q4_K and Q6_K)", "Q4_0 panels beside rows"],
)
@pytest.mark.parametrize("pool", ["float16", "float32"])  # a GGUF's own (auto_kv_dtype), and float32
def test_the_fused_layers_give_the_op_by_op_logits_bit_for_bit(tmp_path, types, pool):
    model = tiny_gguf(tmp_path / "tiny.gguf", types)
    model.info = dataclasses.replace(model.info, kv_dtype=pool)
    fused_logits, fused_records, engine = run(model, fused=True)
    assert engine.runner.own_forward.fused is not None, "a plain Llama on kvk runs fused"
    assert str(engine.storage.kv[0].dtype) == f"torch.{pool}"
    op_logits, op_records, _ = run(model, fused=False)
    assert fused_logits.keys() == op_logits.keys() and len(op_logits) == 3 * 12
    for key in op_logits:
        assert torch.equal(fused_logits[key], op_logits[key]), key
    assert fused_records == op_records  # the same kernels and weight bytes said for each step


def test_a_step_keeping_a_middle_layers_input_splits_the_call_and_keeps_the_same_bits(loaded):
    """The hidden-state drafter reads the residual entering a middle layer: fused, the layers
    run as two calls around it, and the logits and that residual are the op-by-op ones bit for
    bit; a row's residual is transformers' hidden state entering that layer there."""
    plain, _, _ = run(loaded, fused=True)
    middles: dict = {}
    fused_logits, _, engine = run(loaded, fused=True, middles=middles)
    op_middles: dict = {}
    op_logits, _, _ = run(loaded, fused=False, middles=op_middles)
    assert middles.keys() == op_middles.keys() == plain.keys()
    for key in plain:
        assert torch.equal(fused_logits[key], plain[key]) and torch.equal(op_logits[key], plain[key])
        assert torch.equal(middles[key], op_middles[key]), key
    prompt = PROMPTS[0]  # the first request's: the lowest sequence id
    with torch.inference_mode():
        out = loaded.model.model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    row = middles[(min(seq for seq, _ in middles), len(prompt) - 1)]
    # (kvk's panels quantize a step's activations: the residuals agree to ~1e-3 of their range)
    gaps = [float((row - h[0, -1]).abs().max() / h[0, -1].abs().max()) for h in out.hidden_states[:2]]
    assert gaps[1] < 2e-3 < 0.1 < gaps[0], gaps


def test_a_probe_or_an_int8_pool_runs_op_by_op(loaded, monkeypatch):
    from engine.model import fused_layers

    calls = []
    original = fused_layers.FusedLayers.run
    monkeypatch.setattr(
        fused_layers.FusedLayers, "run", lambda self, *a: calls.append(1) or original(self, *a)
    )
    run(loaded, fused=True)
    assert calls, "a plain step runs fused"
    calls.clear()
    run(loaded, fused=True, observe=True)
    run(loaded, fused=True, config=EngineConfig(block_size=4, num_blocks=150, kv_dtype="int8"))
    assert not calls


def test_the_decode_split_counts_the_fused_layers_parts(loaded):
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=150))
    split = decode_split(engine, list(range(5, 25)), 8)
    assert split["matmuls_ms"] > 0 and split["attention_ms"] > 0
    assert split["matmuls_ms"] + split["attention_ms"] + split["rest_of_forward_ms"] <= split["step_ms"]


def test_the_verify_step_split_counts_the_fused_layers_parts(loaded):
    from engine.bench.verify_step import verify_step_cost

    step = verify_step_cost(loaded, k=3, context=24, steps=4)
    for side in ("plain", "verify"):
        split = step["split_ms"][side]
        assert split["linears_ms"] > 0 and split["attention_ms"] > 0 and split["rest_ms"] < split["step_ms"]
    roof = step["roof"]
    if native.kernels().pair_product_rate(iterations=1) is None:  # no VNNI here: no panels
        assert "skipped" in roof
        return
    # Every projection of the tiny Llama (all Q4_1) is a panel weight, the tied head is not.
    hidden, kv = HIDDEN, HIDDEN // HEADS * KV_HEADS
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * (2 * hidden)
    assert roof["rows"] == 4 and roof["panel_macs_per_row"] == LAYERS * per_layer
    compute_ms = 4 * roof["panel_macs_per_row"] / roof["pair_products_per_s"] * 1e3
    assert roof["compute_floor_ms"] == pytest.approx(compute_ms)
    plain = step["split_ms"]["plain"]
    floor_ms = max(compute_ms, plain["linears_ms"])  # and no less than one row's read of the weights
    floor_step_ms = plain["step_ms"] - plain["linears_ms"] + floor_ms
    assert roof["floor_vs_plain"] == pytest.approx(floor_step_ms / plain["step_ms"])
    assert roof["floor_vs_plain"] >= 1.0


def test_a_layer_the_c_call_refuses_is_named_with_its_part(tmp_path):
    """All layers run in one C call; a layer it cannot run (here a projection of a type kvk does
    not take) fails the step with the layer and part named, not a later layer's garbage."""
    model = tiny_gguf(tmp_path / "tiny.gguf")
    events = []
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=150), events.append)
    fused = engine.runner.own_forward.fused
    assert fused is not None and len(fused.layers) > 1
    fused.layers[1].spec.o.part[0].t = 99  # no GGML type
    engine.add_request(Request(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=2)))
    while engine.has_work():
        engine.step()
    failed = [e for e in events if isinstance(e, RequestFailed)]
    assert len(failed) == 1 and "refused layer 1 (at its part 5)" in failed[0].message
