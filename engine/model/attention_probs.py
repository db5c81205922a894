"""Every head's attention probabilities for the short rows of one forward: what the attention view
shows, read from the computation that attends.

A forward whose batch carries an `AttentionRecorder` (PagedBatch.recorder) keeps, per layer, the
probabilities of every row that attends row by row (the sequences of at most ROW_LIMIT rows: a
decode row, the replayed row of a token being inspected):
- on kvk, the kernel that computes the step writes them while it attends (the step's own numbers,
  over the same blocks, window, sinks and soft cap);
- without kvk (no build and no compiler) they are computed here in torch, float32, from the same
  K read through the same blocks, with the layer's window, soft cap and sinks.
Longer prefill chunks attend through SDPA and are not recorded. Without a recorder (every step of
generation) nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.model.row_attention import ROW_LIMIT, RowPlan

if TYPE_CHECKING:
    from engine.model.kv_storage import PagedKVStorage, SeqSlice
    from engine.model.layer_attention import LayerAttention

KVK_KERNEL = "kvk row attention (the kernel the step ran)"
TORCH_KERNEL = "torch (no kvk build here: the same K through the same blocks, float32)"


@dataclass(slots=True)
class RecordedLayer:
    """One layer's probabilities: row r over positions starts[r] + t for t < stops[r] - starts[r]."""

    probs: torch.Tensor  # float32 [rows, heads, width], zero past each row's end
    starts: np.ndarray  # int64 [rows]: first position each row attends (> 0 in a sliding window)
    stops: np.ndarray  # int64 [rows]: its position + 1
    how: LayerAttention
    kernel: str


@dataclass(slots=True)
class AttentionRecorder:
    layers: dict[int, RecordedLayer] = field(default_factory=dict)

    def kvk_buffer(self, layer: int, plan: RowPlan, heads: int, how: LayerAttention) -> torch.Tensor:
        """The buffer the kernel fills for the plan's rows in `layer`, kept as that layer's record."""
        starts = plan.starts(how.window).copy()
        stops = plan.stops.copy()
        width = int((stops - starts).max()) if plan.count else 0
        probs = torch.empty(plan.count, heads, width, dtype=torch.float32)
        self.layers[layer] = RecordedLayer(probs, starts, stops, how, KVK_KERNEL)
        return probs

    def record_torch(
        self,
        storage: PagedKVStorage,
        layer: int,
        q: torch.Tensor,
        seqs: list[SeqSlice],
        how: LayerAttention,
    ) -> None:
        """q [T, heads, d] packed over `seqs`: the probabilities of every row of the sequences of
        at most ROW_LIMIT rows (the rows kvk would have recorded), computed in torch."""
        rows: list[torch.Tensor] = []
        starts: list[int] = []
        stops: list[int] = []
        for seq in seqs:
            if seq.q_len > ROW_LIMIT:
                continue
            past = seq.context_len - seq.q_len
            for r in range(seq.q_len):
                stop = past + r + 1
                start = 0 if how.window is None else max(0, stop - how.window)
                rows.append(row_probabilities(storage, layer, q[seq.q_start + r], seq, start, stop, how))
                starts.append(start)
                stops.append(stop)
        if not rows:
            return
        heads = q.shape[1]
        width = max(p.shape[-1] for p in rows)
        probs = torch.zeros(len(rows), heads, width, dtype=torch.float32)
        for i, p in enumerate(rows):
            probs[i, :, : p.shape[-1]] = p
        self.layers[layer] = RecordedLayer(
            probs, np.asarray(starts, np.int64), np.asarray(stops, np.int64), how, TORCH_KERNEL
        )


def row_probabilities(
    storage: PagedKVStorage,
    layer: int,
    q_row: torch.Tensor,
    seq: SeqSlice,
    start: int,
    stop: int,
    how: LayerAttention,
) -> torch.Tensor:
    """One query row [heads, d] over positions [start, stop) of its sequence: [heads, stop - start]
    float32 probabilities (a sink's share is left out: with sinks a row sums to less than 1)."""
    k, _ = storage.read(layer, seq.blocks, start, stop, torch.float32)  # [kv_heads, n, d]
    heads, d = q_row.shape
    groups = heads // k.shape[0]
    if groups > 1:  # query head h reads KV head h // groups, as every GQA attention does
        k = k.repeat_interleave(groups, dim=0)
    scale = how.scaling if how.scaling is not None else d**-0.5
    scores = torch.einsum("hd,hnd->hn", q_row.float(), k) * scale
    if how.softcap is not None:
        scores = torch.tanh(scores / how.softcap) * how.softcap
    if how.sinks is None:
        return torch.softmax(scores, dim=-1)
    combined = torch.cat([scores, how.sinks.float().reshape(-1, 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[:, :-1]
