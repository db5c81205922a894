"""The physics-of-inference views and what they need from the app: the roofline panel (a live
panel, refreshed with the others), the KV memory calculator and the sweep view, each told about
the model the engine loads, their controllers' work stopped when the window closes, and a menu
to reach them."""

from __future__ import annotations

from PySide6.QtCore import QObject, Slot
from PySide6.QtWidgets import QDockWidget, QMenu

from app.engine_host import EngineHost
from app.physics.calculator import CalculatorController
from app.physics.limits import LimitsController
from app.physics.sweep import SweepController, sweep_device
from engine.events import ModelLoaded
from widgets.kv_calculator import KVCalculator
from widgets.roofline_panel import RooflinePanel
from widgets.sweep_panel import SweepPanel

# Closing the window waits this long for a measurement in flight: device limits cannot be
# interrupted (about ten seconds), a sweep stops at its next run.
SHUTDOWN_TIMEOUT_S = 30.0
# (dock key, menu text) of the views, in menu order.
DOCKS = (("roofline", "&Roofline"), ("kv_calculator", "&KV memory calculator"), ("sweep", "Latency &sweeps"))


class PhysicsViews(QObject):
    def __init__(self, host: EngineHost, roofline: RooflinePanel, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.host = host
        self.roofline = roofline
        self.kv_calculator = KVCalculator(host.live)
        self.sweep = SweepPanel()
        self.sweep.set_model(None)
        self.limits = LimitsController(host, roofline, self)
        self.calculator = CalculatorController(host, self.kv_calculator, self)
        self.sweeps = SweepController(self.sweep, self)
        host.model_loaded.connect(self._on_model_loaded)

    @Slot(object)
    def _on_model_loaded(self, event: ModelLoaded) -> None:
        info = event.info
        # The sweep loads the same source again, once per dtype it compares.
        self.sweep.set_model(info.source, sweep_device(info.device), info.name)

    def fill_menu(self, menu: QMenu, docks: dict[str, QDockWidget]) -> None:
        """One entry per view that shows and raises its dock, and the limits measurement."""
        for key, text in DOCKS:
            action = menu.addAction(text)
            action.triggered.connect(docks[key].show)
            action.triggered.connect(docks[key].raise_)
        menu.addSeparator()
        measure = menu.addAction("&Measure device limits")
        measure.triggered.connect(docks["roofline"].show)
        measure.triggered.connect(docks["roofline"].raise_)
        measure.triggered.connect(self.limits.measure)

    def shutdown(self) -> bool:
        """Window closing: cancel the sweep and wait for every job; True when none is left."""
        stopped = self.sweeps.shutdown(SHUTDOWN_TIMEOUT_S)
        stopped &= self.limits.shutdown(SHUTDOWN_TIMEOUT_S)
        return self.calculator.shutdown(SHUTDOWN_TIMEOUT_S) and stopped
