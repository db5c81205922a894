"""Every logits row an engine's forwards produce, by (sequence, position): tests that compare two
ways of computing the same steps (the own forward and transformers' code, fused layers and op by
op) read them here."""

from __future__ import annotations

import torch


def record_logit_rows(engine, observer=None, middles=None) -> dict[tuple[int, int], torch.Tensor]:
    """Wrap `engine`'s runner so that each forward's logits rows land in the returned dict (the
    forward called with `observer`), and its kept middle residual rows in `middles` if given."""
    logits: dict[tuple[int, int], torch.Tensor] = {}
    forward = engine.runner.forward

    def recording(seqs, num_tokens, counts):
        result = forward(seqs, num_tokens, counts, observer)
        for seq, n in zip(seqs, num_tokens):
            if seq.seq_id in result.rows:
                start, count = result.rows[seq.seq_id]
                end = seq.num_computed_tokens + n
                for i in range(count):
                    logits[(seq.seq_id, end - count + i)] = result.logits[start + i].clone()
                    if middles is not None:
                        middles[(seq.seq_id, end - count + i)] = result.middle[start + i].clone()
        return result

    engine.runner.forward = recording
    return logits
