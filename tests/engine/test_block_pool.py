"""Block pool: exact ids, exact eviction order, and invariants under random operation sequences."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.events import BlockEvent
from engine.kv.block_pool import BlockPool, PoolExhausted


def test_allocate_takes_lowest_ids_first_and_reports_events():
    events = []
    pool = BlockPool(6, 4, events.append)
    blocks = pool.allocate(3, seq_id=7)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert events == [BlockEvent("allocate", (0, 1, 2), 7, t=events[0].t)]
    assert pool.num_free == 3 and pool.num_used == 3


def test_exhaustion_raises_and_changes_nothing():
    pool = BlockPool(2, 4)
    pool.allocate(1, 1)
    with pytest.raises(PoolExhausted):
        pool.allocate(2, 1)
    assert pool.num_free == 1
    pool.check_invariants()


def fill(pool, blocks):
    for b in blocks:
        b.num_tokens = pool.block_size


def test_cached_blocks_are_evicted_lru_and_uncached_reused_first():
    events = []
    pool = BlockPool(4, 2, events.append)
    a = pool.allocate(2, 1)
    fill(pool, a)
    pool.cache(a[0], "h0", 1, 0)
    pool.cache(a[1], "h1", 1, 2)
    b = pool.allocate(1, 2)  # block 2, never cached
    pool.free(list(reversed(a)), 1)  # tail first: h1 then h0 join the back of the queue
    pool.free(b, 2)  # uncached: goes to the FRONT
    assert pool.free_order() == [2, 3, 1, 0]
    assert pool.num_cached_free == 2
    events.clear()
    taken = pool.allocate(3, 3)
    assert [x.block_id for x in taken] == [2, 3, 1]
    assert [e.op for e in events] == ["evict", "allocate"]
    assert events[0].block_ids == (1,)
    assert pool.lookup("h1") is None and pool.lookup("h0") is a[0]
    pool.check_invariants()


def test_touch_revives_a_cached_free_block():
    pool = BlockPool(3, 2)
    (blk,) = pool.allocate(1, 1)
    fill(pool, [blk])
    pool.cache(blk, "h", 1, 0)
    pool.free([blk], 1)
    assert pool.num_free == 3 and blk.ref_cnt == 0
    pool.touch([pool.lookup("h")], 2)
    assert blk.ref_cnt == 1 and pool.num_free == 2 and 0 not in pool.free_order()
    pool.touch([blk], 3)
    assert blk.ref_cnt == 2
    pool.free([blk], 2)
    assert blk.ref_cnt == 1 and pool.num_free == 2
    pool.check_invariants()


def test_double_free_is_caught():
    pool = BlockPool(2, 2)
    (blk,) = pool.allocate(1, 1)
    pool.free([blk], 1)
    with pytest.raises(AssertionError):
        pool.free([blk], 1)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / share / free sequences; conservation and ref counts hold after
    every step, and the model's own count of references agrees with the pool's."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, 2)
        self.owners: dict[int, list] = {}  # seq id -> blocks it references
        self.next_seq = 0
        self.next_hash = 0

    @rule(n=st.integers(1, 5))
    def allocate(self, n):
        if not self.pool.can_allocate(n):
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n, -1)
            return
        self.owners[self.next_seq] = self.pool.allocate(n, self.next_seq)
        self.next_seq += 1

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def cache_one(self, data):
        seq = data.draw(st.sampled_from(sorted(self.owners)))
        block = data.draw(st.sampled_from(self.owners[seq]))
        block.num_tokens = self.pool.block_size
        self.pool.cache(block, ("h", self.next_hash), seq, 0)
        self.next_hash += 1

    @precondition(lambda self: self.pool._cached)
    @rule(data=st.data())
    def share_cached(self, data):
        key = data.draw(st.sampled_from(sorted(self.pool._cached, key=str)))
        block = self.pool.lookup(key)
        self.pool.touch([block], self.next_seq)
        self.owners[self.next_seq] = [block]
        self.next_seq += 1

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free_seq(self, data):
        seq = data.draw(st.sampled_from(sorted(self.owners)))
        self.pool.free(list(reversed(self.owners.pop(seq))), seq)

    @invariant()
    def conserved(self):
        self.pool.check_invariants()
        refs = {}
        for blocks in self.owners.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0)
        cached_free = sum(1 for b in self.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        assert self.pool.num_cached_free == cached_free
        assert self.pool.num_used + self.pool.num_free == self.pool.num_blocks

    def teardown(self):
        for seq in list(self.owners):
            self.pool.free(list(reversed(self.owners.pop(seq))), seq)
        assert self.pool.num_free == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
