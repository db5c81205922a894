"""What the remote client tells the host besides engine events (they never reach LiveState)."""

from __future__ import annotations

from dataclasses import dataclass

from app.remote.prom import MetricsPoint, MetricsSample
from app.remote.target import RemoteSource
from app.remote.vllm_kv import PrefixCacheState


@dataclass(frozen=True, slots=True)
class RemoteAttached:
    """The server answered: what it is. For a kvscope server, ModelLoaded follows on its stream."""

    source: RemoteSource


@dataclass(frozen=True, slots=True)
class RemoteMetrics:
    """One poll of the server's /metrics, and what changed since the previous poll (None first)."""

    sample: MetricsSample
    point: MetricsPoint | None


@dataclass(frozen=True, slots=True)
class RemoteMetricsUnavailable:
    """The server's /metrics could not be read (or holds no figure the app knows): why."""

    message: str


@dataclass(frozen=True, slots=True)
class RemotePrefixCache:
    """A vLLM server's prefix-cache blocks, from its ZMQ KV-cache events (app.remote.vllm_kv)."""

    state: PrefixCacheState
