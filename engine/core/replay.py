"""A context run again through the engine's own forward, on the engine's own KV pool, between two
steps: how the views of the model's inside compute what they show (engine/core/inside_token.py,
experts.py, scoring.py, steering.py) and how a what-if recomputes logits it no longer keeps.

A replay is a sequence like a request's, outside the scheduler. Its blocks come from the pool (the
page map shows them under its own sequence id); the full blocks of the context that the prefix
cache still holds are reused as they are (`reuse=True`: the K/V the conversation's own steps
wrote); the rest runs in prefill chunks cut as the scheduler cuts them, through the same runner,
kernels and paged attention as a step; and a row to inspect runs alone, as a decode row does (the
weights' per-row kernels, kvk's row attention over the same blocks). Then its blocks are freed;
the full ones it computed enter the prefix cache like a finished request's, unless the forward
changed what the model computes (`keep=False`: steering), whose K/V must never serve a request.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.core.runner import ForwardProbe, ForwardResult
from engine.core.sequence import Sequence
from engine.errors import InspectionError
from engine.inside import REPLAY_SEQ_BASE
from engine.limits import blocks_for_tokens

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

# Sequence ids of replays: far above any request's (the thread service counts from 1, direct
# callers from 1_000_000), so the page map never takes a replay's blocks for a reply's.
REPLAY_SEQ_IDS = itertools.count(REPLAY_SEQ_BASE)


class Replay:
    """`with Replay(core, ids) as replay:` then `replay.run(...)` until every token is in."""

    def __init__(
        self,
        core: LLMEngine,
        ids: list[int],
        reuse: bool = True,
        keep: bool = True,
        prompt_tokens: int | None = None,
    ):
        """`prompt_tokens`: where the request's prompt ends in `ids` (a reply's context): the rows
        after it were decode rows and are recomputed as decode rows are (their one-row kernels),
        so a replayed row has the bits its step gave it. None: all of `ids` is a prompt."""
        if not ids:
            raise InspectionError("there is no token to run")
        window = core.limits.context_window
        if len(ids) > window:
            raise InspectionError(f"{len(ids)} tokens do not fit in the model's context of {window} tokens")
        self.core = core
        self.keep = keep and core.kv.enable_prefix_caching
        prompt = len(ids) if prompt_tokens is None else max(1, min(prompt_tokens, len(ids)))
        self.seq = Sequence(next(REPLAY_SEQ_IDS), list(ids), prompt, SamplingParams())
        kv = core.kv
        cached = kv.find_cached_prefix(self.seq) if reuse else []
        need = blocks_for_tokens(len(ids), kv.block_size) - len(cached)
        reused_from_free = sum(1 for b in cached if b.ref_cnt == 0)
        free = kv.pool.num_free - reused_from_free
        if need > free:
            raise InspectionError(
                f"the KV pool has {free} free blocks and this needs {need} for {len(ids)} tokens: "
                "try again when the replies running now have finished"
            )
        # The manager's allocate without its prefix-cache counters: a replay is no request, and
        # the hit rate the panels show is the requests'.
        kv.pool.touch(cached, self.seq.seq_id, 0)
        self.seq.block_table = list(cached)
        self.seq.num_computed_tokens = len(cached) * kv.block_size
        kv.append(self.seq, len(ids) - self.seq.num_computed_tokens)
        self.reused = self.seq.num_computed_tokens

    def __enter__(self) -> Replay:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.core.kv.free(self.seq)

    @property
    def done(self) -> int:
        """Tokens whose K/V are in the pool."""
        return self.seq.num_computed_tokens

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.seq.block_table)

    def chunk_size(self) -> int:
        """Tokens per forward, as the scheduler cuts a prompt (its token budget, its chunk size)."""
        config = self.core.config
        chunk = config.max_num_batched_tokens
        if config.prefill_chunk_size is not None:
            chunk = min(chunk, config.prefill_chunk_size)
        return max(1, chunk)

    def run(
        self,
        until: int,
        logits: str = "none",
        probe: Callable[[int, int], ForwardProbe | None] | None = None,
        on_result: Callable[[int, int, ForwardResult], None] | None = None,
        chunk: int | None = None,
    ) -> None:
        """Compute positions done..until in chunks. `logits`: "none", "last" (the last row of each
        chunk) or "all" (every row); `probe(start, count)` gives each chunk's ForwardProbe;
        `on_result(start, count, result)` sees each chunk's result."""
        size = chunk or self.chunk_size()
        while self.done < until:
            start = self.done
            count = min(size, until - start)
            prompt = self.seq.num_prompt_tokens
            if start < prompt < start + count:
                count = prompt - start  # the prompt's rows and the reply's take different kernels
            rows = {"none": 0, "last": 1, "all": count}[logits]
            counts = {self.seq.seq_id: rows} if rows else {}
            result = self.core.runner.forward(
                [self.seq], [count], counts, probe=probe(start, count) if probe is not None else None
            )
            self.core.kv.commit(self.seq, count, cache=self.keep)
            if on_result is not None:
                on_result(start, count, result)

    def last_row(
        self, probe: ForwardProbe | None = None, prefix_probe: ForwardProbe | None = None
    ) -> torch.Tensor:
        """Everything before the last token (with `prefix_probe`), then the last token alone as a
        decode row (with `probe`): its float32 logits [vocab], what the token after the context
        was drawn from."""
        n = len(self.seq.token_ids)
        self.run(n - 1, probe=(lambda _s, _c: prefix_probe) if prefix_probe is not None else None)
        out: list[torch.Tensor] = []
        self.run(n, "last", probe=lambda _s, _c: probe, on_result=lambda _s, _c, r: out.append(r.logits[0]))
        assert out, "a prefix-cache hit never covers a context's last token"
        return out[0]
