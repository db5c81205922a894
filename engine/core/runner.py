"""One packed forward of the model over a scheduled batch, reading and writing the paged cache."""

from __future__ import annotations

import torch

from engine.core.sequence import Sequence
from engine.kv.manager import KVCacheManager
from engine.kv.paged_cache import (
    PagedBatch,
    PagedCache,
    PagedKVStorage,
    SeqSlice,
    block_index,
    paged_attention,
)


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, storage: PagedKVStorage, kv: KVCacheManager, device: torch.device
    ):
        self.model = model
        self.storage = storage
        self.kv = kv
        self.device = device
        self._cache = PagedCache()

    def build_batch(self, seqs: list[Sequence], num_tokens: list[int]):
        """Packed token ids, positions and the paged-attention description of the batch."""
        ids, positions, slots, slices = [], [], [], []
        block_size = self.storage.block_size
        for seq, n in zip(seqs, num_tokens):
            start = seq.num_computed_tokens
            q_start = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.kv.slot_ids(seq, start, n))
            context = start + n
            table = [b.block_id for b in seq.block_table[: -(-context // block_size)]]
            slices.append(SeqSlice(q_start, n, context, block_index(table, self.device)))
        to = dict(dtype=torch.long, device=self.device)
        batch = PagedBatch(self.storage, torch.tensor(slots, **to), slices)
        return torch.tensor([ids], **to), torch.tensor([positions], **to), batch

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], num_tokens: list[int], logit_rows: list[int]) -> torch.Tensor:
        """Run the batch; returns float32 logits [len(logit_rows), vocab] for the packed token
        positions in `logit_rows` (the lm_head runs only on those)."""
        input_ids, position_ids, batch = self.build_batch(seqs, num_tokens)
        keep = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        with paged_attention(self.model, batch):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=keep,
                paged_batch=batch,
            )
        return out.logits[0].float()
