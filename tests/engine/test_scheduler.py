"""Scheduler: token budget, chunked prefill, FIFO admission, running cap, preemption."""

from engine.config import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import SeqStatus, Sequence
from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager


def make(num_blocks=200, block_size=16, budget=1024, max_seqs=8, chunk=None):
    kv = KVCacheManager(BlockPool(num_blocks, block_size), enable_prefix_caching=False)
    return Scheduler(kv, budget, max_seqs, chunk)


def add(sched, seq_id, n, first=0):
    s = Sequence(seq_id, list(range(first, first + n)), n, SamplingParams())
    sched.add(s)
    return s


def run_step(sched, new_token=7):
    """Commit what was scheduled and give sequences that finished their prompt a new token."""
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_tokens):
        sched.kv.commit(s, n)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(new_token)
    return batch


def test_budget_1024_with_three_800_token_prompts():
    """A prompt's chunk is never cut to fill what another left of the budget (its rows would
    meet other kernels and attention chunks than alone): b waits a step rather than run 224
    tokens beside a. Fixed chunks of 1024 - 7 tokens leave room for the other 7 decodes."""
    sched = make()
    assert sched.chunk_tokens == 1024 - 7
    a, b, c = (add(sched, i, 800, first=i * 1000) for i in range(3))
    steps = [run_step(sched) for _ in range(4)]
    assert [list(zip([s.seq_id for s in st.seqs], st.num_tokens)) for st in steps] == [
        [(0, 800)],
        [(0, 1), (1, 800)],
        [(0, 1), (1, 1), (2, 800)],
        [(0, 1), (1, 1), (2, 1)],
    ]
    for st in steps:
        assert st.total_tokens <= 1024
    assert steps[1].prefill_tokens == 800 and steps[1].decode_tokens == 1


def chunks_of(sched, seq):
    """The (start, end) of every chunk `seq` ran, stepping until its prompt is in."""
    spans = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        before = {s.seq_id: s.num_computed_tokens for s in [*sched.running, *sched.waiting]}
        batch = run_step(sched)
        for s, n in zip(batch.seqs, batch.num_tokens):
            if s is seq:
                spans.append(
                    (before.get(s.seq_id, 0) if s.num_computed_tokens - n else 0, s.num_computed_tokens)
                )
    return spans


def test_a_prompts_chunks_end_at_the_same_positions_alone_and_under_load():
    alone = make(budget=100, max_seqs=4, chunk=48)
    assert chunks_of(alone, add(alone, 0, 130)) == [(0, 48), (48, 96), (96, 130)]
    busy = make(budget=100, max_seqs=4, chunk=48)
    for i in range(3):
        add(busy, 10 + i, 30 + 7 * i, first=1000 * (i + 1))  # prompts ahead of it in the queue
    spans = chunks_of(busy, add(busy, 0, 130))
    assert [end for _, end in spans] == [48, 96, 130]


def test_after_a_prefix_cache_hit_the_first_chunk_runs_to_the_next_fixed_position():
    kv = KVCacheManager(BlockPool(64, 4), enable_prefix_caching=True)
    sched = Scheduler(kv, 100, 4, 12)
    first = add(sched, 0, 20)
    while first.num_computed_tokens < 20:
        run_step(sched)
    sched.remove(first)
    again = add(sched, 1, 30)  # the same first 20 tokens: 5 full blocks cached
    batch = sched.schedule()
    assert again.num_computed_tokens == 20 and batch.num_tokens == [24 - 20]  # to 24, not 20 + 12


def test_scheduled_tokens_never_exceed_budget_under_load():
    sched = make(budget=100, num_blocks=400, chunk=30)
    for i in range(6):
        add(sched, i, 20 + 17 * i, first=i * 500)
    for _ in range(40):
        batch = run_step(sched)
        assert batch.total_tokens <= 100
        assert all(n <= 30 for n in batch.num_tokens)


def test_running_cap_and_fifo_admission():
    sched = make(max_seqs=2)
    seqs = [add(sched, i, 10, first=i * 100) for i in range(3)]
    batch = run_step(sched)
    assert [s.seq_id for s in batch.seqs] == [0, 1]
    assert seqs[2].status is SeqStatus.WAITING
    sched.remove(seqs[0])
    batch = run_step(sched)
    assert [s.seq_id for s in batch.seqs] == [1, 2]


def test_preemption_frees_the_newest_and_recomputes_it_later():
    sched = make(num_blocks=4, block_size=4, budget=64)
    a = add(sched, 0, 8)  # 2 full blocks; its first decode needs a third
    b = add(sched, 1, 7, first=50)  # 2 blocks: the pool is now full
    run_step(sched)
    assert sched.kv.pool.num_free == 0
    batch = sched.schedule()
    assert batch.preempted == [b]
    assert b.status is SeqStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.preemptions == 1 and sched.waiting[0] is b
    assert [s.seq_id for s in batch.seqs] == [0] and batch.num_tokens == [1]
    assert len(a.block_table) == 3
