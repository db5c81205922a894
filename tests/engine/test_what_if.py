"""The what-if is exact (engine.core.what_if): a generated token recomputed under its own
settings is its recorded snapshot bit for bit (the step's own logits, kept for it), on float32 and
native weights; once its logits are no longer kept, they are recomputed through the engine's paged
forward (and the answer says so); under other settings it is what the engine itself shows for
that token under them (a request continuing the reply from the same tokens), whatever the tail of
the vocabulary holds. The tiny random model's distribution is nearly flat over 49k tokens: the
heavy tail a top-256 approximation could not reproduce."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.core import replay as replay_module
from engine.core.kept_logits import KeptLogits
from engine.core.llm_engine import LLMEngine
from engine.core.what_if import HOW, WhatIf, what_if_notes
from engine.events import TokenGenerated
from engine.inside import KEPT, RECOMPUTED
from engine.request import ChatMessage, Request

MESSAGES = (ChatMessage("system", "You are terse."), ChatMessage("user", "Name three colours."))
TOKENS = 5
# The tokens' own settings: a penalty, a temperature and a truncation, and a snapshot each.
OWN = dict(temperature=0.8, top_k=50, repetition_penalty=1.3, seed=7, snapshot_top_n=8)
RECORDED = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, **OWN)


def generate(loaded, config: EngineConfig, request: Request) -> tuple[LLMEngine, list[TokenGenerated]]:
    events: list = []
    engine = LLMEngine(loaded, config, events.append)
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    return engine, [e for e in events if isinstance(e, TokenGenerated)]


def assert_same_stages(got, want, ids, atol=1e-5) -> None:
    """Same stages, kept counts and masses, and the same probabilities for the candidates `ids`."""
    assert [s.name for s in got.stages] == [s.name for s in want.stages]
    for mine, theirs in zip(got.stages, want.stages):
        a = dict(zip(got.candidate_ids, mine.probs))
        b = dict(zip(want.candidate_ids, theirs.probs))
        for token in ids:
            assert a[token] == pytest.approx(b[token], abs=atol), (mine.name, token)
        assert mine.kept_count == theirs.kept_count, mine.name
        assert mine.kept_mass == pytest.approx(theirs.kept_mass, abs=atol), mine.name


# Chunked prefill over small blocks, and an int8 cache read back through the paged path.
CONFIGS = [
    EngineConfig(block_size=4, num_blocks=256, prefill_chunk_size=8),
    EngineConfig(block_size=16, num_blocks=64, kv_dtype="int8"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["chunked", "int8-kv"])
def test_under_its_own_settings_a_token_is_its_recorded_snapshot_bit_for_bit(tiny_loaded, config):
    request = Request(messages=MESSAGES, sampling=RECORDED)
    engine, tokens = generate(tiny_loaded, config, request)
    assert len(tokens) == TOKENS
    what_if = WhatIf()
    for token in tokens:
        outputs = [t.token_id for t in tokens[: token.index]]
        answer = what_if.recompute(engine, request, outputs, token.snapshot, RECORDED)
        assert answer.logits_from == KEPT and answer.how == HOW[KEPT]
        assert answer.snapshot == token.snapshot  # every stage, probability and count, to the bit


def test_native_weights_too(tmp_path):
    from gguf_files import write_tiny_llama
    from test_native_gguf import native_loaded

    loaded = native_loaded(write_tiny_llama(tmp_path / "tiny.gguf"))
    request = Request(prompt_token_ids=tuple(range(5, 30)), sampling=RECORDED)
    engine, tokens = generate(loaded, CONFIGS[0], request)
    assert loaded.info.quantization == "native"
    for token in tokens:
        outputs = [t.token_id for t in tokens[: token.index]]
        answer = WhatIf().recompute(engine, request, outputs, token.snapshot, RECORDED)
        assert answer.logits_from == KEPT and answer.snapshot == token.snapshot


@pytest.mark.parametrize("config", CONFIGS, ids=["chunked", "int8-kv"])
def test_logits_no_longer_kept_are_recomputed_through_the_paged_forward_and_it_says_so(tiny_loaded, config):
    request = Request(messages=MESSAGES, sampling=RECORDED)
    engine, tokens = generate(tiny_loaded, config, request)
    engine.kept_logits = KeptLogits(0)  # as if the budget had dropped them
    replays = []
    original = replay_module.Replay.last_row
    what_if = WhatIf()
    for token in tokens:
        outputs = [t.token_id for t in tokens[: token.index]]
        replay_module.Replay.last_row = lambda self, *a, **k: replays.append(1) or original(self, *a, **k)
        try:
            answer = what_if.recompute(engine, request, outputs, token.snapshot, RECORDED)
        finally:
            replay_module.Replay.last_row = original
        got = answer.snapshot
        assert answer.logits_from == RECOMPUTED and answer.how == HOW[RECOMPUTED]
        assert got.candidate_ids == token.snapshot.candidate_ids
        assert got.drawn_id == token.token_id
        assert_same_stages(got, token.snapshot, got.candidate_ids)
        assert got.drawn_prob == pytest.approx(token.snapshot.drawn_prob, abs=1e-5)
    assert len(replays) == TOKENS
    assert engine.kv.pool.num_used == 0  # the recomputations gave their blocks back


OTHER = [
    dict(temperature=1.5, top_p=0.9),
    dict(temperature=0.5, top_k=5, min_p=0.05),
    dict(temperature=1.0, repetition_penalty=1.0),
    # the newer stages: typical-p, DRY (it reads the history, prompt and reply alike) and an XTC
    # whose coin always comes up
    dict(temperature=1.3, typical_p=0.9),
    dict(dry_multiplier=0.8, dry_allowed_length=1),
    dict(temperature=1.0, xtc_probability=1.0, xtc_threshold=1e-5),
]


@pytest.mark.parametrize("settings", OTHER, ids=str)
def test_under_other_settings_it_is_what_the_engine_shows_under_them(tiny_loaded, settings):
    config = CONFIGS[0]
    request = Request(messages=MESSAGES, sampling=RECORDED)
    engine, tokens = generate(tiny_loaded, config, request)
    other = replace(RECORDED, **settings)
    index = 3
    prefix = tuple(t.token_id for t in tokens[:index])
    got = WhatIf().recompute(engine, request, list(prefix), tokens[index].snapshot, other).snapshot
    # The engine's own answer: the same conversation continued from the same reply tokens under
    # `other` (the CTRL repetition penalty counts prompt and reply alike, so it sees the same
    # history); one token, whichever it draws.
    branch = Request(messages=MESSAGES, sampling=replace(other, max_new_tokens=1), reply_prefix_ids=prefix)
    _, (truth,) = generate(tiny_loaded, config, branch)
    top = [i for i in got.candidate_ids if i in truth.snapshot.candidate_ids]
    assert len(top) >= RECORDED.snapshot_top_n  # the top candidates agree (only a drawn one may differ)
    assert_same_stages(got, truth.snapshot, top)
    assert got.stages[0].kept_count == tiny_loaded.model.config.vocab_size  # over the whole vocabulary


def test_moving_a_setting_reruns_only_the_stages(tiny_loaded, monkeypatch):
    request = Request(messages=MESSAGES, sampling=RECORDED)
    engine, tokens = generate(tiny_loaded, CONFIGS[0], request)
    engine.kept_logits = KeptLogits(0)  # recomputed: the last recomputation is kept
    forwards = []
    original = replay_module.Replay.last_row
    monkeypatch.setattr(
        replay_module.Replay, "last_row", lambda self, *a, **k: forwards.append(1) or original(self, *a, **k)
    )
    what_if = WhatIf()
    token = tokens[2]
    outputs = [t.token_id for t in tokens[:2]]
    for temperature in (0.3, 0.6, 0.9):
        what_if.recompute(
            engine, request, outputs, token.snapshot, replace(RECORDED, temperature=temperature)
        )
    assert len(forwards) == 1
    what_if.recompute(engine, request, outputs + [token.token_id], tokens[3].snapshot, RECORDED)
    assert len(forwards) == 2  # another token: another context


def test_xtc_is_shown_as_if_its_coin_came_up_and_says_so(tiny_loaded):
    request = Request(messages=MESSAGES, sampling=RECORDED)
    engine, tokens = generate(tiny_loaded, CONFIGS[0], request)
    sometimes = replace(RECORDED, xtc_probability=0.3, xtc_threshold=1e-5)
    always = replace(sometimes, xtc_probability=1.0)
    outputs = [t.token_id for t in tokens[:2]]
    what_if = WhatIf()
    got = what_if.recompute(engine, request, outputs, tokens[2].snapshot, sometimes).snapshot
    fired = what_if.recompute(engine, request, outputs, tokens[2].snapshot, always).snapshot
    assert [s.name for s in got.stages][-1] == "xtc" and got.stages == fired.stages
    assert got.stages[-1].kept_count < got.stages[-2].kept_count  # it cut
    assert what_if_notes(sometimes) == ("XTC shown as if its coin came up (it does with probability 0.3)",)
    assert what_if_notes(always) == () and what_if_notes(RECORDED) == ()


def test_a_token_made_under_a_grammar_keeps_its_mask_in_the_what_if(tiny_loaded):
    """The controls' settings carry no grammar: the reply's own stays the first stage, its
    matcher replayed over the reply's tokens before the token."""
    from engine.config import GrammarSpec

    grammar = GrammarSpec("regex", "(yes|no|maybe)[0-9]{2,6}")
    recorded = replace(RECORDED, grammar=grammar, repetition_penalty=1.0)
    request = Request(messages=MESSAGES, sampling=recorded)
    engine, tokens = generate(tiny_loaded, CONFIGS[0], request)
    what_if = WhatIf()
    for token in tokens:
        outputs = [t.token_id for t in tokens[: token.index]]
        own = what_if.recompute(
            engine, request, outputs, token.snapshot, replace(recorded, grammar=None)
        ).snapshot
        assert own.candidate_ids == token.snapshot.candidate_ids
        mine, theirs = own.grammar, token.snapshot.grammar
        assert (mine.allowed, mine.forced, mine.forced_ids, mine.cut_ids) == (
            theirs.allowed,
            theirs.forced,
            theirs.forced_ids,
            theirs.cut_ids,
        )
        assert mine.removed_mass == pytest.approx(theirs.removed_mass, abs=1e-5)
        assert_same_stages(own, token.snapshot, own.candidate_ids)
        hotter = what_if.recompute(
            engine, request, outputs, token.snapshot, replace(recorded, temperature=2.0, grammar=None)
        ).snapshot
        assert hotter.stages[1].name == "grammar" and hotter.stages[1].kept_count == own.stages[1].kept_count


