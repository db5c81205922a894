"""Prefix caching at the KV-manager level: exact block ids, ref counts, hits and eviction order."""

from engine.config import SamplingParams
from engine.core.sequence import Sequence
from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager, chain_hash

BS = 4


def make(num_blocks=10, caching=True):
    events = []
    pool = BlockPool(num_blocks, BS, events.append)
    return KVCacheManager(pool, caching), events


def seq(seq_id, tokens):
    return Sequence(seq_id, list(tokens), len(tokens), SamplingParams())


def prefill(kv, s):
    """Admit and compute the whole prompt, as one scheduler step would."""
    cached = kv.find_cached_prefix(s)
    n = s.num_tokens - len(cached) * BS
    assert kv.can_allocate(s, cached, n)
    kv.allocate(s, cached, n)
    kv.commit(s, n)
    return cached


def ids(blocks):
    return [b.block_id for b in blocks]


def test_full_blocks_are_cached_and_shared_by_a_second_request():
    kv, events = make()
    a = seq(1, range(10))  # blocks: [0..3] [4..7] [8, 9]
    prefill(kv, a)
    assert ids(a.block_table) == [0, 1, 2]
    assert [b.block_hash is not None for b in a.block_table] == [True, True, False]
    assert [e.op for e in events] == ["allocate", "append", "cache", "cache"]
    assert events[1].fills == (4, 4, 2)

    b = seq(2, list(range(8)) + [50, 51, 52])  # same first two blocks
    cached = prefill(kv, b)
    assert ids(cached) == [0, 1]
    assert ids(b.block_table) == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert kv.hit_tokens == 8 and kv.queries == 2
    kv.pool.check_invariants()


def test_last_prompt_token_is_always_recomputed():
    kv, _ = make()
    prefill(kv, seq(1, range(8)))  # two full cached blocks
    again = seq(2, range(8))  # identical prompt, block aligned
    cached = kv.find_cached_prefix(again)
    assert ids(cached) == [0]  # the second block holds the last token: recomputed, not shared
    assert kv.can_allocate(again, cached, 4)
    kv.allocate(again, cached, 4)
    assert again.num_computed_tokens == 4
    assert ids(again.block_table) == [0, 2]


def test_freed_blocks_stay_cached_until_evicted_in_lru_order():
    kv, events = make(num_blocks=5)
    a = seq(1, range(9))  # 2 full blocks + 1
    prefill(kv, a)
    kv.free(a)
    # tail first: block 2 (uncached) to the front; 1 then 0 to the back
    assert kv.pool.free_order() == [2, 3, 4, 1, 0]
    assert kv.pool.num_cached_free == 2

    hit = seq(2, list(range(4)) + [9, 9, 9])  # shares only block 0
    cached = prefill(kv, hit)
    assert ids(cached) == [0] and kv.pool.blocks[0].ref_cnt == 1
    assert ids(hit.block_table) == [0, 2]

    events.clear()
    big = seq(3, range(100, 112))  # 12 tokens = 3 blocks: 3, 4, then evicts cached block 1
    prefill(kv, big)
    assert ids(big.block_table) == [3, 4, 1]
    evicted = [e.block_ids for e in events if e.op == "evict"]
    assert evicted == [(1,)]
    assert kv.pool.lookup(kv._block_keys(a, 2)[1]) is None
    assert kv.pool.lookup(kv._block_keys(a, 1)[0]) is kv.pool.blocks[0]


def test_prefix_cache_off_shares_nothing():
    kv, events = make(caching=False)
    prefill(kv, seq(1, range(8)))
    b = seq(2, range(8))
    assert prefill(kv, b) == []
    assert not [e for e in events if e.op in ("cache", "share")]


def test_can_allocate_counts_revived_cached_blocks_as_used():
    kv, _ = make(num_blocks=3)
    a = seq(1, range(5))
    prefill(kv, a)  # blocks 0 (cached), 1
    kv.free(a)
    b = seq(2, list(range(4)) + list(range(20, 28)))  # 12 tokens: hit block 0 + needs 2 more
    cached = kv.find_cached_prefix(b)
    assert ids(cached) == [0]
    assert kv.can_allocate(b, cached, 8)  # 2 free (1, 2) besides the revived block 0
    assert not kv.can_allocate(b, cached, 9)


def collision_case(kv):
    """a = [A1, X, .], c = [B1, Y, .] cached; b = [B1, X, .] finds c's first block, and its
    second block's key differs from a's second only through the parent (A1 against B1)."""
    a = seq(1, [1, 2, 3, 4, 9, 9, 9, 9, 7])
    c = seq(3, [5, 6, 7, 8, 0, 0, 0, 0, 7])
    prefill(kv, a)
    prefill(kv, c)
    return a, c, seq(2, [5, 6, 7, 8, 9, 9, 9, 9, 7])


