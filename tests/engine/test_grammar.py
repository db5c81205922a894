"""Constrained decoding: grammars compile or say why, the mask stage permits exactly what the
library's own matcher permits, and a grammar holds through n samples, beams, speculative rounds
and branches (tiny random Llama with the real SmolLM2 tokenizer)."""

import json

import jsonschema
import llguidance
import pytest
import torch
from recorded_engine import make_engine, run_events

from engine.config import EngineConfig, GrammarSpec, SamplingParams, SpeculativeConfig
from engine.events import RequestFailed, RequestFinished, SpecRound, TokenGenerated
from engine.grammar.compile import GrammarError, check
from engine.grammar.grammars import Grammars
from engine.grammar.state import GrammarDeadEnd
from engine.request import Request
from engine.sampling.sampler import Sampler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def schema(value) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(value))


def run(engine, request):
    events = run_events(engine, request)
    ends = [e for e in events if isinstance(e, (RequestFinished, RequestFailed))]
    assert len(ends) == 1
    return ends[0], events


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    return make_engine(tiny_loaded, EngineConfig(block_size=8, num_blocks=400))


# ---- compiling --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json_schema", '{"type": "frob"}'), "the JSON Schema is invalid: 'frob' is not valid"),
        (GrammarSpec("json_schema", '{"type": '), "the schema is not valid JSON"),
        (GrammarSpec("json_schema", "[1]"), "a JSON Schema is an object"),
        (
            GrammarSpec("json_schema", '{"type": "string", "format": "nope"}'),
            "cannot be compiled: Unknown format",
        ),
        (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "cannot be compiled"),
        (GrammarSpec("regex", "a(b"), "the regular expression cannot be compiled"),
        (GrammarSpec("lark", 'start: "a" b'), 'unknown name: "b"'),
        (GrammarSpec("lark", '{"type": "object"}'), "this is JSON, not a Lark grammar"),
        (GrammarSpec("choice", '["yes", 3]'), "the choices must be a JSON array of non-empty strings"),
        (GrammarSpec("gbnf", "root ::= [unclosed"), "GBNF"),
    ],
)
def test_a_bad_grammar_is_refused_in_one_line(spec, message):
    with pytest.raises(GrammarError) as info:
        check(spec)
    text = str(info.value)
    assert message in text and "\n" not in text and len(text) <= 300


def test_every_kind_compiles():
    for spec in (
        schema(PERSON),
        GrammarSpec("json_object"),
        GrammarSpec("regex", "[0-9]{3}-[a-z]+"),
        GrammarSpec("lark", 'start: "yes" | "no"'),
        GrammarSpec("gbnf", 'root ::= "x" [0-9]+'),
        GrammarSpec("choice", '["red", "green"]'),
    ):
        assert check(spec)


def test_an_empty_grammar_text_is_a_config_error():
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="needs its text"):
        GrammarSpec("regex", "  ")
    with pytest.raises(ConfigError, match="grammar kind"):
        GrammarSpec("yaml", "a: b")
    # the dict form (settings, stored replies) comes back as the spec
    params = SamplingParams(grammar={"kind": "regex", "text": "a+"})
    assert params.grammar == GrammarSpec("regex", "a+")


# ---- the mask is exactly what the grammar permits --------------------------------------------------
def _library_permits(
    tokenizer, grammar: str, path: list[int], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's own answers on a fresh matcher replayed over `path`: its token mask (as
    one byte per token, another of its APIs than the bitmask the engine reads), and which tokens
    it would consume next byte-wise (validate_tokens). The mask is the narrower: where the
    grammar forces text it permits that text's canonical tokens only (`{"` but not `{`)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(path)
    mask = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] != 0
    consumable = torch.tensor([matcher.validate_tokens([t]) == 1 for t in range(vocab)])
    return mask, consumable


