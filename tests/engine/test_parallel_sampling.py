"""n parallel samples of one prompt: the prompt is prefilled once, the samples share its blocks
by ref count and copy a shared partly filled block before writing into it (copy-on-write); each
sample is exactly the reply a lone request with its seed would give; memory grows with what
differs, not with n."""

import pytest
import torch
from tiny_models import IdTokenizer, make_tiny_llama

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import (
    BlockEvent,
    RequestFailed,
    RequestFinished,
    SequenceFinished,
    SequenceForked,
    StepStats,
    TokenGenerated,
)
from engine.model.kv_storage import block_index
from engine.model.loaded import LoadedModel
from engine.request import Request

VOCAB = 800


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab_size=VOCAB, seed=5)
    return LoadedModel.from_model(model, IdTokenizer(VOCAB), name="tiny", source="test")


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(engine):
    while engine.has_work():
        engine.step()
        engine.kv.pool.check_invariants()


def test_samples_equal_lone_requests_with_their_seeds(tiny):
    prompt = prompt_of(21)
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_new_tokens=12, ignore_eos=True)
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=100), events.append)
    rid = engine.add_request(
        Request(prompt_token_ids=tuple(prompt), sampling=SamplingParams(**{**_fields(params), "n": 4}))
    )
    drive(engine)
    (finished,) = [e for e in events if isinstance(e, RequestFinished)]
    assert engine.kv.pool.num_used == 0
    by_branch = {s.branch: s for s in finished.sequences}
    assert sorted(by_branch) == [0, 1, 2, 3]

    for branch in range(4):
        alone = []
        lone = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=100), alone.append)
        lone.add_request(
            Request(
                prompt_token_ids=tuple(prompt),
                sampling=SamplingParams(**{**_fields(params), "seed": 7 + branch}),
            )
        )
        drive(lone)
        (ref,) = [e for e in alone if isinstance(e, RequestFinished)]
        assert by_branch[branch].token_ids == ref.token_ids
        logprobs = [e.logprob for e in alone if isinstance(e, TokenGenerated)]
        assert by_branch[branch].score == pytest.approx(sum(logprobs), abs=1e-4)
    assert len({s.token_ids for s in finished.sequences}) == 4, "four seeds, four different replies"

    # streamed tokens say which sample they extend, and add up to each sample's reply
    tokens = [e for e in events if isinstance(e, TokenGenerated) and e.request_id == rid]
    for branch in range(4):
        mine = [e.token_id for e in tokens if e.branch == branch]
        assert tuple(mine) == by_branch[branch].token_ids
    scores = [s.score for s in finished.sequences]
    assert scores == sorted(scores, reverse=True)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_the_prompt_is_prefilled_once_and_shared(tiny):
    prompt = prompt_of(22)  # 5 full blocks of 4 and a partly filled sixth
    n, new = 3, 6
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=100), events.append)
    rid = engine.add_request(
        Request(
            prompt_token_ids=tuple(prompt), sampling=SamplingParams(n=n, max_new_tokens=new, ignore_eos=True)
        )
    )
    drive(engine)
    prefill = sum(e.prefill_tokens for e in events if isinstance(e, StepStats))
    assert prefill == len(prompt), "the prompt ran through the model once, not n times"

    forks = [e for e in events if isinstance(e, SequenceForked)]
    assert [(f.parent_seq_id, f.branch, f.num_tokens) for f in forks] == [(rid, 1, 22), (rid, 2, 22)]
    shares = [e for e in events if isinstance(e, BlockEvent) and e.op == "share"]
    prompt_blocks = [
        e for e in events if isinstance(e, BlockEvent) and e.op == "allocate" and e.seq_id == rid
    ][0]
    assert [s.seq_id for s in shares] == [f.seq_id for f in forks]
    assert all(s.block_ids == prompt_blocks.block_ids for s in shares)
    assert all(s.fills == (4, 4, 4, 4, 4, 2) for s in shares)

    # the partly filled sixth block: n - 1 samples copy it, the last writer keeps the original
    cows = [e for e in events if isinstance(e, BlockEvent) and e.op == "cow"]
    assert len(cows) == n - 1
    assert all(
        c.src_block_ids == (prompt_blocks.block_ids[5],) and c.fills == (2,) and c.token_start == 20
        for c in cows
    )

    (finished,) = [e for e in events if isinstance(e, RequestFinished)]
    group = finished.group
    assert group.kind == "samples" and group.num_sequences == n and group.cow_copies == n - 1
    # each sample ends with 22 + new - 1 tokens in the cache: 7 blocks; alone they'd take n * 7
    per_sample = -(-(len(prompt) + new - 1) // 4)
    assert group.unshared_blocks_equivalent == n * per_sample
    assert group.shared_blocks == 5 + n * (per_sample - 5)
    ended = [e for e in events if isinstance(e, SequenceFinished)]
    assert sorted(e.branch for e in ended) == list(range(n)) and {e.finish_reason for e in ended} == {
        "length"
    }
    assert finished.stats.generated_tokens == n * new


def test_copy_on_write_leaves_the_siblings_kv_bit_equal(tiny):
    """Fork inside a block, let each sample append its own tokens: the K/V each sample had at
    the fork reads back bit-equal through its block table at every later step."""
    prompt = prompt_of(10)  # 2 full blocks of 4, the third holds 2: the fork is inside it
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=60))
    engine.add_request(
        Request(
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(n=2, seed=3, max_new_tokens=6, ignore_eos=True),
        )
    )
    engine.step()  # prefill, fork, each sample draws its first token
    members = list(next(iter(engine.groups.active.values())).members)
    assert members[0].token_ids[-1] != members[1].token_ids[-1], "the branches append different tokens"
    assert members[0].block_table[2] is members[1].block_table[2] and members[0].block_table[2].ref_cnt == 2

    def kv_of(seq):
        blocks = block_index([b.block_id for b in seq.block_table], engine.storage.k[0].device)
        return [
            t.clone()
            for layer in range(len(engine.storage.k))
            for t in engine.storage.gather(layer, blocks, len(prompt), torch.float32)
        ]

    snapshots = [kv_of(seq) for seq in members]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        for seq, snap in zip(members, snapshots):
            if seq.block_table:
                assert all(torch.equal(a, b) for a, b in zip(kv_of(seq), snap))
    assert steps == 5
    assert engine.kv.cow_copies == 1