def test_recomputed_logits_on_native_weights_are_the_steps_bit_for_bit(tmp_path):
    """Once the step's logits are gone, the replay recomputes the context as the reply's steps
    computed it: the prompt's rows with the kernels of the prompt's length, every reply row (the
    inspected one, and the partial block's before it) with a decode row's. A kernel table whose
    many-row kernel rounds otherwise (dense bfloat16) would show any other choice."""
    import torch
    from gguf_files import write_tiny_llama
    from test_native_gguf import native_loaded

    loaded = native_loaded(write_tiny_llama(tmp_path / "tiny.gguf"))
    loaded.policy.choose = lambda storage, rows: "kvk" if rows == 1 else storage.kernels()[-1]
    prompt = tuple(range(5, 30))
    greedy = SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=0.0, snapshot_top_n=4)
    request = Request(prompt_token_ids=prompt, sampling=greedy)
    engine, tokens = generate(
        loaded, EngineConfig(block_size=4, num_blocks=256, prefill_chunk_size=8), request
    )
    kept = {
        i: engine.kept_logits.get([*prompt, *(t.token_id for t in tokens[:i])]) for i in range(len(tokens))
    }
    assert all(v is not None for v in kept.values())
    engine.kept_logits = KeptLogits(0)
    for index in (0, 1, 6, 8):  # the prompt's last row; reply rows in the first and later blocks
        context = [*prompt, *(t.token_id for t in tokens[:index])]
        with replay_module.Replay(engine, context, prompt_tokens=len(prompt)) as replay:
            again = replay.last_row()
        assert torch.equal(again, kept[index].to(again.device)), index
        with replay_module.Replay(engine, context) as replay:  # all of it taken for a prompt
            as_prompt = replay.last_row()
        if index > 1:
            assert not torch.equal(as_prompt, kept[index].to(as_prompt.device)), "the test can fail"