@pytest.mark.parametrize(
    "spec",
    [
        schema(PERSON),
        GrammarSpec("regex", "(ab|cd)[0-9]{2,4}"),
        GrammarSpec("lark", 'start: "Hi " NAME\nNAME: /[A-Z][a-z]+/'),
    ],
)
def test_the_allowed_set_after_the_mask_is_what_the_library_permits(tiny_loaded, spec):
    tokenizer = tiny_loaded.tokenizer
    vocab = tiny_loaded.info.vocab_size
    grammars = Grammars(tokenizer, vocab, {tokenizer.eos_token_id})
    state = grammars.start(spec)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    generator = torch.Generator().manual_seed(0)
    path: list[int] = []
    for _ in range(5):
        mask = state.mask()
        logits = torch.randn(vocab, generator=generator)
        scores = sampler._process(logits[None], [], path, False, mask)[0][0]
        permitted, consumable = _library_permits(grammars._vocabulary(), grammars.compiled(spec), path, vocab)
        assert torch.equal(scores > -float("inf"), permitted)
        assert mask.count == int(permitted.sum())
        assert bool((permitted <= consumable).all())  # nothing the grammar cannot take
        token = sampler.draw(torch.softmax(scores, 0))
        assert state.consume(token)
        path.append(token)
        if state.finished:
            break


def test_a_draft_walk_leaves_the_matcher_where_it_was(tiny_loaded):
    tok = tiny_loaded.tokenizer
    grammars = Grammars(tok, tiny_loaded.info.vocab_size, {tok.eos_token_id})
    state = grammars.start(GrammarSpec("regex", "abc[0-9]+"))
    ids = tok("abc12", add_special_tokens=False)["input_ids"]
    before = state.mask().allowed.clone()
    masks = state.masks_along([*ids, tok("x", add_special_tokens=False)["input_ids"][0], 5])
    assert state.position == 0 and torch.equal(state.mask().allowed, before)
    # every draft the grammar takes has its mask; the refused "x" has one too (it is rejected
    # by it); nothing after it is walked
    assert all(m is not None for m in masks[: len(ids) + 1]) and masks[-1] is None
    x = tok("x", add_special_tokens=False)["input_ids"][0]
    assert not bool(masks[len(ids)].allowed[x])
    # a fork goes its own way
    child = state.fork()
    assert child.consume(ids[0]) and child.position == 1 and state.position == 0


def test_a_draft_that_completes_the_grammar_still_completes_it_when_committed(tiny_loaded):
    """Drafts past the grammar's end (its completion, then end-of-text): the walk stops at the
    completion, and committing the same tokens afterwards finishes the grammar as in plain
    decoding (walking on and rolling back out of llguidance's stopped state did not)."""
    tok = tiny_loaded.tokenizer
    grammars = Grammars(tok, tiny_loaded.info.vocab_size, {tok.eos_token_id})
    state = grammars.start(GrammarSpec("choice", json.dumps(["yes", "no"])))
    ids = tok("yes", add_special_tokens=False)["input_ids"]
    masks = state.masks_along([*ids, tok.eos_token_id])
    assert state.position == 0 and all(m is not None for m in masks[: len(ids)]) and masks[-1] is None
    for token in ids:
        assert state.consume(token)
    assert state.finished


# ---- generation under a grammar ---------------------------------------------------------------------
def test_a_reply_under_a_schema_validates_and_shows_the_mask_stage(engine):
    params = SamplingParams(
        temperature=1.0, seed=11, max_new_tokens=120, grammar=schema(PERSON), snapshot_top_n=6
    )
    end, events = run(engine, Request.chat("Who?", sampling=params))
    assert end.finish_reason == "stop", end
    jsonschema.validate(json.loads(end.text), PERSON)
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    for t in tokens:
        stages = t.snapshot.stages
        assert [s.name for s in stages[:2]] == ["raw", "grammar"]
        g = t.snapshot.grammar
        assert g.allowed == stages[1].kept_count and g.vocab_size == tiny_loaded_vocab(engine)
        assert g.removed_mass == pytest.approx(1 - stages[1].kept_mass, abs=1e-5)
        assert g.forced == (g.allowed == 1)
        drawn = t.snapshot.candidate_ids.index(t.token_id)
        assert stages[1].probs[drawn] > 0  # the drawn token was permitted
        for i, cut in enumerate(g.cut_ids):  # the listed cuts were removed, likeliest first
            assert (
                cut not in t.snapshot.candidate_ids or stages[1].removed[t.snapshot.candidate_ids.index(cut)]
            )
            assert i == 0 or g.cut_probs[i] <= g.cut_probs[i - 1]
    assert any(t.snapshot.grammar.forced and t.snapshot.grammar.forced_ids for t in tokens)  # '"name"' etc.


