"""The views of the model's inside, on tiny random models whose numbers transformers checks:
- the logit lens: the residual stream per layer is transformers' hidden states, and its last layer
  read through the head is the logits the token was drawn from (kept by the step: bit for bit on
  kvscope's own forward here, within float32 rounding through transformers' code; else the
  replay's own, bit for bit);
- attention per head: every head's weights over the positions the step attended sum to 1 and are
  transformers' eager `output_attentions` for the same token, on kvk and on torch, with sliding
  windows (the view starts where the window does), soft caps and sinks;
- expert routes: the router's own top-k, as a plain transformers forward routes the same tokens;
- prompt log-probs: transformers' log-softmax of the prompt's logits, in float32 to 1e-5;
- steering: the same as a transformers forward whose layer output gets the direction added;
and what each refuses, in one line."""

from __future__ import annotations

import math

import pytest
import torch
from family_configs import VOCAB, WINDOW, tiny_model
from tiny_models import IdTokenizer

from engine.config import EngineConfig, SamplingParams
from engine.core.experts import expert_routes
from engine.core.inside_token import inside_token
from engine.core.kept_logits import KeptLogits
from engine.core.llm_engine import LLMEngine
from engine.core.scoring import score_ids
from engine.core.steering import contrast_vector, steer
from engine.errors import InspectionError
from engine.inside import REPLAY_LOGITS, STEP_LOGITS, ControlVector
from engine.kernels import native
from engine.model import row_attention
from engine.model.attention_probs import KVK_KERNEL, TORCH_KERNEL
from engine.model.control_vector import read_control_vector, write_control_vector
from engine.model.layer_hooks import decoder_layers
from engine.model.llama_forward import EXECUTOR
from engine.model.loaded import LoadedModel
from engine.request import Request

CONFIG = EngineConfig(block_size=4, num_blocks=128, prefill_chunk_size=8)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, snapshot_top_n=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_LOADED: dict[str, LoadedModel] = {}


def loaded_family(model_type: str) -> LoadedModel:
    if model_type not in _LOADED:
        model = tiny_model(model_type)
        _LOADED[model_type] = LoadedModel.from_model(
            model, IdTokenizer(VOCAB), name=model_type, source="test"
        )
    return _LOADED[model_type]


def prompt(n: int = 21, seed: int = 3) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(loaded: LoadedModel, ids: list[int], config: EngineConfig = CONFIG):
    core = LLMEngine(loaded, config)
    request = Request(prompt_token_ids=tuple(ids), sampling=GREEDY)
    (end,) = core.run([request])
    return core, request, list(end.token_ids)


def eager(model, ids: list[int]):
    """transformers' own forward with eager attention: attentions and hidden states per layer."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            return model(
                torch.tensor([ids]), output_attentions=True, output_hidden_states=True, use_cache=False
            )
    finally:
        model.config._attn_implementation = previous


# ---- the logit lens ---------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen2_moe", "gpt2"])
def test_the_lens_reads_transformers_residual_stream_and_its_last_layer_is_the_models_logits(model_type):
    loaded = loaded_family(model_type)
    core, request, out = generate(loaded, prompt())
    index = 3
    inside = inside_token(core, request, out[:index], out[index], top_k=5)
    lens = inside.lens
    assert lens is not None and inside.lens_unavailable == ""
    assert len(lens.layers) == loaded.info.num_layers + 1
    # the last stage read through the head is what the token was drawn from (the step's kept
    # logits): to the bit on kvscope's own forward; through transformers' code the replayed
    # context's K/V come out of other chunkings than the reply's steps, within float32 rounding
    assert lens.gap_against == STEP_LOGITS
    if inside.executor == EXECUTOR:
        assert lens.last_gap == 0.0
    else:
        assert 0.0 <= lens.last_gap < 1e-5
    kept = core.kept_logits.get([*request.prompt_token_ids, *out[:index]])
    top = int(kept.argmax())
    assert lens.layers[-1].top.ids[0] == top == out[index]  # greedy: the drawn token leads at the end
    assert lens.layers[-1].token_rank == 1
    assert lens.layers[-1].token_prob == pytest.approx(float(torch.softmax(kept, -1)[top]), abs=1e-6)
    assert lens.first_lead == next(layer.stage for layer in lens.layers if layer.token_rank == 1)
    # every stage but the last is transformers' hidden state there, read through the final norm and head
    reference = eager(loaded.model, [*request.prompt_token_ids, *out[:index]])
    norm_and_head = _head(loaded.model)
    for stage in range(loaded.info.num_layers):
        with torch.inference_mode():
            want = torch.softmax(norm_and_head(reference.hidden_states[stage][0, -1:]).float(), -1)[0]
        got = lens.layers[stage]
        assert got.token_prob == pytest.approx(float(want[out[index]]), abs=1e-5), stage
        assert got.top.ids[0] == int(want.argmax()), stage
    assert float(torch.softmax(reference.logits[0, -1], -1)[out[index]]) == pytest.approx(
        lens.layers[-1].token_prob, abs=1e-5
    )


def _head(model):
    """The family's final norm and head as transformers applies them to the last hidden state."""
    if model.config.model_type == "gemma2":
        cap = model.config.final_logit_softcapping
        return lambda h: torch.tanh(model.lm_head(model.model.norm(h)) / cap) * cap
    decoder, _ = decoder_layers(model)
    norm = getattr(decoder, "norm", None) or decoder.ln_f
    return lambda h: model.get_output_embeddings()(norm(h))


