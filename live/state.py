"""The GUI thread's fold of the engine's events into plain state the panels read.

`EventStore.push` is the engine's sink: it appends under a lock and returns, so the engine never
waits on the GUI. The render timer calls `drain()` on the GUI thread and hands the batch to
`LiveState.apply`, which folds it into plain state the panels read:

- block events are folded one by one into an exact page map (never dropped: a missed "free"
  would leave a block lit forever);
- tokens, memory samples and latencies go into preallocated numpy ring buffers, so a panel
  draws a whole series with one `setData` per frame however many events arrived;
- everything else keeps only what a view needs (latest model, recent steps, last errors).

Coalescing happens here: however many events a frame brings, each panel redraws once, and only
when one of its dirty keys changed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.events import (
    BeamStep,
    BlockEvent,
    DraftLength,
    EngineError,
    Event,
    KVStats,
    MemorySample,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    RequestFailed,
    RequestFinished,
    RequestStarted,
    SequenceFinished,
    SequenceForked,
    SpecRound,
    StepStats,
    TokenGenerated,
)
from engine.inside import is_replay_seq
from live.groups import GroupView
from live.latency import LatencySeries
from live.page_map import PageMap
from live.ring_buffer import RingBuffer
from live.roofline import RooflinePoints

DIRTY_KEYS = frozenset(
    {
        "model",
        "requests",
        "tokens",
        "kv",
        "memory",
        "latency",
        "steps",
        "roofline",
        "errors",
        "speculation",
        "groups",
    }
)

# Ring capacities: 4 h of memory samples at the engine's 4 Hz; 100k tokens of latency history.
MEMORY_CAPACITY = 4 * 3600 * 4
LATENCY_CAPACITY = 100_000
RECENT_STEPS = 600  # about 10 s of decode steps; enough for a step-timing readout
MAX_ERRORS = 100
# Finished requests kept with their per-token snapshots (a chat session rarely exceeds this;
# the oldest finished ones go first so memory stays bounded in long sessions).
MAX_REQUESTS = 256


@dataclass(slots=True)
class RequestView:
    """What the GUI knows about one request, in arrival order of its events."""

    request_id: int
    prompt_tokens: int = 0
    started_t: float = math.nan
    tokens: list[TokenGenerated] = field(default_factory=list)
    status: str = "running"  # running | stop | length | cancelled | failed
    finished: RequestFinished | None = None
    error: str | None = None
    first_token_row: int | None = None  # latency ring row of its first token (TTFT point)

    @property
    def done(self) -> bool:
        return self.status != "running"


class LiveState:
    """The GUI thread's view of the engine, rebuilt incrementally from drained events."""

    def __init__(
        self, memory_capacity: int = MEMORY_CAPACITY, latency_capacity: int = LATENCY_CAPACITY
    ) -> None:
        self.origin_t: float | None = None  # engine time of the first event: graphs' zero
        self.loading: ModelLoading | None = None
        self.loaded: ModelLoaded | None = None
        self.load_error: str | None = None
        self.requests: dict[int, RequestView] = {}
        self.latest_request_id: int | None = None
        self.page_map = PageMap()
        self.kv_stats: KVStats | None = None
        self.steps: deque[StepStats] = deque(maxlen=RECENT_STEPS)
        # Every step placed by the FLOPs and bytes the engine counted for it (StepStats.cost).
        self.roofline = RooflinePoints()
        self.memory = RingBuffer(
            memory_capacity,
            (
                "t",
                "weights",
                "kv_pool",
                "kv_used",
                "process",
                "reserved",
                "device_total",
                "draft_weights",
                "draft_cache",
            ),
        )
        self.memory_source: str = ""
        self.latency_series = LatencySeries(latency_capacity)
        self.latency = self.latency_series.ring  # one row per generated token (see live.latency)
        self.errors: deque[str] = deque(maxlen=MAX_ERRORS)
        # Speculative rounds by (request id, round number): what a selected token's round was.
        self.spec_rounds: dict[tuple[int, int], SpecRound] = {}
        # Each request's current draft length (adaptive speculation; 0: decoding plainly).
        self.draft_lengths: dict[int, int] = {}
        # n-sample and beam-search requests by request id, and the request of every forked
        # sequence (a plain request's only sequence has its request's id).
        self.groups: dict[int, GroupView] = {}
        self.seq_request: dict[int, int] = {}
        # Each handler takes its own event type; the dict is keyed by that type.
        self._handlers: dict[type[Any], Callable[[Any], set[str]]] = {
            ModelLoading: self._on_loading,
            ModelLoaded: self._on_loaded,
            ModelLoadFailed: self._on_load_failed,
            RequestStarted: self._on_started,
            TokenGenerated: self._on_token,
            RequestFinished: self._on_finished,
            RequestFailed: self._on_failed,
            BlockEvent: self._on_block,
            SequenceForked: self._on_forked,
            SequenceFinished: self._on_sequence_finished,
            BeamStep: self._on_beam_step,
            SpecRound: self._on_spec_round,
            DraftLength: self._on_draft_length,
            StepStats: self._on_step,
            MemorySample: self._on_memory,
            EngineError: self._on_engine_error,
        }

    def apply(self, events: Iterable[Event]) -> set[str]:
        """Fold events in order; returns the dirty keys (a subset of DIRTY_KEYS)."""
        dirty: set[str] = set()
        for event in events:
            handler = self._handlers.get(type(event))
            if handler is None:
                continue  # an event type newer than this GUI: nothing here knows how to show it
            if self.origin_t is None and event.t:
                self.origin_t = event.t
            dirty |= handler(event)
        return dirty

    # ---- queries for views -----------------------------------------------------------------
    def token(self, request_id: int | None = None, index: int | None = None) -> TokenGenerated | None:
        """A token by request and index; with None, None the latest token of the latest request."""
        if request_id is None:
            request_id = self.latest_request_id
        view = self.requests.get(request_id) if request_id is not None else None
        if view is None or not view.tokens:
            return None
        if index is None:
            return view.tokens[-1]
        return view.tokens[index] if 0 <= index < len(view.tokens) else None

    def request_of_seq(self, seq_id: int) -> int:
        """The request a KV sequence belongs to (a fork's request; else the sequence itself)."""
        return self.seq_request.get(seq_id, seq_id)

    def seq_label(self, seq_id: int) -> str:
        """How the page map names a sequence: "#3", or "#3 sample 2" / "#3 beam 1" in a group,
        or a token inspection's replay of a context (engine/core/replay.py)."""
        if is_replay_seq(seq_id):
            return "an inspection of a token (its context replayed)"
        request_id = self.request_of_seq(seq_id)
        group = self.groups.get(request_id)
        if group is None or not group.is_group:
            return f"#{request_id}"
        noun = "beam" if group.kind == "beams" else "sample"
        return f"#{request_id} {noun} {group.branch_of.get(seq_id, 0) + 1}"

    def spec_round(self, request_id: int, index: int) -> SpecRound | None:
        """The speculative round that produced a token of a reply (None when it had none)."""
        token = self.token(request_id, index)
        if token is None or token.spec_round < 0:
            return None
        return self.spec_rounds.get((request_id, token.spec_round))

    # ---- handlers --------------------------------------------------------------------------
    def _on_loading(self, event: ModelLoading) -> set[str]:
        self.loading = event
        return {"model"}

    def _on_loaded(self, event: ModelLoaded) -> set[str]:
        self.loaded, self.loading, self.load_error = event, None, None
        per_block = event.kv_pool_bytes // event.kv_num_blocks if event.kv_num_blocks else 0
        self.page_map = PageMap(event.kv_num_blocks, event.kv_block_size, per_block)
        self.kv_stats = None
        self.roofline.clear()  # another model (or its restart): its steps start afresh
        return {"model", "kv", "roofline"}

    def _on_load_failed(self, event: ModelLoadFailed) -> set[str]:
        self.loading, self.load_error = None, event.message
        self.errors.append(f"model failed to load: {event.message}")
        return {"model", "errors"}

    def _request(self, request_id: int) -> RequestView:
        view = self.requests.get(request_id)
        if view is None:
            view = self.requests[request_id] = RequestView(request_id)
            self._forget_old_requests()
        return view

    def _forget_old_requests(self) -> None:
        excess = len(self.requests) - MAX_REQUESTS
        if excess <= 0:
            return
        for request_id in [rid for rid, view in self.requests.items() if view.done][:excess]:
            del self.requests[request_id]
            self._forget_rounds(request_id)
            self._forget_group(request_id)

    def _forget_group(self, request_id: int) -> None:
        group = self.groups.pop(request_id, None)
        self.latency_series.forget(request_id)
        if group is not None:
            for seq_id in group.branch_of:
                if self.seq_request.get(seq_id) == request_id:
                    del self.seq_request[seq_id]

    def _group(self, request_id: int) -> GroupView:
        group = self.groups.get(request_id)
        if group is None:
            group = self.groups[request_id] = GroupView(request_id)
        return group

    def _forget_rounds(self, request_id: int) -> None:
        for key in [k for k in self.spec_rounds if k[0] == request_id]:
            del self.spec_rounds[key]
        self.draft_lengths.pop(request_id, None)

    def _on_started(self, event: RequestStarted) -> set[str]:
        # A restarted engine numbers its requests from 1 again: a start always opens a new view.
        self.requests.pop(event.request_id, None)
        self._forget_rounds(event.request_id)
        self._forget_group(event.request_id)
        view = self._request(event.request_id)
        view.prompt_tokens, view.started_t = event.prompt_tokens, event.t
        self.latency_series.started(event.request_id, event.t)
        self.latest_request_id = event.request_id
        return {"requests"}

    def _on_token(self, event: TokenGenerated) -> set[str]:
        view = self._request(event.request_id)
        dirty = {"tokens", "latency", "requests"}
        group = self.groups.get(event.request_id)
        if event.branch > 0 or group is not None:
            # One of n samples: each streams its own reply; `view.tokens` keeps sample 0's, so
            # a token's (request, index) still names one token for the probability panel.
            self._group(event.request_id).on_token(event)
            dirty.add("groups")
        if event.branch == 0:
            view.tokens.append(event)
        self.latest_request_id = event.request_id
        row, is_first = self.latency_series.point(event.request_id, event.branch, event.t, view.started_t)
        if is_first and event.branch == 0:
            view.first_token_row = row
        return dirty

    def _on_finished(self, event: RequestFinished) -> set[str]:
        self.latency_series.ended(event.request_id)
        view = self._request(event.request_id)
        view.status, view.finished = event.finish_reason, event
        dirty = {"requests"}
        if event.group is not None or event.request_id in self.groups:
            self._group(event.request_id).on_finished(event)
            dirty.add("groups")
        # The engine's own TTFT counts from arrival; the live point counted from RequestStarted.
        if self.latency_series.set_ttft(view.first_token_row, event.stats.ttft_s):
            dirty.add("latency")
        return dirty

    def _on_failed(self, event: RequestFailed) -> set[str]:
        self.latency_series.ended(event.request_id)
        view = self._request(event.request_id)
        view.status, view.error = "failed", event.message
        self.errors.append(f"request {event.request_id} failed: {event.message}")
        return {"requests", "errors"}

    def _on_spec_round(self, event: SpecRound) -> set[str]:
        self.spec_rounds[(event.request_id, event.round)] = event
        return {"speculation"}

    def _on_draft_length(self, event: DraftLength) -> set[str]:
        self.draft_lengths[event.request_id] = event.draft_length
        return {"speculation"}

    def _on_forked(self, event: SequenceForked) -> set[str]:
        self.seq_request[event.seq_id] = event.request_id
        self._group(event.request_id).on_fork(event.parent_seq_id, event.seq_id, event.branch)
        return {"groups"}

    def _on_sequence_finished(self, event: SequenceFinished) -> set[str]:
        self._group(event.request_id).on_sequence_finished(event.seq_id, event.finish_reason)
        return {"groups"}

    def _on_beam_step(self, event: BeamStep) -> set[str]:
        for seq_id in event.seq_ids:  # each announced by a SequenceForked already; cheap to be sure
            if seq_id != event.request_id:
                self.seq_request[seq_id] = event.request_id
        self._group(event.request_id).on_beam_step(event)
        self.latest_request_id = event.request_id
        # Beam search streams no tokens (its beams change every step), so each step is one point
        # of the latency graph: the time since the previous step, the first one's TTFT. Every
        # beam gains one token per step, so the rolling rate reads as tokens/s per beam.
        view = self._request(event.request_id)
        row, is_first = self.latency_series.point(event.request_id, 0, event.t, view.started_t)
        if is_first:
            view.first_token_row = row
        return {"groups", "requests", "latency"}

    def _on_block(self, event: BlockEvent) -> set[str]:
        if event.op == "cow" and event.seq_id is not None:
            group = self.groups.get(self.request_of_seq(event.seq_id))
            if group is not None:
                group.cow_copies += len(event.block_ids)
        problems = self.page_map.apply(event)
        if problems:
            self.errors.extend(f"page map: {p} ({event.op} by sequence {event.seq_id})" for p in problems)
            return {"kv", "errors"}
        return {"kv"}

    def _on_step(self, event: StepStats) -> set[str]:
        self.steps.append(event)
        self.kv_stats = event.kv
        if self.roofline.add(event):
            return {"steps", "kv", "roofline"}
        return {"steps", "kv"}

    def _on_memory(self, event: MemorySample) -> set[str]:
        self.memory.append(
            t=event.t,
            weights=event.weights_bytes,
            kv_pool=event.kv_pool_bytes,
            kv_used=event.kv_used_bytes,
            process=event.process_bytes,
            reserved=event.process_reserved_bytes,
            device_total=event.device_total_bytes,
            draft_weights=event.draft_weights_bytes,
            draft_cache=event.draft_cache_bytes,
        )
        self.memory_source = event.source
        return {"memory"}

    def _on_engine_error(self, event: EngineError) -> set[str]:
        self.errors.append(event.message)
        return {"errors"}
