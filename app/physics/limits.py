"""The roofline's device limits: measured (or read from their cache) on the engine thread, so no
reply runs on the device while its matmul peak and bandwidth are timed, and handed to the panel.

Limits belong to a device and a dtype: a model loaded on another device or in another dtype drops
the ones shown, and picks up cached ones for its own when they were measured before.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Slot

from app.engine_host import EngineHost
from app.workers import EngineCall
from engine.api import DeviceLimits, device_limits_cached
from engine.events import ModelInfo, ModelLoaded
from engine.units import si
from widgets.roofline_panel import Roof, RooflinePanel


def limits_device(info: ModelInfo) -> str:
    """The device limits are keyed by: the model's, as the engine names it ("cpu", "cuda:0")."""
    return info.device


def roof_of(limits: DeviceLimits) -> Roof:
    """The limits as the panel draws them, with what and how they were measured in words."""
    how = (
        f"Measured {limits.measured_at} in {limits.measure_seconds:.1f} s with {limits.threads} threads:\n"
        f"matmul peak {si(limits.peak_flops, 'FLOP/s')}: the fastest {limits.dtype} matmul "
        f"({limits.matmul_size} x {limits.matmul_size}, x @ W.T like every linear layer)\n"
        f"bandwidth {si(limits.bandwidth, 'B/s')}: a large copy on {limits.device} (bytes read + written)"
    )
    return Roof(limits.peak_flops, limits.bandwidth, f"{limits.device_name} {limits.dtype}", how)


def limits_match(limits: DeviceLimits | None, info: ModelInfo) -> bool:
    return limits is not None and limits.device == limits_device(info) and limits.dtype == info.dtype


class LimitsController(QObject):
    def __init__(self, host: EngineHost, panel: RooflinePanel, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host, self.panel = host, panel
        self.limits: DeviceLimits | None = None
        self.call: EngineCall | None = None
        panel.measure_requested.connect(self.measure)
        host.model_loaded.connect(self._on_model_loaded)

    @property
    def measuring(self) -> bool:
        return self.call is not None and self.call.running

    @Slot()
    def measure(self) -> None:
        """Measure (again) the loaded model's device in its dtype."""
        if self.host.live.loaded is not None and not self.measuring:
            self._start(refresh=True)

    @Slot(object)
    def _on_model_loaded(self, event: ModelLoaded) -> None:
        info = event.info
        if limits_match(self.limits, info):
            return
        self.limits = None
        self.panel.set_limits(None)
        if getattr(self.host, "attached", False):
            return  # a remote engine's device: this machine's cached limits are not its
        cached = device_limits_cached(limits_device(info), info.dtype)
        if cached and not self.measuring:
            self._start(refresh=False)  # a read of the cache (re-measured if stale)

    def _start(self, refresh: bool) -> None:
        self.panel.set_measuring(True)
        self.call = self.host.ask(lambda engine: engine.device_limits(refresh), name="device limits")
        self.call.returned.connect(self._on_limits)
        self.call.errored.connect(self.panel.set_limits_error)
        self.call.cancelled.connect(lambda: self.panel.set_measuring(False))

    @Slot(object)
    def _on_limits(self, limits: DeviceLimits) -> None:
        self.panel.set_measuring(False)
        loaded = self.host.live.loaded
        # A model of another device or dtype may have loaded while measuring: keep only limits
        # that belong to the model on screen.
        if loaded is not None and limits_match(limits, loaded.info):
            self.limits = limits
            self.panel.set_limits(roof_of(limits))

    def shutdown(self, timeout: float) -> bool:
        return self.call is None or self.call.wait(timeout)
