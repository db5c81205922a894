"""Block pool: exact ids, exact eviction order, and invariants under random operation sequences
(single sequences, and groups that fork, copy on write, prune and end)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import SamplingParams
from engine.core.sequence import Sequence
from engine.events import BlockEvent
from engine.kv.block_pool import BlockPool, PoolExhausted
from engine.kv.manager import KVCacheManager


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


class GroupMachine(RuleBasedStateMachine):
    """Groups of sequences on the KV manager, as n samples and beams use it: start (prompt,
    prefix cache on), fork (share every block), append to one member or to all at once
    (copy-on-write of a shared partly filled block), prune one member, end a group.

    Block contents are modelled slot by slot (a write stores the token, copy-on-write copies
    the block), so after every step each live sequence must read its own tokens back through
    its block table: no write into a shared block ever reaches a sibling. Ref counts equal the
    number of block-table entries naming a block, and when the last group ends every block is
    free again, pruned members included."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(24, 3)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=True, copy_block=self._copy)
        self.slots: dict[int, int] = {}  # flat slot id -> token written there
        self.groups: dict[int, list[Sequence]] = {}
        self.next_id = 0

    def _copy(self, src: int, dst: int) -> None:
        bs = self.pool.block_size
        for offset in range(bs):
            if src * bs + offset in self.slots:
                self.slots[dst * bs + offset] = self.slots[src * bs + offset]

    def _new_seq(self, tokens) -> Sequence:
        seq = Sequence(self.next_id, list(tokens), len(tokens), SamplingParams())
        self.next_id += 1
        return seq

    def _write(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        self.kv.append(seq, n)
        for pos, slot in enumerate(self.kv.slot_ids(seq.block_table, start, n), start=start):
            self.slots[slot] = seq.token_ids[pos]
        self.kv.commit(seq, n)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def start_group(self, tokens):
        seq = self._new_seq(tokens)
        cached = self.kv.find_cached_prefix(seq)
        n = len(tokens) - len(cached) * self.pool.block_size
        if not self.kv.can_allocate(seq, cached, n):
            return
        self.kv.allocate(seq, cached, 0)
        self._write(seq, n)
        self.groups[seq.seq_id] = [seq]

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def fork(self, data):
        members = self.groups[data.draw(st.sampled_from(sorted(self.groups)))]
        parent = data.draw(st.sampled_from(members))
        child = self._new_seq(parent.token_ids)
        self.kv.share(parent, child)
        members.append(child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def append_one(self, data, tokens):
        members = self.groups[data.draw(st.sampled_from(sorted(self.groups)))]
        seq = data.draw(st.sampled_from(members))
        seq.token_ids.extend(tokens)
        if not self.kv.can_append(seq, len(tokens)):
            del seq.token_ids[-len(tokens) :]
            return
        self._write(seq, len(tokens))

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append_all(self, data, token):
        """A lockstep step: every member gets one token; the cost is counted exactly beforehand."""
        members = self.groups[data.draw(st.sampled_from(sorted(self.groups)))]
        cost = self.kv.append_cost([(seq, 1) for seq in members])
        if cost > self.pool.num_free:
            return
        free_before = self.pool.num_free
        for seq in members:
            seq.token_ids.append(token)
            self._write(seq, 1)
        assert free_before - self.pool.num_free == cost

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def prune(self, data):
        group_id = data.draw(st.sampled_from(sorted(self.groups)))
        members = self.groups[group_id]
        seq = members.pop(data.draw(st.integers(0, len(members) - 1)))
        self.kv.free(seq)
        if not members:
            del self.groups[group_id]

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def end_group(self, data):
        for seq in self.groups.pop(data.draw(st.sampled_from(sorted(self.groups)))):
            self.kv.free(seq)
        if not self.groups:
            assert self.pool.num_free == self.pool.num_blocks
            assert all(b.ref_cnt == 0 for b in self.pool.blocks)

    @invariant()
    def isolated_and_counted(self):
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for members in self.groups.values():
            for seq in members:
                for b in seq.block_table:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
                read = [
                    self.slots.get(s) for s in self.kv.slot_ids(seq.block_table, 0, seq.num_computed_tokens)
                ]
                assert read == seq.token_ids[: seq.num_computed_tokens], (
                    f"sequence {seq.seq_id} reads another's K/V"
                )
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0)

    def teardown(self):
        for members in self.groups.values():
            for seq in members:
                self.kv.free(seq)
        assert self.pool.num_free == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


TestGroupMachine = GroupMachine.TestCase
TestGroupMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