def test_a_forced_64_bit_collision_does_not_serve_another_prefix(monkeypatch):
    """With the old key (Python's 64-bit hash of the parent, the block's tokens) a collision of
    the parents' hashes made b's second block look cached: a's, computed after another first
    block (vLLM's CVE-2025-25183). Every Python-level hash in the manager is forced to one
    value here; the SHA-256 keys do not use it, so b gets c's first block and nothing of a's."""
    import engine.kv.manager as manager

    monkeypatch.setattr(manager, "hash", lambda _value: 0, raising=False)
    kv, _ = make()
    a, c, b = collision_case(kv)
    assert ids(kv.find_cached_prefix(b)) == ids(c.block_table[:1])
    prefill(kv, b)
    assert not set(ids(a.block_table)) & set(ids(b.block_table))
    kv.pool.check_invariants()


def test_keys_agreeing_in_64_bits_are_told_apart(monkeypatch):
    """The collision in the chain itself: the first blocks' keys are made to agree in their
    first 64 bits; keys are compared whole, so b's second block is still keyed apart from a's."""
    import engine.kv.manager as manager

    real = manager.chain_hash

    def colliding(parent, tokens, kernels=b""):
        key = real(parent, tokens, kernels)
        return bytes(8) + key[8:] if parent is None else key

    monkeypatch.setattr(manager, "chain_hash", colliding)
    kv, _ = make()
    a, c, b = collision_case(kv)
    keys_a, keys_b = kv._block_keys(a, 2), kv._block_keys(b, 2)
    assert keys_a[0][:8] == keys_b[0][:8] and keys_a[1] != keys_b[1]
    assert ids(kv.find_cached_prefix(b)) == ids(c.block_table[:1])


def test_block_keys_are_sha256_of_the_parent_key_and_the_tokens():
    import hashlib
    from array import array

    from engine.kv.manager import ROOT_KEY, chain_hash

    first = chain_hash(None, (1, 2, 3, 4))
    assert first == hashlib.sha256(ROOT_KEY + array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert (
        chain_hash(first, (5, 6, 7, 8)) == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    )
    kv, _ = make()
    a = seq(1, range(10))
    prefill(kv, a)
    assert [b.block_hash for b in a.block_table[:2]] == kv._block_keys(a, 2)


def kernel_table(threshold):
    """A kernel table's answer: prompts of `threshold` rows or more run 'dense', fewer 'kvk'."""
    return lambda rows: b"dense" if rows >= threshold else b"kvk"


def test_a_block_is_shared_only_with_a_prompt_whose_kernels_computed_it_alike():
    """A prompt's rows run the kernels its whole length picks; kernels round differently, so a
    block a short prompt computed is not served to a long one (its reply would not be its own)."""
    kv = KVCacheManager(BlockPool(12, BS), True, kernels_at=kernel_table(8))
    short = seq(1, range(6))  # 6 rows: kvk
    prefill(kv, short)
    long = seq(2, range(10))  # 10 rows: dense, the same first block
    assert prefill(kv, long) == []
    also_short = seq(3, list(range(5)) + [70, 71])  # 7 rows: kvk, the first block shared
    assert ids(prefill(kv, also_short)) == ids(short.block_table[:1])
    also_long = seq(4, list(range(8)) + [80])  # dense: the long prompt's two blocks
    assert ids(prefill(kv, also_long)) == ids(long.block_table[:2])
    kv.pool.check_invariants()


def test_decoded_positions_are_keyed_by_the_one_row_kernels():
    """Tokens after a prompt were computed one row at a time: a later prompt reuses them only
    where its own kernels are the one-row ones; a block the prompt ends inside names both."""
    kv = KVCacheManager(BlockPool(12, BS), True, kernels_at=kernel_table(6))
    a = seq(1, range(6))  # positions 0-5: dense
    prefill(kv, a)
    for token in (6, 7):  # decoded: kvk
        a.token_ids.append(token)
        kv.append(a, 1)
        kv.commit(a, 1)
    keys = kv._block_keys(a, 2)
    assert keys[1] == chain_hash(keys[0], (4, 5, 6, 7), b"2|dense|kvk")
    follow_up = seq(2, list(range(8)) + [90, 91])  # 10 rows, all dense: only block 0 is its own
    assert ids(prefill(kv, follow_up)) == ids(a.block_table[:1])
    kv.pool.check_invariants()


def test_one_kernel_at_every_row_count_shares_as_before():
    kv = KVCacheManager(BlockPool(12, BS), True, kernels_at=lambda rows: b"kvk")
    a = seq(1, range(6))
    prefill(kv, a)
    for token in (6, 7):
        a.token_ids.append(token)
        kv.append(a, 1)
        kv.commit(a, 1)
    follow_up = seq(2, list(range(8)) + [90, 91])
    assert ids(prefill(kv, follow_up)) == ids(a.block_table[:2])
