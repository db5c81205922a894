"""Every family kvscope serves gives transformers' own greedy tokens, under every setting of the
engine parity tests (block sizes 1..16, prefill chunks of 1 and 7, prefix cache on and off, a
tight token budget, one sequence at a time), with prompts that run far past a sliding window.

And the test can fail: per family, a paged attention that forgot the history, the sliding
window, the soft cap or the sinks gives different tokens on these models and prompts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from family_configs import VOCAB, WINDOW, tiny_model
from test_engine_parity import CONFIGS
from tiny_models import IdTokenizer

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFailed, RequestFinished
from engine.model import llama_forward
from engine.model import paged_attention as attention
from engine.model.kv_storage import PagedKVStorage
from engine.model.loaded import LoadedModel
from engine.model.support import SUPPORTED, support_for
from engine.request import Request

NEW = 8
FAMILIES = sorted(SUPPORTED)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread: with two, torch's workers spin against each other
    (measured on the 2-core CI machine: 3.5x less wall time for these tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB, (21,), generator=g).tolist()  # a shared "system prompt"
    return [
        torch.randint(3, VOCAB, (40,), generator=g).tolist(),  # five windows long
        torch.randint(3, VOCAB, (3,), generator=g).tolist(),
        shared + [5, 6, 7],
        shared + [9, 10],
    ]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model_type = request.param
    model = tiny_model(model_type)
    assert support_for(model.config).ok, support_for(model.config).refusal
    prompts = make_prompts()
    refs = []
    for p in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        refs.append(out[0, len(p) :].tolist())
    loaded = LoadedModel.from_model(model, IdTokenizer(VOCAB), name=model_type, source="test")
    return model_type, loaded, prompts, refs


def run(loaded, config: EngineConfig, prompts) -> list[list[int]]:
    events = []
    engine = LLMEngine(loaded, config, events.append)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(Request(prompt_token_ids=tuple(p), sampling=params)))
        for _ in range(i + 1):  # arrivals while others decode: continuous batching
            if engine.has_work():
                engine.step()
    while engine.has_work():
        engine.step()
    failed = [e.message for e in events if isinstance(e, RequestFailed)]
    assert not failed, failed[0]
    assert engine.kv.pool.num_used == 0
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    return [list(done[i].token_ids) for i in ids]


@pytest.mark.parametrize("setting", list(CONFIGS))
def test_greedy_tokens_equal_generate(family, setting):
    model_type, loaded, prompts, refs = family
    assert run(loaded, CONFIGS[setting], prompts) == refs, f"{model_type} under '{setting}'"


MUTANT_SETTING = EngineConfig(block_size=5, num_blocks=120, prefill_chunk_size=7)


def test_the_tokens_depend_on_what_paged_attention_must_get_right(family, monkeypatch):
    """Break each thing the family's attention does; the tokens must change every time. The
    breakage goes in where both forwards (transformers' code and kvscope's own) attend."""
    model_type, loaded, prompts, refs = family
    layers = loaded.attention
    mutants = {}
    with monkeypatch.context() as m:  # no history: every K/V written as zeros
        real_write, real_write_kv = PagedKVStorage.write, PagedKVStorage.write_kv
        m.setattr(
            PagedKVStorage,
            "write",
            lambda self, layer, slots, k, v: real_write(self, layer, slots, k * 0, v * 0),
        )
        m.setattr(
            PagedKVStorage,
            "write_kv",
            lambda self, layer, slots, kv: real_write_kv(self, layer, slots, kv * 0),
        )
        mutants["history"] = run(loaded, MUTANT_SETTING, prompts)
    if any(layer.window for layer in layers):
        assert any(layer.window == WINDOW for layer in layers), layers
        mutants["window"] = _run_with(monkeypatch, loaded, prompts, window=None)
    if any(layer.softcap for layer in layers):
        mutants["softcap"] = _run_with(monkeypatch, loaded, prompts, softcap=None)
    if any(layer.sinks for layer in layers):
        mutants["sinks"] = _run_with(monkeypatch, loaded, prompts, sinks=None)
    same = [name for name, outs in mutants.items() if outs == refs]
    assert not same, f"{model_type}: breaking {same} leaves the tokens unchanged"


def _run_with(monkeypatch, loaded, prompts, **broken):
    """Run with every layer's attention changed as `broken` says (window=None: full attention...)."""
    real = attention.attend

    def attend(storage, layer, q, batch, how):
        return real(storage, layer, q, batch, dataclasses.replace(how, **broken))

    with monkeypatch.context() as m:
        m.setattr(attention, "attend", attend)
        m.setattr(llama_forward, "attend", attend)
        return run(loaded, MUTANT_SETTING, prompts)
