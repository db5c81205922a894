"""The inside-the-model panels in the window's docks, and their controllers: the logit lens under
the token probabilities in their dock, the attention grid, expert routes, scoring a text and
steering tabbed beside them (each computed only while its panel is on screen)."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Qt
from PySide6.QtWidgets import QDockWidget, QMainWindow, QSplitter, QWidget

from app.engine_host import EngineHost
from app.inside.text_views import ScoreController, SteeringController
from app.inside.token_views import TokenViews
from widgets.attention_view import AttentionPanel
from widgets.expert_view import ExpertPanel
from widgets.kv_page_map import KVPageMapPanel
from widgets.lens_strip import LensStrip
from widgets.score_view import ScorePanel
from widgets.steering_view import SteeringPanel

LENS_PX = 150  # the strip's first height under the probabilities: its title, cells and candidates

AddDock = Callable[[str, str, QWidget, Qt.DockWidgetArea], QDockWidget]


class InsideViews(QObject):
    def __init__(
        self,
        window: QMainWindow,
        host: EngineHost,
        pinned: Callable[[], list[tuple[int | None, int] | None]],
        page_map: KVPageMapPanel,
        add_dock: AddDock,
        probabilities: QDockWidget,
    ) -> None:
        super().__init__(window)
        self.lens = LensStrip()
        self.attention = AttentionPanel()
        self.experts = ExpertPanel()
        self.score = ScorePanel()
        self.steering = SteeringPanel()
        right = Qt.DockWidgetArea.RightDockWidgetArea
        self.docks = {
            "attention": add_dock("attention", "Attention per head", self.attention, right),
            "experts": add_dock("experts", "Expert routes", self.experts, right),
            "score": add_dock("score_text", "Score a text", self.score, right),
            "steering": add_dock("steering", "Steering", self.steering, right),
        }
        # The lens strip under the probabilities, in their dock (a dock of its own split off a
        # tabbed dock would only become another tab); the others tabbed beside them.
        split = QSplitter(Qt.Orientation.Vertical)
        panel = probabilities.widget()
        if panel is not None:
            split.addWidget(panel)
        split.addWidget(self.lens)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 0)
        split.setSizes([600, LENS_PX])
        probabilities.setWidget(split)
        self.lens_split = split
        for key in ("attention", "experts", "score", "steering"):
            window.tabifyDockWidget(probabilities, self.docks[key])
        probabilities.raise_()
        self.tokens = TokenViews(
            host, pinned, self.lens, self.attention, self.experts, page_map, self.shown, self
        )
        self.scoring = ScoreController(host, self.score, self)
        self.steer = SteeringController(host, self.steering, lambda: self.tokens.token, window, self)
        for dock in (probabilities, *self.docks.values()):
            dock.visibilityChanged.connect(self._on_visibility)
        split.splitterMoved.connect(lambda _pos, _index: self.tokens.refresh())  # the lens opened

    def shown(self, name: str) -> bool:
        """Whether panel `name` is on screen (a tab behind another is not)."""
        if name == "lens":
            return self.lens.isVisible() and self.lens.height() > 0
        widget = self.docks[name].widget()
        return widget is not None and widget.isVisible()

    def _on_visibility(self, visible: bool) -> None:
        if visible:
            self.tokens.refresh()

    def on_token_inspected(self, request_id: int | None, index: int | None) -> None:
        before = self.tokens.token
        self.tokens.on_token_inspected(request_id, index)
        if self.tokens.token is not before:
            self.steer.token_changed()
