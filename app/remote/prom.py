"""A remote server's Prometheus `/metrics`, read into the few figures the app graphs.

Parsed with prometheus-client's own parser. Each known server names the same facts differently
(vLLM's `vllm:` names, kvscope's are the same under `kvscope:`, SGLang's `sglang:`, llama.cpp
server's `llamacpp:` when started with --metrics); the table below says where each figure is.
A figure a server does not export stays None and its graph says so, nothing is estimated. Label
sets (one series per model or engine) are summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from app.remote.target import FAMILIES

_VLLM_LIKE = {
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),  # 0..1 (the older name first)
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "prompt_tokens": ("prompt_tokens_total",),
    "generation_tokens": ("generation_tokens_total",),
    "ttft": ("time_to_first_token_seconds",),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e": ("e2e_request_latency_seconds",),
    "prefix_queries": ("prefix_cache_queries_total",),
    "prefix_hits": ("prefix_cache_hits_total",),
}
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": _VLLM_LIKE,
    "kvscope": _VLLM_LIKE,
    "sglang": {
        "kv_usage": ("token_usage",),
        "running": ("num_running_reqs",),
        "waiting": ("num_queue_reqs",),
        "prompt_tokens": ("prompt_tokens_total",),
        "generation_tokens": ("generation_tokens_total",),
        "ttft": ("time_to_first_token_seconds",),
        "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
        "e2e": ("e2e_request_latency_seconds",),
    },
    "llamacpp": {
        "kv_usage": ("kv_cache_usage_ratio",),
        "running": ("requests_processing",),
        "waiting": ("requests_deferred",),
        "prompt_tokens": ("prompt_tokens_total",),
        "generation_tokens": ("tokens_predicted_total",),
        # no histograms: the time it spent predicting, which over the tokens is its mean ITL
        "generation_seconds": ("tokens_predicted_seconds_total",),
    },
}


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One poll of /metrics: `t` is the app's perf_counter when it was read."""

    t: float
    family: str
    values: dict[str, float]  # figure -> value; histograms as "<name>_sum" and "<name>_count"

    def get(self, name: str) -> float | None:
        return self.values.get(name)


def family_of(text: str) -> str:
    """Which server wrote these metrics: the known prefix with the most series ("" if none)."""
    counts = dict.fromkeys(FAMILIES, 0)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            prefix = line.split(":", 1)[0]
            if prefix in counts:
                counts[prefix] += 1
    best = max(FAMILIES, key=lambda f: counts[f])
    return best if counts[best] else ""


def parse(text: str, t: float, family: str | None = None) -> MetricsSample:
    family = family_of(text) if family is None else family
    names = NAMES.get(family, {})
    sums: dict[str, float] = {}
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    values: dict[str, float] = {}
    for figure, candidates in names.items():
        for name in candidates:
            full = f"{family}:{name}"
            if f"{full}_count" in sums:  # a histogram
                values[f"{figure}_sum"] = sums.get(f"{full}_sum", 0.0)
                values[f"{figure}_count"] = sums[f"{full}_count"]
                break
            if full in sums:
                values[figure] = sums[full]
                break
    return MetricsSample(t, family, values)


@dataclass(frozen=True, slots=True)
class MetricsPoint:
    """What happened between two polls, the graphs' y values (None: the server does not say)."""

    t: float
    kv_usage: float | None  # 0..1
    tokens_per_s: float | None  # generated tokens per second, every request together
    ttft_s: float | None  # mean TTFT of the requests whose first token came in the interval
    itl_s: float | None  # mean inter-token latency in the interval
    running: float | None
    waiting: float | None
    prefix_hit_rate: float | None  # cumulative: hit tokens over queried tokens


def point_between(before: MetricsSample, after: MetricsSample) -> MetricsPoint:
    dt = after.t - before.t

    def rate(name: str) -> float | None:
        a, b = after.get(name), before.get(name)
        if a is None or b is None or dt <= 0 or a < b:  # a < b: the server restarted
            return None
        return (a - b) / dt

    def mean(name: str) -> float | None:
        sa, sb = after.get(f"{name}_sum"), before.get(f"{name}_sum")
        ca, cb = after.get(f"{name}_count"), before.get(f"{name}_count")
        if None in (sa, sb, ca, cb) or ca <= cb:
            return None
        return (sa - sb) / (ca - cb)

    itl = mean("itl")
    if itl is None and after.get("generation_seconds") is not None:
        tokens = (after.get("generation_tokens") or 0.0) - (before.get("generation_tokens") or 0.0)
        seconds = after.get("generation_seconds") - (before.get("generation_seconds") or 0.0)
        itl = seconds / tokens if tokens > 0 else None
    queries, hits = after.get("prefix_queries"), after.get("prefix_hits")
    return MetricsPoint(
        t=after.t,
        kv_usage=after.get("kv_usage"),
        tokens_per_s=rate("generation_tokens"),
        ttft_s=mean("ttft"),
        itl_s=itl,
        running=after.get("running"),
        waiting=after.get("waiting"),
        prefix_hit_rate=hits / queries if queries and hits is not None else None,
    )
