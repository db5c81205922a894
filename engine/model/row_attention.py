"""Attention row by row over the paged cache, on kvk's C kernel (engine/kernels/native/attention.c).

Every query row attends exactly its own positions through its sequence's block table, computed
alone in one fixed order: a decode row, a speculative verification row and a short prefill row at
the same position are the same computation, whatever else shares the step. Every sequence of a
step takes this path, prefill chunks too: SDPA's CPU kernel splits a chunk's rows into blocks
from the chunk's first row and computes a block of 1 to 3 rows by another path, so a prompt's
last rows rounded differently when a prefix-cache hit started their chunk elsewhere than the
prompt's own (the packaged model's greedy replies differed from their replies alone under the
serve load run). Row by row, a row's bits depend only on its position and the cache: alone,
batched, chunked, cached or recomputed. A prefill's attention is a few percent of its FLOPs
(the projections and the MLP are the rest), so the GEMM SDPA would bring is small there.

The step's layout (which rows, their block tables and positions) is built once per step and read
by every layer; a layer's attention is then one C call on views of its query rows and its pool.
Without kvk (no build and no compiler) the torch decode path (engine/model/decode_attention.py)
runs the decoding sequences instead and every prefill chunk takes SDPA (which is not batch
invariant: see above).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.config import MAX_NUM_DRAFT
from engine.kernels import native
from engine.limits import blocks_for_tokens

if TYPE_CHECKING:
    from engine.model.kv_storage import PagedKVStorage, SeqSlice
    from engine.model.layer_attention import LayerAttention

# Without kvk, a sequence with at most this many query rows in a step attends row by row in torch
# (decode_attention): decode (1), a speculative verification (1 + k rows, k <= MAX_NUM_DRAFT: every
# round's rows, so each is the decode it stands for), a chunk this short. With kvk every row does.
ROW_LIMIT = 1 + MAX_NUM_DRAFT

# A pool's elements as attention.c's kv_type (its KV_F32, KV_F16, KV_BF16, KV_I8)
POOL_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


@dataclass(slots=True)
class RowPlan:
    """The rows of one step that attend row by row: built once per step, used by every layer."""

    lib: native.Kvk
    rows: slice | torch.Tensor  # their rows in the packed forward
    count: int
    tables: np.ndarray  # int32, every row's sequence's block table, one after another
    table_start: np.ndarray  # int64 [count]: where row r's table starts in `tables`
    stops: np.ndarray  # int64 [count]: position + 1 of each row (it attends [start, stop))
    covered: frozenset[int]  # indices of the batch's sequences handled here
    _starts: dict[int | None, np.ndarray] = field(default_factory=dict)
    _addresses: dict[int | None, tuple[int, int, int, int]] = field(default_factory=dict)

    @classmethod
    def build(cls, storage: PagedKVStorage, seqs: list[SeqSlice]) -> RowPlan | None:
        lib = native.kernels()
        if lib is None or storage.kv[0].dtype not in POOL_KINDS:
            return None
        chosen = list(range(len(seqs)))
        if not chosen:
            return None
        tables: list[int] = []
        table_start: list[int] = []
        stops: list[int] = []
        rows: list[int] = []
        bs = storage.block_size
        for i in chosen:
            seq = seqs[i]
            ids = _block_ids(seq)[: blocks_for_tokens(seq.context_len, bs)]
            first = len(tables)
            tables.extend(ids)
            past = seq.context_len - seq.q_len
            for r in range(seq.q_len):
                table_start.append(first)
                stops.append(past + r + 1)
                rows.append(seq.q_start + r)
        where: slice | torch.Tensor
        if rows == list(range(rows[0], rows[0] + len(rows))):
            where = slice(rows[0], rows[0] + len(rows))  # the runner puts decode rows first
        else:
            where = torch.tensor(rows, dtype=torch.long, device=storage.device)
        return cls(
            lib,
            where,
            len(rows),
            np.asarray(tables, dtype=np.int32),
            np.asarray(table_start, dtype=np.int64),
            np.asarray(stops, dtype=np.int64),
            frozenset(chosen),
        )

    def starts(self, window: int | None) -> np.ndarray:
        """Each row's first attended position: 0, or the sliding window's (keys in
        (position - window, position])."""
        if window not in self._starts:
            self._starts[window] = (
                np.zeros_like(self.stops) if window is None else np.maximum(self.stops - window, 0)
            )
        return self._starts[window]

    def addresses(self, window: int | None) -> tuple[int, int, int, int]:
        """The C call's (tables, table_start, starts, stops) addresses, read once a step: numpy's
        .ctypes costs ~1 us each, four a layer."""
        if window not in self._addresses:
            starts = self.starts(window)
            self._addresses[window] = (
                self.tables.ctypes.data,
                self.table_start.ctypes.data,
                starts.ctypes.data,
                self.stops.ctypes.data,
            )
        return self._addresses[window]


def _block_ids(seq: SeqSlice) -> list[int]:
    blocks = seq.blocks
    if isinstance(blocks, slice):
        return list(range(blocks.start or 0, blocks.stop))
    ids: list[int] = blocks.tolist()
    return ids


def row_attention(
    storage: PagedKVStorage,
    layer: int,
    q: torch.Tensor,
    plan: RowPlan,
    how: LayerAttention,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [count, heads, d] (the plan's rows; any row stride, heads contiguous) -> [count, heads, d].
    `probs`: float32 [count, heads, width] (width >= every row's stop - start, contiguous) that the
    kernel fills with each row's probabilities over its positions [start, stop), zero past a
    row's end (the attention view's numbers: the step's own)."""
    count, heads, d = q.shape
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
        q = q.float().contiguous()
    out = torch.empty(count, heads, d, dtype=torch.float32, device=q.device)
    k_pool, v_pool = storage.k[layer], storage.v[layer]
    quantized = storage.quantized
    sinks = None if how.sinks is None else how.sinks.float().contiguous()
    tables, table_start, starts, stops = plan.addresses(how.window)
    status = plan.lib.lib.kvk_paged_attention(
        q.data_ptr(),
        q.stride(0),
        count,
        heads,
        d,
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        POOL_KINDS[k_pool.dtype],
        storage.k_scale[layer].data_ptr() if quantized else None,
        storage.v_scale[layer].data_ptr() if quantized else None,
        storage.block_size,
        storage.num_kv_heads,
        tables,
        table_start,
        starts,
        stops,
        how.scaling if how.scaling is not None else d**-0.5,
        how.softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
        heads * d,
        None if probs is None else probs.data_ptr(),
        0 if probs is None else probs.shape[-1],
    )
    if status != 0:
        raise RuntimeError(f"kvk_paged_attention refused layer {layer}'s rows (status {status})")
    return out
