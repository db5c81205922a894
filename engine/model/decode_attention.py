"""Decode attention for every decoding sequence of a step in one batched computation per layer.

A decoding sequence has one query row; its keys are its blocks of the pool. All of the step's
decoding sequences go through one gather and a fixed handful of batched ops per layer, instead
of a Python loop with one SDPA per sequence (~30 µs per sequence and layer: 8 ms of a 28 ms step
at eight sequences, measured). The price is at one sequence, where its ~20 torch calls cost about
twice the single SDPA call they replace (~50 against ~25 µs a layer in a real step).

Why not one SDPA over keys padded to the longest sequence: SDPA's rounding depends on the padded
length and on the batch size (measured on this CPU: a sequence's output differed in the last bit
in every one of 300 random batches), and a last-bit difference is enough to flip a greedy near-tie.
A request's tokens would then depend on its neighbours. This kernel is batch invariant by
construction, and `tests/engine/test_decode_attention.py` checks it bit for bit:
- every matrix product has the same shape for every sequence: a block's [group, head_dim] queries
  against its [block_size, head_dim] keys, and its probabilities against its values; only the
  number of such products changes with the batch;
- per-block reductions run over exactly block_size slots; the max over a sequence's blocks is
  exact in any order;
- the sum over blocks is a cumsum (on the CPU a sequential scan, accumulated in double) whose last
  element is read, and a sequence's blocks sit at the end of its padded row (left padding), so the
  padding blocks before them add exact zeros and the sum never depends on how long the row is.
Masked slots (padding, the unwritten end of the last block, keys outside a sliding window) get a
-inf bias, so they weigh exactly zero.

The softmax runs in float32 whatever the pool holds. Soft-capping (Gemma 2) and attention sinks
(gpt-oss: one logit per head that takes probability mass and gives no value) fit in the same
computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.limits import blocks_for_tokens
from engine.model.kv_storage import Blocks, PagedKVStorage, SeqSlice, block_index
from engine.model.layer_attention import LayerAttention


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """The step's decoding sequences laid out for one window: built once per step, used by every
    layer with that window."""

    rows: torch.Tensor | slice  # their query rows in the packed forward
    count: int  # sequences
    blocks_per_row: int  # blocks of the longest, after skipping blocks wholly outside its window
    blocks: Blocks  # [count * blocks_per_row] pool block ids, each row left-padded (or a slice)
    bias: torch.Tensor  # [count * blocks_per_row * kv_heads, 1, block_size]: 0, or -inf where masked

    @classmethod
    def build(cls, storage: PagedKVStorage, seqs: list[SeqSlice], window: int | None) -> DecodeGroup:
        """`seqs`: the decoding sequences, in batch order."""
        bs, device = storage.block_size, storage.device
        tables: list[list[int]] = []
        firsts: list[int] = []  # first kept block of each sequence, in blocks
        for seq in seqs:
            ids = _block_ids(seq)[: blocks_for_tokens(seq.context_len, bs)]
            first = 0 if window is None else max(0, seq.context_len - window) // bs
            tables.append(ids[first:])
            firsts.append(first)
        width = max(len(t) for t in tables)
        pads = [width - len(t) for t in tables]
        flat = [block for pad, table in zip(pads, tables) for block in [0] * pad + table]
        # the position of every slot of every padded row; padding has negative positions
        slot = torch.arange(width * bs, device=device)[None, :]
        offset = torch.tensor([(f - p) * bs for f, p in zip(firsts, pads)], device=device)[:, None]
        position = slot + offset
        context = torch.tensor([seq.context_len for seq in seqs], device=device)[:, None]
        keep = (slot >= torch.tensor(pads, device=device)[:, None] * bs) & (position < context)
        if window is not None:
            keep &= position >= context - window
        bias = torch.zeros(keep.shape, dtype=torch.float32, device=device).masked_fill_(~keep, float("-inf"))
        heads = storage.num_kv_heads
        bias = bias.view(-1, 1, 1, bs).expand(-1, heads, -1, -1).reshape(-1, 1, bs)
        q_rows = [seq.q_start for seq in seqs]
        rows: torch.Tensor | slice
        if q_rows == list(range(q_rows[0], q_rows[0] + len(q_rows))):
            rows = slice(q_rows[0], q_rows[0] + len(q_rows))  # the runner puts decode rows first
        else:
            rows = torch.tensor(q_rows, dtype=torch.long, device=device)
        return cls(rows, len(seqs), width, block_index(flat, device), bias.contiguous())


def _block_ids(seq: SeqSlice) -> list[int]:
    blocks = seq.blocks
    if isinstance(blocks, slice):
        return list(range(blocks.start or 0, blocks.stop))
    ids: list[int] = blocks.tolist()
    return ids


def decode_attention(
    storage: PagedKVStorage, layer: int, q: torch.Tensor, group: DecodeGroup, how: LayerAttention
) -> torch.Tensor:
    """q [count, heads, head_dim], one query per decoding sequence -> [count, heads, head_dim].
    Written with as few torch calls as it takes: at one sequence each call's Python overhead is
    most of the cost."""
    n, width, bs = group.count, group.blocks_per_row, storage.block_size
    kv_heads, d = storage.num_kv_heads, storage.head_dim
    heads = q.shape[1]
    g = heads // kv_heads  # query heads per KV head (GQA), each KV head's keys read once
    # one [bs, d] matrix per (sequence, block, KV head), K and V
    k, v = storage.gather_blocks(layer, group.blocks, torch.float32).view(2, -1, bs, d).unbind(0)
    rows = q if q.dtype == torch.float32 else q.float()
    # every block's queries [n * width * kv_heads, g, d]
    if n == 1:
        queries = rows.expand(width, heads, d).reshape(-1, g, d)
    else:
        queries = rows[:, None].expand(n, width, heads, d).reshape(-1, g, d)
    scale = how.scaling if how.scaling is not None else d**-0.5
    if how.softcap is None:
        scores = torch.baddbmm(group.bias, queries, k.mT, alpha=scale)
    else:
        scores = torch.bmm(queries, k.mT).mul_(scale / how.softcap).tanh_()
        scores = scores.mul_(how.softcap).add_(group.bias)
    scores = scores.view(n, width, kv_heads, g, bs)
    peak = scores.amax(dim=(1, 4), keepdim=True)  # [n, 1, kv_heads, g, 1]
    sinks = None
    if how.sinks is not None:
        sinks = how.sinks.float().view(1, 1, kv_heads, g, 1)
        peak = torch.maximum(peak, sinks)
    probs = scores.sub_(peak).exp_()
    weighted = torch.bmm(probs.view(-1, g, bs), v).view(n, width, kv_heads, g, d)
    numerator = weighted.cumsum(1)[:, -1]  # [n, kv_heads, g, d]
    denominator = probs.sum(-1, keepdim=True).cumsum(1)[:, -1]  # [n, kv_heads, g, 1]
    if sinks is not None:
        denominator = denominator + (sinks - peak).exp_()[:, 0]
    out = numerator.div_(denominator).view(n, heads, d)
    return out if out.dtype == q.dtype else out.to(q.dtype)
