"""kvk's paged attention: every row over exactly its own positions of the pool, equal to a float64
reference (GQA, windows, soft-capping, sinks, float16/bfloat16/int8 pools), each row the same
alone and among others, and its probabilities the step's own."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import native

KVK = native.kernels()
pytestmark = pytest.mark.skipif(KVK is None, reason=native.status())


def pool(blocks=12, kv_heads=2, block_size=4, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, kv_heads, block_size, d, generator=g)
    v = torch.randn(blocks, kv_heads, block_size, d, generator=g)
    if dtype == torch.int8:
        ks, vs = (t.abs().amax(-1) / 127 for t in (k, v))
        ks, vs = ks.half(), vs.half()
        kc = torch.round(k / ks.float()[..., None]).clamp(-127, 127).to(torch.int8)
        vc = torch.round(v / vs.float()[..., None]).clamp(-127, 127).to(torch.int8)
        return kc, vc, ks, vs
    return k.to(dtype), v.to(dtype), None, None


def reference(q, k, v, ks, vs, table, start, stop, scale, softcap=None, sinks=None):
    """One row [heads, d] in float64 over positions [start, stop) of its table."""
    bs, kv_heads = k.shape[2], k.shape[1]
    heads, d = q.shape
    pos = torch.arange(start, stop)
    blocks, slots = torch.tensor(table)[pos // bs], pos % bs
    keys, vals = k[blocks, :, slots].double(), v[blocks, :, slots].double()  # [n, kv_heads, d]
    if ks is not None:
        keys = keys * ks[blocks, :, slots].double()[..., None]
        vals = vals * vs[blocks, :, slots].double()[..., None]
    group = heads // kv_heads
    keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
    s = torch.einsum("hd,nhd->hn", q.double(), keys) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None]], 1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[:, :-1]
    return torch.einsum("hn,nhd->hd", p, vals), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("what", ["plain", "window", "softcap", "sinks"])
@pytest.mark.parametrize("d", [16, 64, 128])  # 64 and 128: the widths the kernel has as constants
def test_each_row_equals_the_float64_reference(dtype, what, d):
    k, v, ks, vs = pool(dtype=dtype, d=d)
    heads = 6
    g = torch.Generator().manual_seed(1)
    tables = [[3, 7, 1, 0, 9], [5, 2], [11, 4, 8, 6]]
    stops = [19, 6, 13]
    starts = [max(0, s - 7) if what == "window" else 0 for s in stops]
    q = torch.randn(3, heads, d, generator=g)
    softcap = 2.0 if what == "softcap" else None
    sinks = torch.randn(heads, generator=g) if what == "sinks" else None
    out, probs = KVK.paged_attention(q, k, v, tables, starts, stops, 0.25, softcap, sinks, ks, vs, probs=True)
    for r in range(3):
        want, want_p = reference(q[r], k, v, ks, vs, tables[r], starts[r], stops[r], 0.25, softcap, sinks)
        assert torch.allclose(out[r].double(), want, atol=2e-5, rtol=1e-4)
        n = stops[r] - starts[r]
        assert torch.allclose(probs[r, :, :n].double(), want_p, atol=1e-6)
        assert torch.all(probs[r, :, n:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("window", [None, 60])
def test_a_row_is_the_same_alone_among_others_and_as_a_decode_at_its_position(dtype, window):
    """A verification row at position p (several rows of one sequence) computes exactly what the
    decode step at p computes, its probabilities too, for every kind of pool, with and without a
    window, and no row depends on its neighbours."""
    k, v, ks, vs = pool(blocks=40, block_size=8, d=64, dtype=dtype, seed=2)
    heads = 8
    g = torch.Generator().manual_seed(3)
    table = list(range(39, 0, -1))
    q = torch.randn(5, heads, 64, generator=g)
    stops = [100, 101, 102, 103, 104]  # one sequence's verification rows, causal
    starts = [0 if window is None else s - window for s in stops]
    together, p_together = KVK.paged_attention(
        q, k, v, [table] * 5, starts, stops, 0.125, None, None, ks, vs, True
    )
    for r in range(5):
        alone, p_alone = KVK.paged_attention(
            q[r : r + 1], k, v, [table], starts[r : r + 1], [stops[r]], 0.125, None, None, ks, vs, True
        )
        assert torch.equal(alone[0], together[r])
        n = stops[r] - starts[r]
        assert torch.equal(p_alone[0, :, :n], p_together[r, :, :n])
    mixed, _ = KVK.paged_attention(
        torch.cat([q[:2], torch.randn(3, heads, 64, generator=g)]),
        k,
        v,
        [table, table, [1], [2, 3], [4]],
        [*starts[:2], 0, 0, 0],
        [100, 101, 3, 12, 8],
        0.125,
        None,
        None,
        ks,
        vs,
    )
    assert torch.equal(mixed[:2], together[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=str)
def test_a_prompt_chunks_rows_are_each_the_row_alone(dtype):
    """A prompt chunk's rows (one sequence, one position after another, their (row, KV head) tasks
    split between the threads) are each what the row computes alone, with GQA and a head width
    the kernel has no constant for (32)."""
    k, v, ks, vs = pool(blocks=24, kv_heads=2, block_size=16, d=32, dtype=dtype, seed=4)
    heads, rows = 6, 70
    g = torch.Generator().manual_seed(5)
    table = [(7 * i) % 24 for i in range(24)]
    q = torch.randn(rows, heads, 32, generator=g)
    stops = [300 + r for r in range(rows)]
    together, _ = KVK.paged_attention(q, k, v, [table] * rows, [0] * rows, stops, 0.2, None, None, ks, vs)
    for r in (0, 1, 33, 34, rows - 1):
        alone, _ = KVK.paged_attention(q[r : r + 1], k, v, [table], [0], [stops[r]], 0.2, None, None, ks, vs)
        assert torch.equal(alone[0], together[r])


def test_rows_without_positions_are_refused():
    k, v, _, _ = pool()
    with pytest.raises(ValueError, match="refused"):
        KVK.paged_attention(torch.randn(1, 4, 16), k, v, [[0]], [3], [3], 0.25)
