"""One load run: N requests submitted to the running engine at once, followed to their end.

The requests are built from a `LoadSpec` (a system prompt shared by all or distinct per request,
a user prompt of a chosen length, a fixed number of new tokens), so the user can watch the KV pool
fill, share a cached prefix, and preempt. Progress and figures come from the host's events only:
prompt tokens from RequestStarted, tokens as they stream, TTFT/ITL/cached tokens from the
engine's RequestStats, and the run's total throughput from engine event times.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal

from app.engine_host import EngineHost
from engine.config import SamplingParams
from engine.events import RequestFailed, RequestFinished, RequestStarted, TokenGenerated
from engine.request import Request
from engine.units import tokens_per_s
from widgets.throughput_view import ThroughputPoint

# Sentences the prompts are cut from: ordinary prose, so the tokenizer sees realistic text.
SYSTEM_SENTENCE = (
    "You are a patient assistant: answer clearly, name the principle you rely on, keep a friendly "
    "tone, avoid jargon unless asked, and say so when you are unsure."
)
USER_SENTENCE = (
    "Explain step by step how a river carves a valley over many thousands of years and why it bends."
)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    requests: int
    shared_system: bool
    system_words: int
    prompt_words: int
    new_tokens: int


def _words(sentence: str, count: int) -> str:
    words = sentence.split()
    return " ".join(words[i % len(words)] for i in range(count))


def build_requests(spec: LoadSpec) -> list[Request]:
    """The run's requests. A distinct system prompt starts with the request's number, so no two
    share even their first block; a shared one is the same text for all (one cached prefix)."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=spec.new_tokens, ignore_eos=True)
    out = []
    for i in range(spec.requests):
        system = _words(SYSTEM_SENTENCE, spec.system_words) if spec.system_words else None
        if system and not spec.shared_system:
            system = f"Assistant number {i + 1}. {system}"
        user = f"({i + 1}) {_words(USER_SENTENCE, spec.prompt_words)}"
        out.append(Request.chat(user, system=system, sampling=sampling))
    return out


@dataclass(slots=True)
class LoadRequest:
    """One request of the run, as far as its events have told."""

    request_id: int
    target_tokens: int
    prompt_tokens: int = 0
    started_t: float | None = None
    generated: int = 0
    status: str = "waiting"  # waiting | running | stop | length | cancelled | failed
    finished: RequestFinished | None = None
    error: str = ""

    @property
    def done(self) -> bool:
        return self.status not in ("waiting", "running")

    @property
    def median_itl_s(self) -> float | None:
        itl = self.finished.stats.itl_s if self.finished else ()
        return statistics.median(itl) if itl else None


@dataclass(slots=True)
class LoadRun:
    spec: LoadSpec
    generation: int
    requests: dict[int, LoadRequest] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(r.done for r in self.requests.values())

    def throughput(self) -> ThroughputPoint | None:
        """Total tokens/s from the first start to the last finish (engine clock) and the median of
        every request's ITLs; None when the run did not finish whole (cancelled or failed)."""
        rows = list(self.requests.values())
        if not rows or any(r.finished is None or r.status == "cancelled" for r in rows):
            return None
        start = min(r.started_t for r in rows if r.started_t is not None)
        end = max(r.finished.t for r in rows)
        itl = [x for r in rows for x in r.finished.stats.itl_s]
        if end <= start or not itl:
            return None
        generated = sum(r.finished.stats.generated_tokens for r in rows)
        return ThroughputPoint(len(rows), tokens_per_s(generated, end - start), statistics.median(itl))


class LoadRunner(QObject):
    """Submits runs through the host and folds its signals into the current run."""

    changed = Signal()  # a request of the current run progressed
    run_finished = Signal(object)  # LoadRun (every request ended: finished, cancelled or failed)

    def __init__(self, host: EngineHost, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host = host
        self.run: LoadRun | None = None
        host.request_started.connect(self._on_started)
        host.tokens_generated.connect(self._on_tokens)
        host.request_finished.connect(self._on_finished)
        host.request_failed.connect(self._on_failed)
        host.model_loading.connect(self._on_engine_replaced)

    @property
    def running(self) -> bool:
        return self.run is not None and not self.run.done

    def start(self, spec: LoadSpec) -> LoadRun:
        """Submit every request of `spec` at once. Raises RuntimeError when no model is loaded."""
        if self.running:
            raise RuntimeError("a load run is still going: cancel it first")
        run = LoadRun(spec, self.host.generation)
        for request in build_requests(spec):
            request_id = self.host.submit(request)
            run.requests[request_id] = LoadRequest(request_id, spec.new_tokens)
        self.run = run
        self.changed.emit()
        return run

    def cancel(self) -> None:
        if self.run is None:
            return
        for row in self.run.requests.values():
            if not row.done:
                self.host.cancel(row.request_id)

    def _row(self, request_id: int) -> LoadRequest | None:
        run = self.run
        if run is None or run.generation != self.host.generation:
            return None
        return run.requests.get(request_id)

    def _on_started(self, event: RequestStarted) -> None:
        if row := self._row(event.request_id):
            row.prompt_tokens, row.started_t, row.status = event.prompt_tokens, event.t, "running"
            self.changed.emit()

    def _on_tokens(self, request_id: int, events: list[TokenGenerated]) -> None:
        if row := self._row(request_id):
            row.generated += len(events)
            self.changed.emit()

    def _on_finished(self, event: RequestFinished) -> None:
        if row := self._row(event.request_id):
            row.finished, row.status = event, event.finish_reason
            row.generated = event.stats.generated_tokens
            self._after_end()

    def _on_failed(self, event: RequestFailed) -> None:
        if row := self._row(event.request_id):
            row.status, row.error = "failed", event.message
            self._after_end()

    def _on_engine_replaced(self, _event) -> None:
        # Another model is loading: the old engine's requests ended with it (ids restart at 1).
        run = self.run
        if run is not None and not run.done:
            for row in run.requests.values():
                if not row.done:
                    row.status, row.error = "failed", "the engine was replaced by another model"
            self._after_end()

    def _after_end(self) -> None:
        self.changed.emit()
        if self.run is not None and self.run.done:
            self.run_finished.emit(self.run)
