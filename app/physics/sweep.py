"""Runs the sweep view's measurement (`engine.api.compare_dtypes`) on a worker with
progress and cancel, and judges how far its figures can be trusted on this machine now."""

from __future__ import annotations

from PySide6.QtCore import QObject, Slot

from app.workers import Worker, create_worker
from engine.api import compare_dtypes
from widgets.sweep_panel import SweepPanel, SweepSettings

THREAD_NAME = "kvscope-sweep"
# The sweep keeps every core busy (load ~1 per core); beyond this, something else was running.
BUSY_LOAD_PER_CORE = 1.5


def busy_machine_note(device: str, load: float | None = None, cores: int | None = None) -> str:
    """A warning when other work shared the CPU during a CPU sweep, from the 1-minute load
    average: the sweep's own threads account for about one per core, so a load beyond
    BUSY_LOAD_PER_CORE per core means other processes ran too, and the figures understate the CPU."""
    if device.startswith("cuda"):
        return ""
    if load is None or cores is None:
        import psutil

        load, cores = psutil.getloadavg()[0], psutil.cpu_count(logical=True) or 1
    if load <= BUSY_LOAD_PER_CORE * cores:
        return ""
    return (
        f"The machine was busy (load average {load:.1f} on {cores} cores): other processes shared the "
        "CPU, so these times are slower and noisier than the CPU is. Run again when it is idle."
    )


def sweep_device(device: str) -> str:
    """The ModelSpec device that loads on the device a model runs on ("cuda:0" -> "cuda")."""
    return "cuda" if device.startswith("cuda") else "cpu"


class SweepController(QObject):
    def __init__(self, panel: SweepPanel, parent: QObject | None = None) -> None:
        super().__init__(parent)
        panel.run_requested.connect(self.run)
        panel.cancel_requested.connect(self.cancel)
        self.panel = panel
        self.worker: Worker | None = None  # the latest sweep

    @Slot(object)
    def run(self, settings: SweepSettings) -> None:
        source, device = self.panel.source, self.panel.device
        if source is None or (self.worker is not None and self.worker.running):
            return

        def sweep(progress) -> dict:
            return compare_dtypes(
                source,
                list(settings.dtypes),
                list(settings.prompt_lengths),
                list(settings.context_lengths),
                device=device,
                decode_tokens=settings.decode_tokens,
                repeats=settings.repeats,
                progress=progress,
            )

        self.worker = create_worker(
            sweep,
            name=THREAD_NAME,
            progress=True,
            parent=self,
            on_progress=self.panel.show_progress,
            on_returned=lambda report: self.panel.show_report(report, busy_machine_note(report["device"])),
            on_errored=self.panel.show_failed,
            on_cancelled=self.panel.show_cancelled,
        )

    @Slot()
    def cancel(self) -> None:
        if self.worker is not None:
            self.worker.cancel()

    def shutdown(self, timeout: float) -> bool:
        """Window closing: cancel and wait for the sweep to reach its next stopping point."""
        self.cancel()
        return self.worker is None or self.worker.wait(timeout)