def test_without_the_steps_kept_logits_the_lens_is_checked_against_the_replays():
    loaded = loaded_family("llama")
    core, request, out = generate(loaded, prompt())
    core.kept_logits = KeptLogits(0)  # nothing kept: the step's logits are gone
    lens = inside_token(core, request, out[:3], out[3]).lens
    assert lens is not None and lens.gap_against == REPLAY_LOGITS and lens.last_gap == 0.0
    assert lens.layers[-1].top.ids[0] == out[3]


def test_a_lens_of_the_first_reply_token_reads_the_prompts_last_row():
    loaded = loaded_family("llama")
    core, request, out = generate(loaded, prompt(9))
    inside = inside_token(core, request, [], out[0])
    assert inside.context_tokens == 9 and inside.attention.query_position == 8
    assert inside.lens.layers[-1].top.ids[0] == out[0]
    # the prompt's full blocks come from the prefix cache as the request's prefill wrote them
    assert inside.reused_tokens == 8 and inside.recomputed_tokens == 1
    assert inside.executor.startswith(EXECUTOR)


# ---- attention per head -------------------------------------------------------------------------
ATTENTION_FAMILIES = [
    "llama",  # GQA
    "mistral",  # a sliding window of 8 over a longer context
    "gemma2",  # logit soft-capping, a sliding layer
    "gpt_oss",  # sinks, a sliding layer
    "qwen2_moe",  # transformers' code (a MoE) through the same paged attention
]


