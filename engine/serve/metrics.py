"""`GET /metrics`: Prometheus text through prometheus-client, under vLLM's metric names.

Each name is vLLM's with `kvscope:` for `vllm:`, the same type, unit and meaning, so a vLLM
dashboard maps over with a rename. Everything is fed by the engine's own events, on the engine
thread, as they are emitted (prometheus-client's metrics are thread-safe); the server's request
arrival times (when the HTTP request came in) start the TTFT and end-to-end clocks, as vLLM's
API server does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.events import (
    BeamStep,
    MemorySample,
    RequestFailed,
    RequestFinished,
    RequestStarted,
    SpecRound,
    StepStats,
    TokenGenerated,
)

PREFIX = "kvscope:"
# Bucket edges in seconds: a small model's decode step on a laptop CPU is tens of ms, a large
# model's prefill on a busy server many seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServeMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(PREFIX + name, doc, [*labels, *extra], registry=r)
            return metric if extra else metric.labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.model_name = model_name
        self.running = gauge(
            "num_requests_running", "Sequences in the engine's running batch (a request of n samples is n)."
        )
        self.waiting = gauge(
            "num_requests_waiting", "Sequences waiting to be scheduled (queued or preempted)."
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "KV-cache usage: the fraction of the pool's blocks in use."
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in prompt tokens served from cache."
        )
        self.preemptions = counter(
            "num_preemptions", "Preemptions (a sequence's blocks freed to recompute later)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests the engine started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (every sample and beam).")
        self.success = counter(
            "request_success", "Requests that finished, by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "From the HTTP request's arrival to its first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Between two tokens of one sequence.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "From the HTTP request's arrival to its end.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "From the engine's arrival to the first step that ran it.",
            TTFT_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "From the first step that ran it to its first token.",
            TTFT_BUCKETS,
        )
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative rounds (draft proposals verified).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the round.",
            ("position",),
        )
        self._lock = threading.Lock()
        self._arrival: dict[int, float] = {}  # request id -> perf_counter of its HTTP arrival
        self._last_token_t: dict[tuple[int, int], float] = {}  # (request, branch) -> last token time
        self._in_flight: set[int] = set()
        self._prefix = (0, 0, 0)  # the latest cumulative (queries, hits, preemptions) seen

    def arrived(self, request_id: int, t: float) -> None:
        with self._lock:
            self._arrival[request_id] = t

    def text(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the event feed (engine thread) -----------------------------------------------------
    def observe(self, event: object) -> None:
        handler = self._HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _on_started(self, event: RequestStarted) -> None:
        self._in_flight.add(event.request_id)
        self.prompt_tokens.inc(event.prompt_tokens)

    def _on_token(self, event: TokenGenerated) -> None:
        self.generation_tokens.inc()
        self._latency(event.request_id, event.branch, event.t)

    def _on_beam_step(self, event: BeamStep) -> None:
        # Beam search streams no tokens: each step gives every beam one, and the step's time is
        # the latency point (the first one's is the TTFT), as in the app's latency graph.
        self.generation_tokens.inc(len(event.token_ids))
        self._latency(event.request_id, 0, event.t)

    def _latency(self, request_id: int, branch: int, t: float) -> None:
        """One ITL point per step that gave the stream tokens (vLLM's meaning): the tokens of a
        speculative round share their step's time and add no point after the first."""
        key = (request_id, branch)
        last = self._last_token_t.get(key)
        if last is not None:
            if t == last:
                return  # the same step
            self.itl.observe(t - last)
        elif branch == 0:
            with self._lock:
                arrival = self._arrival.get(request_id)
            if arrival is not None:
                self.ttft.observe(t - arrival)
        self._last_token_t[key] = t

    def _on_end(self, event: RequestFinished | RequestFailed) -> None:
        rid = event.request_id
        self._in_flight.discard(rid)
        with self._lock:
            arrival = self._arrival.pop(rid, None)
        if arrival is not None:
            self.e2e.observe(event.t - arrival)
        for key in [k for k in self._last_token_t if k[0] == rid]:
            del self._last_token_t[key]
        if isinstance(event, RequestFinished):
            self.success.labels(self.model_name, event.finish_reason).inc()
            if event.stats.generated_tokens:
                self.queue_time.observe(event.stats.queued_s)
                self.prefill_time.observe(event.stats.prefill_s)
        if not self._in_flight:
            self.running.set(0)
            self.waiting.set(0)

    def _on_step(self, event: StepStats) -> None:
        self.running.set(event.running)
        self.waiting.set(event.waiting)
        kv = event.kv
        self.kv_usage.set(kv.used_blocks / kv.num_blocks if kv.num_blocks else 0.0)
        queries, hits, preemptions = self._prefix
        self.prefix_queries.inc(max(0, event.prefix_query_tokens - queries))
        self.prefix_hits.inc(max(0, event.prefix_hit_tokens - hits))
        self.preemptions.inc(max(0, event.preemptions - preemptions))
        self._prefix = (event.prefix_query_tokens, event.prefix_hit_tokens, event.preemptions)

    def _on_memory(self, event: MemorySample) -> None:
        # The engine samples memory 4 times a second, busy or idle: the gauge follows blocks
        # freed by a cancel or a finish even when no step runs after it.
        if event.kv_pool_bytes:
            self.kv_usage.set(event.kv_used_bytes / event.kv_pool_bytes)

    def _on_spec_round(self, event: SpecRound) -> None:
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(len(event.draft_ids))
        self.spec_accepted.inc(event.accepted)
        for position in range(event.accepted):
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc()

    # event class -> its handler (each takes its own class of event)
    _HANDLERS: ClassVar[dict[type, Callable[[ServeMetrics, Any], None]]] = {
        RequestStarted: _on_started,
        TokenGenerated: _on_token,
        BeamStep: _on_beam_step,
        RequestFinished: _on_end,
        RequestFailed: _on_end,
        StepStats: _on_step,
        MemorySample: _on_memory,
        SpecRound: _on_spec_round,
    }
