"""The logits each recorded token was drawn from, kept (within a byte budget) so that a what-if
runs the sampler's stages on the step's own numbers: under the token's own settings it is then
its recorded distribution bit for bit, on any weights and any batch.

Only tokens that record a snapshot (the app's replies; a server request asking for logprobs) are
kept: a copy of one row of logits per token, oldest dropped first. A token whose logits were
dropped is recomputed through the engine's paged forward instead (engine/core/what_if.py), and
the what-if says which it used. Keyed by the context the token was drawn after (its length and
the hash of its tokens): a what-if names a token by its request's prompt and the reply before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

# 64 MiB: ~340 tokens of a 49k vocabulary (SmolLM2), ~110 of a 151k one (Qwen), in float32.
KEPT_LOGITS_BYTES = 64 * 2**20

Key = tuple[int, int]


def context_key(context: Sequence[int]) -> Key:
    return len(context), hash(tuple(context))


class KeptLogits:
    def __init__(self, budget_bytes: int = KEPT_LOGITS_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[Key, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def keep(self, context: Sequence[int], logits: torch.Tensor) -> None:
        """Keep a copy of `logits` [vocab], drawn from after `context` (a group's samples drawing
        from the same row keep it once)."""
        key = context_key(context)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        row = logits.detach().reshape(-1).clone()
        size = row.numel() * row.element_size()
        if size > self.budget_bytes:
            return
        self._entries[key] = row
        self._bytes += size
        while self._bytes > self.budget_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.numel() * dropped.element_size()

    def get(self, context: Sequence[int]) -> torch.Tensor | None:
        return self._entries.get(context_key(context))

    def __len__(self) -> int:
        return len(self._entries)