@pytest.mark.parametrize("kernel", ["kvk", "torch"])
@pytest.mark.parametrize("model_type", ATTENTION_FAMILIES)
def test_each_heads_attention_is_transformers_eager_attention_of_the_same_token(
    model_type, kernel, monkeypatch
):
    if kernel == "kvk" and native.kernels() is None:
        pytest.skip("no kvk build here")
    if kernel == "torch":
        monkeypatch.setattr(row_attention.native, "kernels", lambda: None)
    loaded = loaded_family(model_type)
    core, request, out = generate(loaded, prompt(21))
    index = 4
    inside = inside_token(core, request, out[:index], out[index])
    attention = inside.attention
    assert attention.kernel == (KVK_KERNEL if kernel == "kvk" else TORCH_KERNEL)
    context = [*request.prompt_token_ids, *out[:index]]
    assert attention.token_ids == tuple(context) and attention.query_position == len(context) - 1
    reference = eager(loaded.model, context)
    windows = set()
    for layer in attention.layers:
        want = reference.attentions[layer.layer][0, :, -1, :].float()  # [heads, context]
        got = torch.tensor(layer.probs)
        assert got.shape == (loaded.info.num_heads, len(context) - layer.start)
        assert torch.allclose(got, want[:, layer.start :], atol=1e-5), layer.layer
        assert float(want[:, : layer.start].abs().sum()) == 0.0  # nothing before the window
        sums = got.sum(-1)
        if layer.sinks:  # a sink takes its share and gives no value
            assert bool((sums < 1.0).all())
            assert layer.sink_mass(0) == pytest.approx(1.0 - float(sums[0]), abs=1e-6)
        else:
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
        if layer.window is not None:
            windows.add(layer.window)
            assert layer.start == len(context) - layer.window
    if model_type in ("mistral", "gemma2", "gpt_oss"):
        assert windows == {WINDOW}
    # the blocks the row read: its table's, the window's only on a sliding layer
    bs = CONFIG.block_size
    assert len(attention.block_ids) == -(-len(context) // bs)
    for layer in attention.layers:
        assert len(attention.blocks_read(layer.layer)) == (len(context) - 1) // bs - layer.start // bs + 1


# ---- expert routes ------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe", "granitemoe", "gpt_oss", "phimoe"])
def test_routes_are_the_routers_top_k_as_transformers_routes_the_same_tokens(model_type):
    loaded = loaded_family(model_type)
    core, request, out = generate(loaded, prompt(13))
    routes = expert_routes(core, request, out)
    tokens = [*request.prompt_token_ids, *out]
    assert routes.token_ids == tuple(tokens) and routes.reply_start == 13
    # the reference: the same model's routers in a plain transformers forward (no paged attention)
    seen: dict[int, tuple] = {}
    handles = []
    from engine.model.routers import routers

    for layer, router in routers(loaded.model).items():
        handles.append(router.register_forward_hook(lambda m, a, o, layer=layer: seen.__setitem__(layer, o)))
    try:
        with torch.inference_mode():
            loaded.model(torch.tensor([tokens]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert routes.moe_layers == tuple(sorted(seen))
    for i, layer in enumerate(routes.moe_layers):
        logits, weights, experts = seen[layer]
        for p in range(len(tokens)):
            route = routes.routes[p][i]
            assert list(route.experts) == experts[p].tolist(), (layer, p)
            assert route.weights == pytest.approx(weights[p].float().tolist(), abs=1e-5)
            # the router's top-k: the experts its logits rank highest
            top = set(logits[p].float().topk(routes.top_k).indices.tolist())
            if model_type not in (
                "phimoe",
            ):  # Phi-MoE's sparsemixer samples its second expert by a jitter mask
                assert set(route.experts) == top, (layer, p)
        assert sum(routes.load[i]) == len(out) * routes.top_k
    assert (
        routes.num_experts == max(max(r.experts) for row in routes.routes for r in row) + 1
        or routes.num_experts >= 4
    )


def test_a_dense_model_has_no_expert_routes():
    loaded = loaded_family("llama")
    core, request, out = generate(loaded, prompt(5))
    with pytest.raises(InspectionError, match="is not a mixture of experts"):
        expert_routes(core, request, out)


# ---- prompt log-probs ---------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2_moe"])
def test_prompt_logprobs_are_transformers_log_softmax_of_the_prompts_logits(model_type):
    loaded = loaded_family(model_type)
    core = LLMEngine(loaded, CONFIG)  # prefill chunks of 8: the text runs in several forwards
    ids = prompt(30, seed=5)
    score = score_ids(core, ids, top_k=3)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids]), use_cache=False).logits[0].float()
    want = torch.log_softmax(logits, -1)
    assert score.tokens[0].logprob is None and score.tokens[0].rank is None
    assert score.scored == len(ids) - 1
    for p in range(1, len(ids)):
        token = score.tokens[p]
        assert token.token_id == ids[p]
        assert token.logprob == pytest.approx(float(want[p - 1, ids[p]]), abs=1e-5)
        assert token.rank == int((want[p - 1] > want[p - 1, ids[p]]).sum()) + 1
        assert list(token.top.ids) == want[p - 1].topk(3).indices.tolist()
    total = float(sum(want[p - 1, ids[p]] for p in range(1, len(ids))))
    assert score.total_logprob == pytest.approx(total, abs=1e-4)
    assert score.perplexity == pytest.approx(math.exp(-total / (len(ids) - 1)), rel=1e-5)
    assert core.kv.pool.num_used == 0  # the scoring's blocks are back in the pool


def test_a_text_longer_than_the_context_is_refused_with_its_count():
    loaded = loaded_family("llama")
    core = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=128, max_model_len=32))
    with pytest.raises(InspectionError, match="The text is 40 tokens but the model's context holds 32"):
        score_ids(core, prompt(40))


# ---- steering -----------------------------------------------------------------------------------
def random_vector(loaded: LoadedModel, layers: tuple[int, ...], seed: int = 1) -> ControlVector:
    g = torch.Generator().manual_seed(seed)
    hidden = loaded.info.hidden_size
    directions = tuple(tuple((torch.randn(hidden, generator=g) * 2.0).tolist()) for _ in layers)
    return ControlVector("random", layers, directions, "test")


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe"])
def test_steering_is_a_transformers_forward_with_the_direction_added_after_the_layer(model_type):
    loaded = loaded_family(model_type)
    core, request, out = generate(loaded, prompt(11))
    vector = random_vector(loaded, (0, 1))
    result = steer(core, request, out[:2], vector, layer=0, strength=1.5, top_n=5)
    context = [*request.prompt_token_ids, *out[:2]]
    _, layers = decoder_layers(loaded.model)
    direction = torch.tensor(vector.directions[0]) * 1.5

    def add(_module, _args, output):
        return (
            output + direction if isinstance(output, torch.Tensor) else (output[0] + direction, *output[1:])
        )

    handle = layers[0].register_forward_hook(add)
    try:
        with torch.inference_mode():
            steered = loaded.model(torch.tensor([context]), use_cache=False).logits[0, -1].float()
    finally:
        handle.remove()
    with torch.inference_mode():
        plain = loaded.model(torch.tensor([context]), use_cache=False).logits[0, -1].float()
    want, plain_p = torch.softmax(steered, -1), torch.softmax(plain, -1)
    assert list(result.steered.ids) == want.topk(5).indices.tolist()
    assert result.steered.probs == pytest.approx(want.topk(5).values.tolist(), abs=1e-5)
    assert list(result.plain.ids) == plain_p.topk(5).indices.tolist()
    assert result.kl > 0.0
    # strength 0 moves nothing, and the steered K/V never entered the prefix cache
    still = steer(core, request, out[:2], vector, layer=None, strength=0.0)
    assert still.steered == still.plain and still.kl == pytest.approx(0.0, abs=1e-6)
    assert core.kv.pool.num_used == 0


