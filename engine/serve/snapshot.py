"""The engine's state at one instant, as the events a subscriber would have seen to reach it.

A client that subscribes to `/v1/kvscope/events` while the engine has been running needs the
pool as it is: which blocks are held, by whom, how full, which are cached prefixes. The pool
itself keeps ref counts, fill levels and hashes; `BlockMirror` (fed from the event sink) keeps
what it does not: a block's position in its sequence, the source of a copy-on-write copy and
when the block last changed. `state_events` runs on the engine thread (inside `Engine.call`),
so the live stream that follows it continues from exactly this state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.events import BlockEvent, Event, ModelLoaded, RequestStarted, SequenceForked

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine


class BlockMirror:
    """Per block: position of its first slot, the block it was copied from, last change time."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.token_start: dict[int, int] = {}
        self.copied_from: dict[int, int] = {}
        self.last_t: dict[int, float] = {}

    def apply(self, event: BlockEvent) -> None:
        bs = self.block_size
        for i, block in enumerate(event.block_ids):
            self.last_t[block] = event.t
            if event.op in ("append", "share", "cow"):
                self.token_start[block] = (event.token_start // bs + i) * bs
            if event.op == "cow" and i < len(event.src_block_ids):
                self.copied_from[block] = event.src_block_ids[i]
            elif event.op == "allocate":
                self.copied_from.pop(block, None)


def state_events(core: LLMEngine, mirror: BlockMirror) -> list[Event]:
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
            b, start, t = block.block_id, index * bs, mirror.last_t.get(block.block_id, now)
            fills = (block.num_tokens,)
            if b in seen:
                out.append(BlockEvent("share", (b,), seq.seq_id, start, start + block.num_tokens, fills, t))
                continue
            seen.add(b)
            out.append(BlockEvent("allocate", (b,), seq.seq_id, t=t))
            source = mirror.copied_from.get(b)
            if source is not None:
                out.append(BlockEvent("cow", (b,), seq.seq_id, start, start, fills, t, (source,)))
            elif block.num_tokens:
                out.append(BlockEvent("append", (b,), seq.seq_id, start, start + block.num_tokens, fills, t))
            if block.block_hash is not None:
                out.append(BlockEvent("cache", (b,), seq.seq_id, start, start + bs, t=t))
    for block in pool.blocks:
        if block.ref_cnt or block.block_hash is None:
            continue
        b = block.block_id
        start, t = mirror.token_start.get(b, 0), mirror.last_t.get(b, now)
        out.append(BlockEvent("allocate", (b,), None, t=t))
        out.append(BlockEvent("append", (b,), None, start, start + block.num_tokens, (block.num_tokens,), t))
        out.append(BlockEvent("cache", (b,), None, start, start + bs, t=t))
        out.append(BlockEvent("free", (b,), None, t=t))
    return out
