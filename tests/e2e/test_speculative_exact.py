"""Speculative decoding never changes a greedy reply on the packaged SmolLM2 at its own bits
(Q4_1 layers, a Q8_0 head, kvk's kernels) and in float32, because a verification row is the
decode row it stands for, bit for bit.

The first test is the root of it: every logit row a speculative round computes for a position
whose context is the plain reply's equals, bit for bit, the row the plain engine computed by
decoding that position alone (drafts from an oracle that knows the plain reply and is wrong on
purpose now and then, so rounds are accepted whole, cut short and rolled back). The others check
the greedy text itself for every proposer, alone and with the prompts batched in one engine.
"""

from __future__ import annotations

import pytest
import torch

from engine.bench.bench_speculative import TASKS
from engine.config import EngineConfig, ModelSpec, SamplingParams, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.model.loading import load_model
from engine.request import Request
from engine.speculative.proposers import Drafts, Sequence

pytestmark = pytest.mark.slow

PROMPTS = (TASKS["repeat"][0], *TASKS["chat"][:2])
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def native_loaded():
    """The packaged model as the app runs it: at its own bits (quantization auto)."""
    return load_model(ModelSpec("default"))


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def _run(loaded, spec, prompts, proposer=None, capture=None) -> list[tuple[int, ...]]:
    """Greedy replies to `prompts` submitted together to one engine; `capture[prefix] = logits
    row` for every row the target computes (prefix: the tokens the row has seen)."""
    events: list = []
    engine = LLMEngine(loaded, EngineConfig(speculative=spec), events.append)
    if proposer is not None:
        engine.proposer = proposer
    if capture is not None:
        _capture_rows(engine, capture)
    ids = [engine.add_request(Request.chat(p, sampling=_params())) for p in prompts]
    while engine.has_work():
        engine.step()
    assert engine.kv.pool.num_used == 0
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    return [tuple(done[i].token_ids) for i in ids]


def _capture_rows(engine: LLMEngine, capture: dict[tuple[int, ...], torch.Tensor]) -> None:
    forward = engine.runner.forward

    def recording(seqs, num_tokens, logit_counts, observer=None):
        tokens = {
            s.seq_id: s.tokens_with_spec(0, s.num_computed_tokens + n) for s, n in zip(seqs, num_tokens)
        }
        result = forward(seqs, num_tokens, logit_counts, observer)
        for seq_id, (first, count) in result.rows.items():
            seen = tokens[seq_id]
            for i in range(count):
                capture[tuple(seen[: len(seen) - count + i + 1])] = result.logits[first + i].clone()
        return result

    engine.runner.forward = recording  # type: ignore[method-assign]


class OracleDrafts:
    """Drafts the plain greedy reply's next tokens, with every third round's third draft made
    wrong: rounds accepted whole, rejected part-way and rolled back, all verified."""

    name = "oracle"
    free = True
    forwards = 1
    reads_hidden = False
    middle_layer = 0

    def __init__(self, replies: dict[tuple[int, ...], tuple[int, ...]], vocab: int):
        self.replies, self.vocab, self.rounds = replies, vocab, 0

    def evidence(self, seq):
        return 1  # always something to propose

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Drafts]:
        out: list[Drafts] = []
        for seq, k in zip(seqs, ks):
            reply = self.replies[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            drafts = list(reply[len(seq.output_ids) : len(seq.output_ids) + k])
            self.rounds += 1
            if self.rounds % 3 == 0 and len(drafts) >= 3:
                drafts[2] = (drafts[2] + 1) % self.vocab
            out.append((drafts, [None] * len(drafts)))
        return out

    def on_verified(self, seq: Sequence, valid_tokens: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def memory_bytes(self) -> tuple[int, int]:
        return 0, 0


def _rows_of_both(loaded):
    """Each prompt decoded alone, then all of them speculatively in one engine (oracle drafts):
    (the lone decode rows, the speculative rows, the rows of both with the plain context)."""
    plain_rows: dict[tuple[int, ...], torch.Tensor] = {}
    replies = {}
    for prompt in PROMPTS:
        (reply,) = _run(loaded, None, [prompt], capture=plain_rows)
        prompt_ids = tuple(LLMEngine(loaded, EngineConfig()).prompt_ids(Request.chat(prompt)))
        replies[prompt_ids] = reply
    oracle = OracleDrafts(replies, loaded.info.vocab_size)
    spec_rows: dict[tuple[int, ...], torch.Tensor] = {}
    spec = SpeculativeConfig("ngram", num_draft=4, adaptive=False)
    batched = _run(loaded, spec, PROMPTS, proposer=oracle, capture=spec_rows)
    assert batched == list(replies.values())
    shared = [key for key in spec_rows if key in plain_rows]
    # rows of rounds (several per step) cover every position the plain engine decoded
    assert len(shared) >= len(PROMPTS) * (NEW_TOKENS - 1)
    assert len(spec_rows) - len(shared) > 0, "some rows followed a wrong draft (rolled back)"
    return plain_rows, spec_rows, shared


def test_a_verification_row_is_the_decode_row_bit_for_bit(native_loaded):
    """At native bits every verified row with the plain reply's context equals that position's
    lone decode row exactly (and the greedy replies are the plain ones)."""
    plain_rows, spec_rows, shared = _rows_of_both(native_loaded)
    differing = [key for key in shared if not torch.equal(spec_rows[key], plain_rows[key])]
    assert not differing, f"{len(differing)} of {len(shared)} verification rows differ from their decode rows"


@pytest.fixture(scope="module")
def float32_rows(default_loaded):
    return _rows_of_both(default_loaded)


def test_in_float32_verification_rows_are_the_decode_rows_to_the_last_bits(float32_rows):
    """On the float32 twin the greedy replies are the plain ones (checked in _rows_of_both) and
    every verified row is its decode row within float32 rounding."""
    plain_rows, spec_rows, shared = float32_rows
    for key in shared:
        torch.testing.assert_close(spec_rows[key], plain_rows[key], atol=1e-4, rtol=0)


@pytest.mark.xfail(
    strict=True,
    reason="float32's tied LM head (DenseWeight rows layout, F.linear) rounds 5+ rows otherwise "
    "than a lone row (up to ~2e-5 in a logit): the lead's kernels would need a row-invariant head",
)
def test_in_float32_verification_rows_are_the_decode_rows_bit_for_bit(float32_rows):
    plain_rows, spec_rows, shared = float32_rows
    assert all(torch.equal(spec_rows[key], plain_rows[key]) for key in shared)


@pytest.fixture(scope="module")
def plain_replies(native_loaded):
    """Each prompt's plain greedy reply, decoded alone."""
    return [_run(native_loaded, None, [p])[0] for p in PROMPTS]


METHODS = {
    "ngram": SpeculativeConfig("ngram", num_draft=4),
    "ngram-fixed": SpeculativeConfig("ngram", num_draft=4, adaptive=False),
    "self": SpeculativeConfig("self", num_draft=3, adaptive=False),
    "draft": SpeculativeConfig("draft", num_draft=4, draft_model="default", adaptive=False),
}


@pytest.mark.parametrize("method", METHODS)
def test_speculative_greedy_text_equals_plain_alone_and_batched(native_loaded, plain_replies, method):
    spec = METHODS[method]
    alone = [_run(native_loaded, spec, [p])[0] for p in PROMPTS[:1]]
    assert alone == plain_replies[:1]
    batched = _run(native_loaded, spec, PROMPTS)
    assert batched == plain_replies
