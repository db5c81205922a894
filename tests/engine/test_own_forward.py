"""kvscope's own forward (engine/model/llama_forward.py) against transformers' code, per family it
runs, with q/k/v and gate/up fused and with them split (mixed weight formats):

- the greedy tokens equal transformers' generate() and the logits equal those of transformers'
  modeling code through the same paged engine (same attention, same chunks), under prefill
  chunks of 1 and 7, prefix caching on and off, a pool small enough to preempt, prompts five
  sliding windows long;
- the comparison can fail: turning off each thing a family's description switches on (its norm's
  1 + weight, sandwich norms, q/k norms, multipliers, soft cap, NoPE layers, per-layer RoPE
  bases) moves the logits far beyond the tolerance;
- the observer sees transformers' residual stream, and `final_logits` of the last one is the
  step's logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from family_configs import VOCAB, tiny_model
from logit_rows import record_logit_rows
from test_family_parity import make_prompts
from tiny_models import IdTokenizer

import engine.kernels.linear as linear_module
from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFailed, RequestFinished
from engine.model import forward_families
from engine.model.forward_families import FAMILIES
from engine.model.layer_attention import AttentionSpec
from engine.model.llama_forward import EXECUTOR, forward_note, unsupported_reason
from engine.model.loaded import LoadedModel
from engine.request import Request

NEW = 8
ATOL, RTOL = 1e-5, 1e-5  # measured: at most 6.6e-6 apart on logits of magnitude ~6 (both paths fp32)

SETTINGS = {
    "chunk 7, block 5": EngineConfig(block_size=5, num_blocks=120, prefill_chunk_size=7),
    "chunk 1, block 1": EngineConfig(block_size=1, num_blocks=600, prefill_chunk_size=1),
    "prefix cache off": EngineConfig(block_size=4, num_blocks=150, enable_prefix_caching=False),
    "preemption": EngineConfig(block_size=4, num_blocks=20),
}
# "mixed": layer 0's q/k/v and layer 1's gate/up stay separate matmuls, as when one of them is not
# a kernel layer (a bitsandbytes or fp8 projection; projections in different GGUF formats, Q4_K_M's
# Q4_K and Q6_K, are stacked side by side instead: engine.kernels.linear.StackedLinear); Phi-3
# fuses its own projections.
CASES = [
    (f, v)
    for f in sorted(FAMILIES)
    for v in ("fused", "mixed")
    if not (v == "mixed" and FAMILIES[f].qkv_module)
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: see test_family_parity
    yield
    torch.set_num_threads(threads)


def load(model, mixed: bool) -> LoadedModel:
    if not mixed:
        return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")
    real, calls = linear_module.as_kernel_linear, []

    def some_not_kernel_layers(module, policy):
        # fuse_projections asks per projection, group by group: L0 q/k/v (calls 0-2), L0 gate/up
        # (3-4), L1 q/k/v (5-7), L1 gate/up (8-9); a group with one refusal stays apart
        calls.append(len(calls))
        return None if calls[-1] in (0, 8) else real(module, policy)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(linear_module, "as_kernel_linear", some_not_kernel_layers)
        return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{v}" for f, v in CASES])
def case(request):
    model_type, variant = request.param
    model = tiny_model(model_type)
    loaded = load(model, variant == "mixed")
    prompts = make_prompts()
    refs = []
    for p in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        refs.append(out[0, len(p) :].tolist())
    return model_type, variant, loaded, prompts, refs


def run(loaded, config, prompts, own=True, observer=None):
    """Greedy tokens per prompt, every logits row by (sequence, position), and the engine."""
    events = []
    engine = LLMEngine(loaded, config, events.append)
    if not own:
        engine.runner.own_forward = None  # transformers' modeling code through the same paged attention
    logits = record_logit_rows(engine, observer)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)))
        for _ in range(i + 1):  # arrivals while others decode
            if engine.has_work():
                engine.step()
    while engine.has_work():
        engine.step()
    failed = [e.message for e in events if isinstance(e, RequestFailed)]
    assert not failed, failed[0]
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    return [list(done[i].token_ids) for i in ids], logits, engine


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tokens_and_logits_equal_transformers(case, setting):
    model_type, variant, loaded, prompts, refs = case
    config = SETTINGS[setting]
    tokens, logits, engine = run(loaded, config, prompts)
    assert engine.runner.executor == EXECUTOR, engine.runner.executor
    if setting == "preemption":
        assert engine.scheduler.preemptions > 0, "the pool is small enough to preempt"
    assert tokens == refs, f"{model_type} ({variant}) under '{setting}'"
    _, theirs, _ = run(loaded, config, prompts, own=False)
    assert logits.keys() == theirs.keys()
    for key in logits:
        torch.testing.assert_close(logits[key], theirs[key], atol=ATOL, rtol=RTOL, msg=f"{model_type} {key}")


def test_mixed_formats_run_split_projections_and_the_notes_say_so(case):
    model_type, variant, loaded, _, _ = case
    note = loaded.info.notes[0]
    assert note.startswith(f"forward: {EXECUTOR}"), note
    engine = LLMEngine(loaded, SETTINGS["chunk 7, block 5"], lambda e: None)
    layers = engine.runner.own_forward.layers
    if variant == "mixed":
        assert [layer.qkv is None for layer in layers] == [True, False]
        assert [layer.gate_up is None for layer in layers] == [False, True]
        assert "q/k/v as separate matmuls in 1 of 2 layers (dense-fp32)" in note
        assert "gate/up as separate matmuls in 1 of 2 layers (dense-fp32)" in note
    else:
        assert all(layer.qkv is not None and layer.gate_up is not None for layer in layers)
        assert "separate matmuls" not in note


# What each switched-on part of a description is turned off to. The OLMo norm is absent: in float32
# it computes what Llama's does (they differ only in where the cast to a half dtype goes).
OFF = {
    "norm": "llama",
    "after_attention": None,
    "after_mlp": None,
    "qk_norm": False,
    "rope_switch": None,
    "embedding_multiplier": None,
    "residual_multiplier": None,
    "logits_divisor": None,
    "final_softcap": None,
}
# The brief's parts, each switched on by at least one family's tiny model.
MUST_BE_EXERCISED = {
    ("gemma", "norm"),
    ("gemma2", "after_attention"),
    ("gemma2", "after_mlp"),
    ("gemma2", "final_softcap"),
    ("gemma3_text", "qk_norm"),
    ("gemma3_text", "rope kinds"),
    ("granite", "embedding_multiplier"),
    ("granite", "residual_multiplier"),
    ("granite", "logits_divisor"),
    ("olmo2", "after_attention"),
    ("olmo2", "qk_norm"),
    ("qwen3", "qk_norm"),
    ("smollm3", "rope_switch"),
}


SCALARS = ("embedding_multiplier", "residual_multiplier", "logits_divisor", "final_softcap")


def mutants(model_type: str, config) -> list[str]:
    """The parts of the family's description its tiny model switches on (a scalar: one its config
    sets to something else than 1 or None)."""
    family = FAMILIES[model_type]
    names = [n for n, off in OFF.items() if getattr(family, n) not in (off, None, False, "olmo")]
    names = [n for n in names if n not in SCALARS or getattr(config, getattr(family, n)) not in (None, 1.0)]
    if family.rope_by_layer_type:
        names.append("rope kinds")
    return names


def test_every_part_of_the_descriptions_is_exercised_by_a_tiny_model():
    from family_configs import tiny_config

    exercised = {(t, name) for t in FAMILIES for name in mutants(t, tiny_config(t))}
    assert exercised >= MUST_BE_EXERCISED


@pytest.mark.parametrize("model_type", sorted({t for t, _ in MUST_BE_EXERCISED}))
def test_the_logits_depend_on_every_part_of_the_description(model_type, monkeypatch):
    """Turn each part off in kvscope's forward: its logits leave transformers' by far more than
    the tolerance (the soft cap and the logit divisor never change a greedy token, so the
    logits are what can show them)."""
    model = tiny_model(model_type)
    loaded = load(model, mixed=False)
    prompts = make_prompts()[:2]
    config = SETTINGS["chunk 7, block 5"]
    _, reference, _ = run(loaded, config, prompts, own=False)
    family = FAMILIES[model_type]
    for name in mutants(model_type, model.config):
        with monkeypatch.context() as m:
            if name == "rope kinds":  # every layer rotates with the first kind's base (Gemma 3: local)
                real = LLMEngine.__init__

                def one_kind(self, *args, real=real, **kwargs):
                    real(self, *args, **kwargs)
                    forward = self.runner.own_forward
                    forward.rope_functions = [forward.rope_functions[0]] * len(forward.rope_functions)

                m.setattr(LLMEngine, "__init__", one_kind)
            else:
                m.setitem(
                    forward_families.FAMILIES, model_type, dataclasses.replace(family, **{name: OFF[name]})
                )
            _, logits, engine = run(loaded, config, prompts)
        assert engine.runner.executor == EXECUTOR
        worst = max(float((logits[k] - reference[k]).abs().max()) for k in reference)
        assert worst > 100 * ATOL, f"{model_type}: turning off {name} moves the logits by only {worst:.1e}"


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "olmo2", "granite", "smollm3"])
def test_the_observer_sees_transformers_residual_stream(model_type):
    model = tiny_model(model_type)
    loaded = load(model, mixed=False)
    steps = []

    def observer(stage, hidden):
        if stage == 0:
            steps.append([])
        steps[-1].append(hidden.clone())

    prompt = make_prompts()[0]
    tokens, logits, engine = run(loaded, SETTINGS["chunk 7, block 5"], [prompt], observer=observer)
    layers = model.config.num_hidden_layers
    assert all(len(stages) == layers + 1 for stages in steps)
    last = steps[-1]  # the last decode step: one row, the position before the last token
    assert all(h.shape == (1, model.config.hidden_size) for h in last)
    forward = engine.runner.own_forward
    position = len(prompt) + NEW - 2
    (seq_id,) = {s for s, _ in logits}
    torch.testing.assert_close(forward.final_logits(last[-1])[0], logits[(seq_id, position)], atol=0, rtol=0)
    with torch.inference_mode():
        hidden = model(torch.tensor([prompt + tokens[0]]), output_hidden_states=True).hidden_states
    # transformers' hidden states: the embedding, each layer's output, the last one after the final norm
    for stage in range(layers):
        torch.testing.assert_close(last[stage][0], hidden[stage][0, position], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(
        forward.final_norm(last[-1])[0], hidden[layers][0, position], atol=ATOL, rtol=RTOL
    )


def test_a_prefill_chunk_without_logit_rows_shows_the_observer_empty_rows():
    loaded = load(tiny_model("llama"), mixed=False)
    seen = []
    run(loaded, EngineConfig(block_size=4, num_blocks=64, prefill_chunk_size=7), [list(range(3, 30))],
        observer=lambda stage, hidden: seen.append(hidden.shape[0]))  # fmt: skip
    assert seen[:3] == [0, 0, 0] and seen[-1] == 1


def test_observing_a_model_on_transformers_code_is_refused_in_one_line():
    loaded = load(tiny_model("gpt2"), mixed=False)
    engine = LLMEngine(loaded, SETTINGS["chunk 7, block 5"], lambda e: None)
    assert engine.runner.own_forward is None
    with pytest.raises(ValueError, match="needs kvscope's own forward; this model runs transformers'"):
        engine.runner.forward([], [], {}, observer=lambda stage, hidden: None)


def test_what_the_forward_cannot_run_goes_to_transformers_with_the_reason(monkeypatch):
    model = tiny_model("llama")
    loaded = load(model, mixed=False)
    assert unsupported_reason(model, loaded.attention) is None
    sinks = tuple(dataclasses.replace(a, sinks=True) for a in loaded.attention)
    assert "attends with sinks" in unsupported_reason(model, sinks)
    assert forward_note(model, sinks).startswith("forward: transformers' (layer 0 attends with sinks")
    other = dataclasses.replace(FAMILIES["llama"], decoder_layer="SomeOtherDecoderLayer")
    monkeypatch.setitem(forward_families.FAMILIES, "llama", other)
    reason = unsupported_reason(model)
    assert (
        reason
        == "its decoder layers are LlamaDecoderLayer, not the SomeOtherDecoderLayer its parity test covers"
    )
    engine = LLMEngine(loaded, SETTINGS["chunk 7, block 5"], lambda e: None)
    assert engine.runner.executor == f"transformers' ({reason})"
    assert (
        unsupported_reason(tiny_model("gpt2"))
        == "model type 'gpt2' is not one of kvscope's own forward's families"
    )
    assert AttentionSpec().sinks is False


def test_a_gguf_mixing_formats_in_a_layer_runs_the_own_forward_with_split_projections(tmp_path):
    """As in a Q4_K_M file (Q4_K and Q6_K in one layer): here v and up in Q8_0, the rest Q4_1, all
    kept at their bits. q/k/v and gate/up cannot be one matmul: each is a stack of the formats'
    matmuls (StackedLinear), and the own forward gives the logits of transformers' code over the same
    kernels."""
    from gguf import GGMLQuantizationType as Q
    from gguf_files import write_tiny_llama

    from engine.kernels.policy import KernelPolicy
    from engine.model.gguf_native import load_native

    path = write_tiny_llama(tmp_path / "mixed.gguf", {"attn_v": Q.Q8_0, "ffn_up": Q.Q8_0})
    model, report = load_native(path, torch.float32, KernelPolicy(), lambda stage, fraction: None)
    assert report.kept == {"Q4_1": 10, "Q8_0": 1 + 4} and set(report.dequantized) == {"F32"}  # the norms
    loaded = LoadedModel.from_model(model, IdTokenizer(256), name="mixed", source=str(path), scheme="native")
    # the forward's structure is the subject: both codes on kvk at every row count (a dense bfloat16
    # matmul, which the measured table may pick for a prefill chunk, would add its own rounding)
    loaded.policy.choose = lambda storage, rows: "kvk" if "kvk" in storage.kernels() else storage.kernels()[0]
    # A float32 pool (a GGUF's own is float16): with float16 K/V one of these random prompts meets
    # a near-tie (top-2 margin 2.6e-5, under the two forwards' ~1e-4), and the tokens compared
    # below part there; the subject here is the split projections, not the pool.
    loaded.info = dataclasses.replace(loaded.info, kv_dtype="float32")
    note = loaded.info.notes[0]
    assert note == f"forward: {EXECUTOR} (Llama)"
    attn = loaded.model.model.layers[0].self_attn
    assert [p.storage.kind for p in attn.qkv_proj.linear.parts] == ["q4_1", "q8_0"]  # q+k, then v
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 4, 12)]
    config = SETTINGS["chunk 7, block 5"]
    tokens, logits, engine = run(loaded, config, prompts)
    assert engine.runner.executor == EXECUTOR
    their_tokens, theirs, _ = run(loaded, config, prompts, own=False)
    assert tokens == their_tokens
    # kvk rounds each layer's input to 16-bit codes: the two codes' inputs differ in their last
    # float32 bits (the own forward on kvk runs its norms and RoPE in C, layer_ops.c, summing in
    # its own order), which can move an activation across a rounding boundary, one step of its
    # block's 16-bit range: ~1e-4 on these logits
    for key in logits:
        torch.testing.assert_close(logits[key], theirs[key], atol=3e-4, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_norm_equals_the_family_s_own_module_bit_for_bit(dtype):
    """Llama's, OLMo's and Gemma's RMSNorms differ in where the weight meets the cast: in half
    precision too, each norm the forward computes (its placed norms, q/k norms, the final norm) is
    the module's output exactly."""
    from engine.model.llama_forward import _Plan

    g = torch.Generator().manual_seed(0)
    for model_type, family in FAMILIES.items():
        model = tiny_model(model_type).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # norm weights away from their 1 (or Gemma's 0)
                    p.add_((torch.randn(p.shape, generator=g) * 0.3).to(dtype))
        plan = _Plan(model, None)
        pairs = [(plan.final_norm, model.model.norm)]
        for layer, module in zip(plan.layers, model.model.layers):
            places = ("before_attention", "after_attention", "before_mlp", "after_mlp")
            pairs += [
                (getattr(layer, p), getattr(module, getattr(family, p))) for p in places if getattr(family, p)
            ]
            if layer.q_norm is not None:
                pairs += [(layer.q_norm, module.self_attn.q_norm), (layer.k_norm, module.self_attn.k_norm)]
        for norm, module in pairs:
            x = (torch.randn(5, module.weight.numel(), generator=g) * 3).to(dtype)
            with torch.inference_mode():
                assert torch.equal(norm(x), module(x)), (model_type, dtype, type(module).__name__)


def test_static_rope_rows_looked_up_are_the_rotary_s_own_bit_for_bit():
    from engine.model.llama_forward import _rope_table, _RopeRows, static_rope

    model = tiny_model("llama")
    rotary = model.model.rotary_emb
    assert static_rope(rotary)
    rows = _RopeRows(rotary)
    x = torch.zeros(3, model.config.hidden_size)
    g = torch.Generator().manual_seed(0)
    for positions in (torch.tensor([5]), torch.randint(0, 300, (7,), generator=g), torch.tensor([1000, 3])):
        got, want = rows(x, positions), _rope_table(rotary, x, positions)
        assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin)
    assert rows.table is not None and rows.table.cos.shape[0] == 1024  # grown past position 1000
    rotary.rope_type = "dynamic"  # its rows depend on the sequence's length: computed each step
    assert not static_rope(rotary)
