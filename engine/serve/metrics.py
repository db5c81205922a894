"""`GET /metrics`: Prometheus text through prometheus-client, under vLLM's metric names.

Each name is vLLM's (v1 engine) with `kvscope:` for `vllm:`, the same type, unit and meaning,
so a vLLM dashboard maps over with a rename. Everything is fed by the engine's own events, on the
engine thread, as they are emitted (prometheus-client's metrics are thread-safe); the server's
request arrival times (when the HTTP request came in) start the TTFT and end-to-end clocks, as
vLLM's API server does.

The request phases are vLLM's: queued (arrival at the engine -> first scheduled), prefill (first
scheduled -> first token), decode (first token -> last token), inference (first scheduled -> last
token), and the time per output token, decode / (tokens - 1). A step's tokens share its time, so
a speculative round adds one inter-token gap, not one per token. `request_success` counts by
vLLM's finish reasons: stop, length, abort (cancelled or the client gone), error (failed inside
the engine; a request refused before it, with a 4xx, is no request the engine ran). Prompt tokens
are counted once a request's prefill gave its first token (vLLM's moment), so a request cancelled
in the queue adds none. One difference: a request of n samples (or beams) is one request here,
its phases those of its steps, its generation tokens every sample's and its time per output token
over its longest sample's; vLLM v1 splits it into n child requests and observes each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for request_params_n
# finish reasons as vLLM names them (its FinishReason): the engine says "cancelled" for abort
VLLM_FINISH_REASON = {"stop": "stop", "length": "length", "cancelled": "abort"}


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's `build_1_2_5_buckets` for token counts)."""
    out, magnitude = list[float](), 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * magnitude
            if value > limit:
                return tuple(out)
            out.append(float(value))
        magnitude *= 10


@dataclass(slots=True)
class _Request:
    """What the metrics keep of a request between its arrival and its end."""

    arrival: float  # perf_counter of its HTTP arrival
    n: int
    max_tokens: int
    prompt_tokens: int = 0
    started: bool = False  # the engine took it (RequestStarted)
    prefilled: bool = False  # its first token came (its prompt tokens counted)


class ServeMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
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
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of the requests whose prefill gave their first token."
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated (every sample and beam).")
        self.success = counter(
            "request_success",
            "Requests the engine ran to their end, by vLLM's finish reason (stop, length, abort, error).",
            ("finished_reason",),
        )
        token_buckets = buckets_1_2_5(max(1, max_model_len))
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated by each finished request (all its samples).",
            token_buckets,
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Tokens of each finished request's longest sample (its only one when n = 1).",
            token_buckets,
        )
        self.request_params_n = histogram("request_params_n", "The n of each finished request.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each finished request.", token_buckets
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
        self.decode_time = histogram(
            "request_decode_time_seconds", "From a request's first token to its last.", E2E_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "From the first step that ran a request to its last token (prefill + decode).",
            E2E_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "A finished request's decode time over its tokens after the first.",
            TPOT_BUCKETS,
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
        self._requests: dict[int, _Request] = {}  # by request id, from the HTTP arrival to the end
        self._last_token_t: dict[tuple[int, int], float] = {}  # (request, branch) -> last token time
        self._in_flight: set[int] = set()
        self._prefix = (0, 0, 0)  # the latest cumulative (queries, hits, preemptions) seen

    def arrived(self, request_id: int, t: float, n: int = 1, max_tokens: int = 0) -> None:
        """A request came in over HTTP at `t` (perf_counter) asking for `n` samples of at most
        `max_tokens` tokens each."""
        with self._lock:
            self._requests[request_id] = _Request(t, n, max_tokens)

    def _request(self, request_id: int) -> _Request | None:
        with self._lock:
            return self._requests.get(request_id)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the event feed (engine thread) -----------------------------------------------------
    def observe(self, event: object) -> None:
        handler = self._HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _on_started(self, event: RequestStarted) -> None:
        self._in_flight.add(event.request_id)
        request = self._request(event.request_id)
        if request is not None:
            request.started, request.prompt_tokens = True, event.prompt_tokens

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
            request = self._request(request_id)
            if request is not None:
                self.ttft.observe(t - request.arrival)
                if not request.prefilled:
                    request.prefilled = True
                    self.prompt_tokens.inc(request.prompt_tokens)
        self._last_token_t[key] = t

    def _on_end(self, event: RequestFinished | RequestFailed) -> None:
        rid = event.request_id
        ran = rid in self._in_flight  # the engine took it (not refused at admission)
        self._in_flight.discard(rid)
        with self._lock:
            request = self._requests.pop(rid, None)
        for key in [k for k in self._last_token_t if k[0] == rid]:
            del self._last_token_t[key]
        if request is not None and ran:
            self.e2e.observe(event.t - request.arrival)
        if isinstance(event, RequestFinished):
            self.success.labels(
                self.model_name, VLLM_FINISH_REASON.get(event.finish_reason, event.finish_reason)
            ).inc()
            self._finished(event, request)
        elif ran:
            self.success.labels(self.model_name, "error").inc()
        if not self._in_flight:
            self.running.set(0)
            self.waiting.set(0)

    def _finished(self, event: RequestFinished, request: _Request | None) -> None:
        """The finished request's own histograms: its sizes, its parameters, its phases."""
        stats = event.stats
        longest = max((len(s.token_ids) for s in event.sequences), default=stats.generated_tokens)
        self.request_prompt_tokens.observe(stats.prompt_tokens)
        self.request_generation_tokens.observe(stats.generated_tokens)
        self.request_max_generation_tokens.observe(longest)
        if request is not None:
            self.request_params_n.observe(request.n)
            self.request_params_max_tokens.observe(request.max_tokens)
        if not stats.generated_tokens:
            return  # cancelled before its first token: it had no prefill, decode or inference
        decode = sum(stats.itl_s)  # its first step's time to its last step's
        self.queue_time.observe(stats.queued_s)
        self.prefill_time.observe(stats.prefill_s)
        self.decode_time.observe(decode)
        self.inference_time.observe(stats.prefill_s + decode)
        self.tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)

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
