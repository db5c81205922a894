"""Connects the quantization views to the engine host: the quality panel's runs, the reference
overlay in the probability panel, and the loaded model's weights in the picker and memory graph.

Lives beside the window so the window only builds it and shuts it down.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal, Slot

from app.models.quant_picker import KV_LABELS, weights_figures
from app.quality.compute import QualityResult, compute_quality
from app.quality.jobs import QualityJob, QualityUnavailable, job_for
from app.workers import Cancelled, Channel, Worker, create_worker, describe_error
from widgets.reference import ReferenceDistribution

THREAD_NAME = "kvscope-quality"


class QualityController(QObject):
    finished = Signal(object)  # the QualityResult of a run, once shown

    def __init__(self, host, chat, panels, picker, parent: QObject | None = None):
        super().__init__(parent)
        self.host, self.chat, self.panels, self.picker = host, chat, panels, picker
        self.worker: Worker | None = None  # the latest run (a new one supersedes it)
        self.result: QualityResult | None = None
        self.result_generation: int | None = None  # the engine the result's request ids belong to
        panels.quality.run_requested.connect(self.run)
        host.model_loaded.connect(self._on_model_loaded)
        panels.probabilities.set_reference_source(self.reference_at)

    @Slot(str)
    def run(self, source: str) -> None:
        try:
            job = job_for(source, self.host, self.chat)
        except QualityUnavailable as exc:
            self.panels.quality.show_error(str(exc))
            return
        self.panels.quality.set_running("starting")
        if self.worker is not None:
            self.worker.discard()  # stops at its next step; its result is not shown
        self.worker = create_worker(
            lambda report: _compute(job, report),
            name=THREAD_NAME,
            progress=True,
            parent=self,
            on_progress=self.panels.quality.set_running,
            on_returned=self._on_finished,
            on_errored=self.panels.quality.show_error,
        )

    @property
    def running(self) -> bool:
        return self.worker is not None and self.worker.running

    def shutdown(self, timeout: float = 60.0) -> bool:
        """Cancel and join (window close, tests); True when no run is left."""
        workers = self.findChildren(Worker)
        for worker in workers:
            worker.cancel()
        return all(worker.wait(timeout) for worker in workers)

    def reference_at(self, request_id: int, index: int) -> ReferenceDistribution | None:
        """The full-precision reference at a reply token, when the last run covered that reply
        of the running engine."""
        result = self.result
        if result is None or result.job.reply is None or self.result_generation != self.host.generation:
            return None
        if result.job.reply.request_id != request_id:
            return None
        return result.reference.get(index)

    @Slot(object)
    def _on_finished(self, result: QualityResult | None) -> None:
        if result is None:
            return  # cancelled on the way
        self.result = result
        reply = result.job.reply
        self.result_generation = reply.generation if reply is not None else None
        self.panels.quality.show_result(result)
        self.panels.probabilities.set_reference_source(self.reference_at)  # redraw with the overlay
        self.finished.emit(result)

    @Slot(object)
    def _on_model_loaded(self, event) -> None:
        config = self.host.config
        if config is None:  # a remote engine (kvscope serve): its load settings are not known here
            return
        weights = weights_figures(config.model, event.info)
        self.panels.memory.set_weights_scheme(weights.scheme, weights.bytes_full, weights.load_dtype)
        self.picker.quantization.show_loaded(weights, event, config.kv_dtype)
        kv = "" if config.kv_dtype == "auto" else f", KV {KV_LABELS[config.kv_dtype]}"
        self.panels.quality.set_engine_label(f"{weights.scheme}{kv}")


def _compute(job: QualityJob, report: Channel) -> QualityResult | None:
    """The run on the worker: None when cancelled (it stops at its next step)."""
    try:
        return compute_quality(job, report, lambda: report.cancelled)
    except (QualityUnavailable, Cancelled):
        raise
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, never a traceback
        raise QualityUnavailable(f"The quality run failed: {describe_error(exc)}") from exc
