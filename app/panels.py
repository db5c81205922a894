"""The live inspection panels (from widgets/), built over one LiveState.

Each panel only reads the state and redraws in `refresh(dirty)`; none talks to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.store import LiveState


@dataclass(slots=True)
class Panels:
    probabilities: object  # widgets ProbabilityPanel
    page_map: object  # widgets KVPageMapPanel
    memory: object  # widgets MemoryPanel
    latency: object  # widgets LatencyPanel
    quality: object  # widgets QualityPanel
    roofline: object  # widgets RooflinePanel
    step_timeline: object  # widgets StepTimelinePanel
    speculation: object  # widgets SpeculationPanel

    def all(self) -> tuple:
        return (
            self.probabilities,
            self.page_map,
            self.memory,
            self.latency,
            self.quality,
            self.roofline,
            self.step_timeline,
            self.speculation,
        )

    def refresh(self, dirty: set[str]) -> None:
        for panel in self.all():
            panel.refresh(dirty)


def build_panels(live: LiveState) -> Panels:
    from app.quality_jobs import QUALITY_SOURCES
    from widgets.kv_page_map import KVPageMapPanel
    from widgets.latency_panel import LatencyPanel
    from widgets.memory_panel import MemoryPanel
    from widgets.probability_panel import ProbabilityPanel
    from widgets.quality_panel import QualityPanel
    from widgets.roofline_panel import RooflinePanel
    from widgets.speculation_panel import SpeculationPanel
    from widgets.step_timeline import StepTimelinePanel

    return Panels(
        ProbabilityPanel(live),
        KVPageMapPanel(live),
        MemoryPanel(live),
        LatencyPanel(live),
        QualityPanel(live, QUALITY_SOURCES),
        RooflinePanel(live),
        StepTimelinePanel(live),
        SpeculationPanel(live),
    )
