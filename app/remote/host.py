"""The engine host that can also attach to a remote server.

`AttachableHost` is `EngineHost` (same signals, same render tick, same LiveState fold) with one
more way to get an engine: `attach(target)` puts a `RemoteEngine` where the in-process Engine
would be. Its events go through the same EventStore and the same `_dispatch`, so the chat, the
tabs and the panels see a remote reply exactly as a local one; `start(config)` goes back to a
local engine. What is not an engine event (which server it is, its polled /metrics) arrives in a
second inbox and is folded here into `remote` and `metrics`, with signals of its own.
"""

from __future__ import annotations

from collections import deque

from PySide6.QtCore import QObject, Signal

from app.engine_host import RESTART_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, EngineHost
from app.remote.engine import RemoteEngine
from app.remote.prom import MetricsPoint, MetricsSample
from app.remote.records import RemoteAttached, RemoteMetrics, RemoteMetricsUnavailable, RemotePrefixCache
from app.remote.target import RemoteSource, RemoteTarget
from app.remote.vllm_kv import PrefixCacheState
from engine.config import EngineConfig
from live.event_store import EventStore
from live.page_map import PageMap
from live.state import LiveState

# Polled metrics kept for the graphs: an hour at one poll a second.
METRICS_HISTORY = 3600


class AttachableHost(EngineHost):
    source_changed = Signal(object)  # RemoteSource when attached (and answered), None when local
    metrics_changed = Signal()  # a /metrics poll arrived (or could not be read)

    def __init__(self, live: LiveState | None = None, parent: QObject | None = None):
        super().__init__(live, parent)
        self.remote: RemoteSource | None = None
        self.target: RemoteTarget | None = None  # what is being attached to (before it answers too)
        self.metrics: deque[MetricsPoint] = deque(maxlen=METRICS_HISTORY)
        self.metrics_sample: MetricsSample | None = None  # the latest poll: which figures exist
        self.metrics_family = ""
        self.metrics_error: str | None = None
        self.prefix_cache: PrefixCacheState | None = None  # a vLLM server's, from its ZMQ events
        self._records: EventStore | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def attach(self, target: RemoteTarget, use_events: bool = True) -> None:
        """Stop any engine and attach to `target`; ready once the server has answered."""
        self.stop(RESTART_TIMEOUT_S)
        self.config = None
        self.target = target
        self.generation += 1
        self.store, self._records = EventStore(), EventStore()
        self.metrics.clear()
        self.metrics_sample, self.metrics_family, self.metrics_error = None, "", None
        self.prefix_cache = None
        self._run(RemoteEngine(target, self.store.push, self._records.push, use_events=use_events))

    def start(self, config: EngineConfig, loaded=None) -> None:
        self.target = None
        super().start(config, loaded)
        self._set_remote(None)

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> bool:
        stopped = super().stop(timeout)
        self._records = None
        self._set_remote(None)
        return stopped

    @property
    def attached(self) -> bool:
        return isinstance(self.engine, RemoteEngine)

    # ---- the render tick -------------------------------------------------------------------
    def render_tick(self) -> None:
        records = self._records.drain() if self._records is not None else []
        super().render_tick()
        for record in records:  # after the events pushed before them (the connecting progress)
            self._fold(record)

    def _fold(self, record) -> None:
        kind = type(record)
        if kind is RemoteAttached:
            source = record.source
            self.model_name = source.display_name
            if not source.events:
                # No ModelLoaded will come: the server is ready once it has answered, and what
                # the live state knew of a previous engine's model and pool is not this one's.
                self._loading, self._ready = False, True
                live = self.live
                live.loading, live.loaded, live.kv_stats = None, None, None
                live.page_map = PageMap()
                self.frame.emit({"model", "kv"})
                self.status_changed.emit()
            self._set_remote(source)
        elif kind is RemoteMetrics:
            self.metrics_sample, self.metrics_error = record.sample, None
            self.metrics_family = record.sample.family
            if record.point is not None:
                self.metrics.append(record.point)
            self.metrics_changed.emit()
        elif kind is RemoteMetricsUnavailable:
            self.metrics_error = record.message
            self.metrics_changed.emit()
        elif kind is RemotePrefixCache:
            self.prefix_cache = record.state
            self.metrics_changed.emit()

    def _set_remote(self, source: RemoteSource | None) -> None:
        if source is self.remote:
            return
        self.remote = source
        self.source_changed.emit(source)