def tiny_loaded_vocab(engine) -> int:
    return engine.loaded.info.vocab_size


def test_greedy_under_a_grammar_masks_before_the_argmax(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=30, grammar=GrammarSpec("regex", "[0-9]{4}"))
    end, _ = run(engine, Request.chat("Year?", sampling=params))
    assert end.finish_reason == "stop" and len(end.text) == 4 and end.text.isdigit()


def test_n_samples_each_follow_the_schema(engine):
    params = SamplingParams(temperature=1.0, seed=5, n=4, max_new_tokens=120, grammar=schema(PERSON))
    end, _ = run(engine, Request.chat("Four people", sampling=params))
    assert len(end.sequences) == 4
    texts = set()
    for seq in end.sequences:
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(seq.text), PERSON)
        texts.add(seq.text)
    assert len(texts) > 1  # four matchers, forked at the prompt, went their own ways


def test_beams_under_a_schema_are_valid(engine):
    params = SamplingParams(temperature=0.0, num_beams=3, max_new_tokens=120, grammar=schema(PERSON))
    end, _ = run(engine, Request.chat("A person", sampling=params))
    assert end.sequences and end.finish_reason == "stop"
    for seq in end.sequences:
        if seq.finish_reason == "stop":
            jsonschema.validate(json.loads(seq.text), PERSON)
    jsonschema.validate(json.loads(end.text), PERSON)


def test_speculative_decoding_under_a_schema_equals_plain_greedy(tiny_loaded):
    spec = schema(
        {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"enum": ["alpha beta", "gamma"]}, "maxItems": 8}
            },
            "required": ["items"],
            "additionalProperties": False,
        }
    )
    request = Request.chat(
        'Repeat: {"items": ["alpha beta", "alpha beta", "alpha beta"]}',
        sampling=SamplingParams(temperature=0.0, max_new_tokens=80, grammar=spec),
    )
    plain, _ = run(make_engine(tiny_loaded, EngineConfig(block_size=8, num_blocks=400)), request)
    # 4 drafts every round (not as the tuner judges the tiny model's costs): rounds to keep and
    # to roll back under the grammar, whatever a round costs here
    speculative = SpeculativeConfig("ngram", num_draft=4, adaptive=False)
    config = EngineConfig(block_size=8, num_blocks=400, speculative=speculative)
    spec_end, events = run(make_engine(tiny_loaded, config), request)
    assert spec_end.token_ids == plain.token_ids
    rounds = [e for e in events if isinstance(e, SpecRound)]
    assert rounds and sum(r.accepted for r in rounds) > 0
    assert any(r.accepted < len(r.draft_ids) for r in rounds)  # and some were rolled back


def test_a_draft_the_grammar_refuses_is_rejected(tiny_loaded):
    """n-gram drafts copy the prompt; under a grammar that forbids those tokens every draft is
    rejected at once (p = 0) and the reply stays in the grammar."""
    speculative = SpeculativeConfig("ngram", num_draft=3, adaptive=False)  # rounds whatever they cost
    config = EngineConfig(block_size=8, num_blocks=400, speculative=speculative)
    params = SamplingParams(
        temperature=1.0, seed=2, max_new_tokens=24, grammar=GrammarSpec("regex", "12[0-9]{8,18}")
    )
    # the reply starts with "12", which the prompt follows with " x": the n-gram drafts that
    end, events = run(make_engine(tiny_loaded, config), Request.chat("12 x 12 x 12 x 12 x", sampling=params))
    assert end.text.isdigit() and 10 <= len(end.text) <= 20
    refused = 0
    for r in [e for e in events if isinstance(e, SpecRound)]:
        for i, draft in enumerate(r.draft_ids[: r.accepted + 1]):
            if i < len(r.p_probs) and not engine_text(tiny_loaded, draft).isdigit():
                assert r.p_probs[i] == 0.0 and r.accepted == i
                refused += 1
    assert refused > 0