def test_memory_saving_of_four_samples_of_a_long_prompt(tiny, capsys):
    """The issue's figure: n = 4 samples of a ~500-token prompt, 32 new tokens each, blocks of 16."""
    prompt, n, new, bs = prompt_of(500, seed=2), 4, 32, 16
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=bs, num_blocks=400), events.append)
    free_at_start = engine.kv.pool.num_free
    engine.add_request(
        Request(
            prompt_token_ids=tuple(prompt), sampling=SamplingParams(n=n, max_new_tokens=new, ignore_eos=True)
        )
    )
    drive(engine)
    (finished,) = [e for e in events if isinstance(e, RequestFinished)]
    g = finished.group
    full_prompt_blocks = len(prompt) // bs
    per_sample = -(-(len(prompt) + new - 1) // bs)  # the last drawn token is never written
    assert g.unshared_blocks_equivalent == n * per_sample
    assert g.shared_blocks == full_prompt_blocks + n * (per_sample - full_prompt_blocks)
    assert g.cow_copies == n - 1
    assert engine.kv.pool.num_free == free_at_start
    with capsys.disabled():
        print(
            f"\n[n={n} samples, {len(prompt)}-token prompt, {new} new tokens, blocks of {bs}] "
            f"{g.shared_blocks} blocks shared vs {g.unshared_blocks_equivalent} unshared: "
            f"{g.saving:.1%} saved, {g.cow_copies} copy-on-write"
        )


def test_cancel_ends_every_sample_and_frees_the_pool(tiny):
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=60), events.append)
    rid = engine.add_request(
        Request(prompt_token_ids=tuple(prompt_of(9)), sampling=SamplingParams(n=3, seed=1))
    )
    for _ in range(3):
        engine.step()
    engine.abort(rid)
    (finished,) = [e for e in events if isinstance(e, RequestFinished)]
    assert finished.finish_reason == "cancelled"
    assert sorted(s.branch for s in finished.sequences) == [0, 1, 2]
    assert all(len(s.token_ids) == 3 for s in finished.sequences)
    assert engine.kv.pool.num_used == 0 and not engine.has_work()


def test_samples_under_preemption_are_recomputed_as_a_group(tiny):
    """Two 4-sample requests in a pool too small for both: the newest group is preempted whole,
    recomputed, and every sample still equals its lone, seeded twin."""
    prompts = [prompt_of(14, seed=4), prompt_of(11, seed=5)]
    base = dict(temperature=0.9, seed=11, max_new_tokens=10, ignore_eos=True)
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=24), events.append)
    ids = [
        engine.add_request(Request(prompt_token_ids=tuple(p), sampling=SamplingParams(n=4, **base)))
        for p in prompts
    ]
    drive(engine)
    assert engine.scheduler.preemptions > 0
    assert engine.kv.pool.num_used == 0
    done = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    for rid, prompt in zip(ids, prompts):
        for result in done[rid].sequences:
            alone = []
            lone = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=60), alone.append)
            lone.add_request(
                Request(
                    prompt_token_ids=tuple(prompt),
                    sampling=SamplingParams(**{**base, "seed": 11 + result.branch}),
                )
            )
            drive(lone)
            (ref,) = [e for e in alone if isinstance(e, RequestFinished)]
            assert result.token_ids == ref.token_ids


def test_bad_sample_settings_are_refused_in_words(tiny):
    with pytest.raises(ConfigError, match="temperature above 0"):
        SamplingParams(n=2, temperature=0.0)
    with pytest.raises(ConfigError, match="n \\(parallel samples\\)"):
        SamplingParams(n=0)
    events = []
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=60, max_num_seqs=4), events.append)
    engine.add_request(Request(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(n=6)))
    (failed,) = [e for e in events if isinstance(e, RequestFailed)]
    assert "max_num_seqs" in failed.message and "6" in failed.message
