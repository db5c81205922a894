"""The engine's state at one instant, as the events a subscriber would have seen to reach it.

A client that subscribes to `/v1/kvscope/events` while the engine has been running needs the
pool as it is: which blocks are held, by whom, how full, which are cached prefixes, where each
sits in its sequence, which were copied from which, when each last changed. The pool's blocks
keep all of it (engine.kv.block_pool notes what their events told); `state_events` runs on the
engine thread (between two steps), so the live stream that follows it continues from exactly
this state.
"""

from __future__ import annotations

import time

from engine.core.llm_engine import LLMEngine
from engine.events import BlockEvent, Event, ModelLoaded, RequestStarted, SequenceForked


def state_events(core: LLMEngine) -> list[Event]:
    """ModelLoaded, the live requests (and forks) and the pool's blocks, oldest holder first."""
    pool, bs = core.kv.pool, core.kv.block_size
    now = time.perf_counter()
    out: list[Event] = [ModelLoaded(core.loaded.info, pool.num_blocks, bs, core.storage.total_bytes, now)]
    seqs = list(core.seqs.values())  # creation order: a block's first holder comes first
    for seq in seqs:
        group = seq.group
        if group is None or seq.seq_id == group.request_id:
            out.append(RequestStarted(seq.seq_id, seq.num_prompt_tokens, seq.arrival_time))
        else:
            out.append(
                SequenceForked(
                    group.request_id, group.request_id, seq.seq_id, seq.branch, seq.num_tokens, now
                )
            )
    seen: set[int] = set()
    for seq in seqs:
        for index, block in enumerate(seq.block_table):
            b, start, t = block.block_id, index * bs, block.touched_t or now
            fills = (block.num_tokens,)
            if b in seen:
                out.append(BlockEvent("share", (b,), seq.seq_id, start, start + block.num_tokens, fills, t))
                continue
            seen.add(b)
            out.append(BlockEvent("allocate", (b,), seq.seq_id, t=t))
            if block.copied_from is not None:
                out.append(BlockEvent("cow", (b,), seq.seq_id, start, start, fills, t, (block.copied_from,)))
            elif block.num_tokens:
                out.append(BlockEvent("append", (b,), seq.seq_id, start, start + block.num_tokens, fills, t))
            if block.block_hash is not None:
                out.append(BlockEvent("cache", (b,), seq.seq_id, start, start + bs, t=t))
    for block in pool.blocks:
        if block.ref_cnt or block.block_hash is None:
            continue
        b = block.block_id
        start, t = max(block.token_start, 0), block.touched_t or now
        out.append(BlockEvent("allocate", (b,), None, t=t))
        out.append(BlockEvent("append", (b,), None, start, start + block.num_tokens, (block.num_tokens,), t))
        out.append(BlockEvent("cache", (b,), None, start, start + bs, t=t))
        out.append(BlockEvent("free", (b,), None, t=t))
    return out
