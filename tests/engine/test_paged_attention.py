"""The paged cache is the real KV storage: logits through it equal transformers' DynamicCache."""

import pytest
import torch
from tiny_models import make_tiny_llama
from transformers import DynamicCache

from engine.model.kv_storage import PagedKVStorage, SeqSlice, block_index
from engine.model.paged_attention import PagedBatch, PagedCache, paged_attention

VOCAB = 500


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(vocab_size=VOCAB, seed=3)


def paged_forward(model, storage, pieces):
    """pieces: list of (token ids, start position, block table) run as ONE packed forward.
    Returns the logits of every packed token."""
    bs = storage.block_size
    ids, pos, slots, slices = [], [], [], []
    for tokens, start, table in pieces:
        q_start = len(ids)
        ids += tokens
        pos += list(range(start, start + len(tokens)))
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
        ctx = start + len(tokens)
        blocks = table[: -(-ctx // bs)]
        slices.append(SeqSlice(q_start, len(tokens), ctx, block_index(blocks, "cpu")))
    batch = PagedBatch(storage, torch.tensor(slots), slices)
    with torch.inference_mode(), paged_attention(model):
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([pos]),
            cache=PagedCache(),
            paged_batch=batch,
        )
    return out.logits[0]


def make_storage(model, num_blocks, block_size):
    cfg = model.config
    return PagedKVStorage(
        cfg.num_hidden_layers,
        num_blocks,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
        torch.float32,
        "cpu",
    )


@pytest.mark.parametrize("layout", ["scattered", "consecutive"])
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_prefill_then_decode_matches_dynamic_cache(model, block_size, layout):
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (29,)).tolist()
    decode = torch.randint(0, VOCAB, (6,)).tolist()
    storage = make_storage(model, num_blocks=64, block_size=block_size)
    if layout == "scattered":  # non-monotonic physical blocks: gathered through an index
        table = list(range(63, 63 - 40, -1))[::-1][::2] + list(range(1, 40, 2))
    else:  # consecutive ids: read as a view of the pool
        table = list(range(5, 45))
    assert isinstance(block_index(table, "cpu"), slice) == (layout == "consecutive")

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        ref = [model(torch.tensor([prompt]), cache=cache).logits[0]]
        for i, tok in enumerate(decode):
            ref.append(
                model(torch.tensor([[tok]]), cache=cache, position_ids=torch.tensor([[29 + i]])).logits[0]
            )

    got = [paged_forward(model, storage, [(prompt, 0, table)])]
    for i, tok in enumerate(decode):
        got.append(paged_forward(model, storage, [([tok], 29 + i, table)]))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)


def test_chunked_prefill_matches_whole_prefill(model):
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (40,)).tolist()
    storage = make_storage(model, 16, 4)
    table = list(range(15, 5, -1))
    whole = paged_forward(model, make_storage(model, 16, 4), [(prompt, 0, table)])
    parts = [
        paged_forward(model, storage, [(prompt[a:b], a, table)])
        for a, b in [(0, 7), (7, 8), (8, 33), (33, 40)]
    ]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=0)


def test_two_sequences_in_one_forward_equal_separate_runs(model):
    torch.manual_seed(2)
    a = torch.randint(0, VOCAB, (23,)).tolist()
    b = torch.randint(0, VOCAB, (9,)).tolist()
    table_a, table_b = [0, 2, 4, 6], [1, 3, 5]
    alone_a = paged_forward(model, make_storage(model, 8, 8), [(a, 0, table_a)])
    alone_b = paged_forward(model, make_storage(model, 8, 8), [(b, 0, table_b)])
    storage = make_storage(model, 8, 8)
    packed = paged_forward(model, storage, [(a, 0, table_a), (b, 0, table_b)])
    torch.testing.assert_close(packed[:23], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[23:], alone_b, atol=1e-5, rtol=0)
    # and a mixed step: a decodes one token while b prefills its remainder
    b2 = torch.randint(0, VOCAB, (5,)).tolist()
    mixed = paged_forward(model, storage, [([7], 23, table_a), (b2, 9, table_b)])
    with torch.inference_mode():
        ref_a = model(torch.tensor([a + [7]])).logits[0, -1]
        ref_b = model(torch.tensor([b + b2])).logits[0, -5:]
    torch.testing.assert_close(mixed[0], ref_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1:], ref_b, atol=1e-5, rtol=0)


def test_kv_is_stored_in_the_pool_blocks(model):
    """The pool tensors hold the K of exactly the slots the block table names, nothing else (the
    pool is filled with NaN first: with kvk it is allocated uninitialised, read only where written)."""
    storage = make_storage(model, 6, 4)
    for pool in (*storage.k, *storage.v):
        pool.fill_(float("nan"))
    paged_forward(model, storage, [(list(range(10)), 0, [5, 2, 4])])
    k = storage.k[0]  # [blocks, kv_heads, block_size, head_dim]
    assert k[5].isfinite().all() and k[2].isfinite().all()
    assert k[4, :, :2].isfinite().all() and k[4, :, 2:].isnan().all()  # 10 tokens = 4 + 4 + 2
    for unused in (0, 1, 3):
        assert k[unused].isnan().all()