def test_a_control_vector_file_round_trips_and_a_wrong_one_is_refused(tmp_path):
    loaded = loaded_family("llama")
    core, request, out = generate(loaded, prompt(7))
    vector = random_vector(loaded, (1,))
    path = tmp_path / "happy.gguf"
    write_control_vector(vector, path)
    back = read_control_vector(path)
    assert back.layers == (1,) and back.directions[0] == pytest.approx(vector.directions[0])
    assert steer(core, request, out, back, 1, 1.0).kl > 0.0
    wide = ControlVector("wide", (1,), ((0.5,) * (loaded.info.hidden_size + 1),), "test")
    with pytest.raises(InspectionError, match=r"is 65 wide, but this model's residual stream is 64"):
        steer(core, request, out, wide, None, 1.0)
    deep = random_vector(loaded, (1, 5))
    with pytest.raises(InspectionError, match=r"directions for layer 5, but this model has 2 layers"):
        steer(core, request, out, deep, None, 1.0)
    with pytest.raises(InspectionError, match="no direction for layer 0"):
        steer(core, request, out, vector, 0, 1.0)
    (tmp_path / "not.gguf").write_bytes(b"hello")
    with pytest.raises(InspectionError, match="not.gguf is not a GGUF file"):
        read_control_vector(tmp_path / "not.gguf")
    with pytest.raises(InspectionError, match="no control vector file"):
        read_control_vector(tmp_path / "missing.gguf")


def test_a_contrast_vector_is_the_difference_of_the_two_prompts_residual_streams():
    loaded = loaded_family("llama")
    core = LLMEngine(loaded, CONFIG)
    core.tokenizer = _TextTokenizer()
    a, b = "happy days", "sad nights"
    vector = contrast_vector(core, a, b)
    assert vector.layers == (0, 1) and vector.width == loaded.info.hidden_size
    ha = eager(loaded.model, core.tokenizer(a)["input_ids"]).hidden_states
    hb = eager(loaded.model, core.tokenizer(b)["input_ids"]).hidden_states
    # after layer 0: transformers' hidden state 1 (the last one is after the final norm)
    assert vector.directions[0] == pytest.approx((ha[1][0, -1] - hb[1][0, -1]).tolist(), abs=1e-5)


class _TextTokenizer(IdTokenizer):
    def __init__(self):
        super().__init__(VOCAB)

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


# ---- bad input ----------------------------------------------------------------------------------
def test_a_token_outside_the_vocabulary_or_the_context_is_refused_in_one_line():
    loaded = loaded_family("llama")
    core = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=128, max_model_len=16))
    request = Request(prompt_token_ids=tuple(prompt(8)), sampling=GREEDY)
    with pytest.raises(InspectionError, match=f"token {VOCAB + 5} is outside the model's vocabulary"):
        inside_token(core, request, [VOCAB + 5], 3)
    with pytest.raises(InspectionError, match="20 tokens do not fit in the model's context of 16"):
        inside_token(core, request, prompt(12), 3)
    with pytest.raises(InspectionError, match="outside the model's vocabulary"):
        inside_token(core, request, [], -1)


def test_a_pool_with_no_room_says_so():
    loaded = loaded_family("llama")
    core = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=4))
    request = Request(prompt_token_ids=tuple(prompt(8)), sampling=GREEDY)
    core.add_request(
        Request(prompt_token_ids=tuple(prompt(12, seed=9)), sampling=SamplingParams(max_new_tokens=2))
    )
    core.step()  # the running request holds 3 of the 4 blocks
    with pytest.raises(InspectionError, match="the KV pool has 1 free blocks and this needs 2"):
        inside_token(core, request, [], 3)
