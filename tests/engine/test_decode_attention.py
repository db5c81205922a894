"""The batched decode attention: right against a float64 reference, and batch invariant bit for
bit (a sequence's output is the same alone and beside any neighbours), which is what keeps a
request's greedy tokens independent of what shares its step."""

import random

import pytest
import torch

from engine.config import MAX_NUM_DRAFT
from engine.model.kv_storage import PagedKVStorage, SeqSlice, block_index
from engine.model.layer_attention import LayerAttention
from engine.model.paged_attention import PagedBatch, attend

KV_HEADS, GROUP, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 3, 16, 4, 1024


def filled_storage(kv_dtype: str, seed: int) -> PagedKVStorage:
    storage = PagedKVStorage(
        1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu", kv_dtype=kv_dtype
    )
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(NUM_BLOCKS * BLOCK)
    key = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen) * 2
    value = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen)
    storage.write(0, storage.slot_rows(slots), key, value)
    return storage


def random_sequences(rng: random.Random, count: int, consecutive: bool) -> list[tuple[int, list[int]]]:
    """(context length, block ids) per sequence, blocks drawn without overlap."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    out = []
    for _ in range(count):
        context = rng.randint(1, rng.choice([60, 500]))
        need = -(-context // BLOCK)
        if consecutive:
            start = rng.randrange(0, NUM_BLOCKS - need)
            ids = list(range(start, start + need))
        else:
            ids, free = free[:need], free[need:]
        out.append((context, ids))
    return out


def decode(storage, how, seqs, queries):
    """One attend call over decoding sequences only; [len(seqs), heads, head_dim]."""
    slices = [SeqSlice(i, 1, ctx, block_index(ids, "cpu")) for i, (ctx, ids) in enumerate(seqs)]
    slots = torch.tensor([ids[(ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK for ctx, ids in seqs])
    return attend(storage, 0, queries, PagedBatch(storage, slots, slices), how)


def reference(storage, how, context, ids, query):
    """Softmax attention in float64 over the sequence's keys, as the family defines it."""
    k, v = storage.read(0, block_index(ids, "cpu"), 0, context, torch.float32)  # [kv_heads, L, d]
    k, v = k.double().repeat_interleave(GROUP, 0), v.double().repeat_interleave(GROUP, 0)
    scores = torch.einsum("hd,hld->hl", query.double(), k) * (how.scaling or HEAD_DIM**-0.5)
    if how.softcap is not None:
        scores = torch.tanh(scores / how.softcap) * how.softcap
    if how.window is not None:
        scores[:, : max(0, context - how.window)] = float("-inf")
    if how.sinks is not None:
        scores = torch.cat([scores, how.sinks.double()[:, None]], dim=1)
    probs = torch.softmax(scores, dim=1)[:, :context]
    return torch.einsum("hl,hld->hd", probs, v)


HOWS = {
    "plain": LayerAttention(),
    "scaled": LayerAttention(scaling=0.3),
    "window": LayerAttention(window=9),
    "softcap": LayerAttention(softcap=5.0),
    "sinks": LayerAttention(sinks=torch.linspace(-1, 2, KV_HEADS * GROUP)),
}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("name", list(HOWS))
def test_each_sequence_is_the_same_alone_and_in_any_batch(name, kv_dtype):
    how = HOWS[name]
    storage = filled_storage(kv_dtype, seed=1)
    rng = random.Random(7)
    for trial in range(12):
        seqs = random_sequences(rng, rng.randint(2, 7), consecutive=trial % 3 == 0)
        queries = torch.randn(
            len(seqs), KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(trial)
        )
        together = decode(storage, how, seqs, queries)
        for i, (context, ids) in enumerate(seqs):
            alone = decode(storage, how, [(context, ids)], queries[i : i + 1])
            assert torch.equal(alone[0], together[i]), (
                f"sequence {i} (context {context}) changed with its neighbours"
            )
            want = reference(storage, how, context, ids, queries[i]).float()
            torch.testing.assert_close(together[i], want, atol=2e-5, rtol=1e-5)


def test_decode_rows_beside_a_prefill_chunk_are_unchanged():
    """A mixed step (one sequence prefilling, others decoding) gives the decoding ones exactly
    what a decode-only step gives them."""
    storage = filled_storage("auto", seed=2)
    how = LayerAttention()
    seqs = [(37, [5, 9, 1, 30, 31, 60, 61, 62, 63, 64]), (12, [70, 71, 72])]
    queries = torch.randn(2, KV_HEADS * GROUP, HEAD_DIM)
    decode_only = decode(storage, how, seqs, queries)
    prefill = SeqSlice(2, 6, 6, block_index([80, 81], "cpu"))
    slices = [SeqSlice(i, 1, ctx, block_index(ids, "cpu")) for i, (ctx, ids) in enumerate(seqs)] + [prefill]
    mixed_q = torch.cat([queries, torch.randn(6, KV_HEADS * GROUP, HEAD_DIM)])
    mixed = attend(storage, 0, mixed_q, PagedBatch(storage, torch.arange(8), slices), how)
    assert torch.equal(mixed[:2], decode_only)


@pytest.mark.parametrize("rows", [5, 1 + MAX_NUM_DRAFT])
@pytest.mark.parametrize("kvk", ["on", "off"])
@pytest.mark.parametrize("name", ["plain", "window", "sinks"])
def test_a_verification_rows_are_the_decodes_at_their_positions(name, kvk, rows, monkeypatch):
    """A speculative round's k + 1 rows (beside a decoding sequence and a long prefill chunk)
    attend exactly as a lone decode at each of their positions would: on kvk's row attention
    and, without kvk, on the batched torch decode path (SDPA over the chunk would round them
    otherwise)."""
    from engine.kernels import native

    if kvk == "off":
        monkeypatch.setattr(native, "kernels", lambda: None)
    elif native.kernels() is None:
        pytest.skip("kvk is not built on this machine")
    how = HOWS[name]
    storage = filled_storage("auto", seed=3)
    ids = [5, 9, 1, 30, 31, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
    past = 37  # 37 tokens cached, then the last token and rows - 1 drafts
    q = torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    other = (23, [70, 71, 72, 73, 74, 75])
    other_q = torch.randn(1, KV_HEADS * GROUP, HEAD_DIM)
    prefill = torch.randn(20, KV_HEADS * GROUP, HEAD_DIM)
    slices = [
        SeqSlice(0, 1, other[0], block_index(other[1], "cpu")),
        SeqSlice(1, rows, past + rows, block_index(ids, "cpu")),
        SeqSlice(1 + rows, 20, 20, block_index([100, 101, 102, 103, 104], "cpu")),
    ]
    packed = torch.cat([other_q, q, prefill])
    mixed = attend(storage, 0, packed, PagedBatch(storage, torch.arange(packed.shape[0]), slices), how)
    for r in range(rows):
        alone = decode(storage, how, [(past + r + 1, ids)], q[r : r + 1])
        assert torch.equal(mixed[1 + r], alone[0]), f"verification row {r} differs from its decode"
    assert torch.equal(mixed[0], decode(storage, how, [other], other_q)[0])