def engine_text(loaded, token: int) -> str:
    return loaded.tokenizer.decode([token])


def test_a_branch_inside_a_json_reply_continues_valid_json(engine):
    params = SamplingParams(
        temperature=1.0, seed=8, max_new_tokens=120, grammar=schema(PERSON), snapshot_top_n=5
    )
    first, events = run(engine, Request.chat("Who?", sampling=params))
    tokens = [e for e in events if isinstance(e, TokenGenerated)]
    # branch at a token inside the object with a permitted candidate other than the one drawn
    at = next(t for t in tokens[2:] if sum(1 for p in t.snapshot.stages[1].probs if p > 0) > 1)
    other = next(c for c, p in zip(t_ids(at), at.snapshot.stages[1].probs) if p > 0 and c != at.token_id)
    prefix = tuple(first.token_ids[: at.index]) + (other,)
    request = Request(messages=Request.chat("Who?").messages, sampling=params, reply_prefix_ids=prefix)
    branch, _ = run(engine, request)
    text = engine.loaded.tokenizer.decode(list(prefix)) + branch.text
    assert branch.finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def t_ids(token):
    return token.snapshot.candidate_ids


def test_a_branch_the_grammar_refuses_is_refused_with_its_reason(engine):
    tok = engine.loaded.tokenizer
    bad = tuple(tok("hello", add_special_tokens=False)["input_ids"])
    params = SamplingParams(temperature=1.0, grammar=schema(PERSON))
    end, _ = run(engine, Request(messages=Request.chat("x").messages, sampling=params, reply_prefix_ids=bad))
    assert isinstance(end, RequestFailed) and "does not follow the grammar" in end.message


def test_a_grammar_with_no_next_token_ends_the_reply_with_the_reason(engine):
    params = SamplingParams(
        temperature=1.0, seed=1, max_new_tokens=20, grammar=GrammarSpec("lark", 'start: "ab" /[b&&c]/')
    )
    end, _ = run(engine, Request.chat("x", sampling=params))
    assert end.finish_reason == "grammar" and end.text == "ab"
    assert "permits no next token" in end.note
    # one that permits nothing at all is refused before it starts
    params = SamplingParams(temperature=1.0, grammar=GrammarSpec("regex", "[a&&b]"))
    failed, _ = run(engine, Request.chat("x", sampling=params))
    assert isinstance(failed, RequestFailed) and "permits no text" in failed.message


def test_a_grammar_that_cannot_compile_fails_the_request_not_the_engine(engine):
    params = SamplingParams(grammar=GrammarSpec("regex", "a(b"))
    failed, _ = run(engine, Request.chat("x", sampling=params))
    assert isinstance(failed, RequestFailed) and "regular expression cannot be compiled" in failed.message
    ok, _ = run(engine, Request.chat("x", sampling=SamplingParams(max_new_tokens=3, temperature=0)))
    assert isinstance(ok, RequestFinished)


def test_a_dead_end_raises_from_the_state(tiny_loaded):
    tok = tiny_loaded.tokenizer
    grammars = Grammars(tok, tiny_loaded.info.vocab_size, {tok.eos_token_id})
    state = grammars.start(GrammarSpec("lark", 'start: "ab" /[b&&c]/'))
    (ab,) = tok("ab", add_special_tokens=False)["input_ids"]
    assert state.consume(ab)
    with pytest.raises(GrammarDeadEnd, match="NoExtension"):
        state.mask()
