"""Colours shared by the stylesheet (assets/style.qss) and the HTML the chat pane renders.

Qt's rich-text engine cannot read the stylesheet, so HTML gets its colours from here; keep the
two in step. The palette is dark because the plots (pyqtgraph) draw on dark backgrounds.
"""

from __future__ import annotations

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

from app.paths import asset_path

WINDOW = "#1d2026"
SURFACE = "#252931"
SURFACE_RAISED = "#2c313a"
BORDER = "#3a404b"
TEXT = "#dde1e8"
MUTED = "#8d95a3"
ACCENT = "#5aa9e6"
USER_BUBBLE = "#283a52"
ASSISTANT_BUBBLE = "#262a32"
CODE_BG = "#15181d"
CODE_TEXT = "#e6e1cf"
ERROR = "#ef6b73"
WARNING = "#e5c07b"
OK = "#98c379"

# Token colouring by probability of the drawn token: (lower bound, background). A confident
# token stays unmarked so only the surprising ones catch the eye.
PROBABILITY_SCALE = (
    (0.9, None),
    (0.6, "#3b4a2f"),
    (0.3, "#5a5128"),
    (0.1, "#6b3f22"),
    (0.0, "#7a2a31"),
)
SELECTED_TOKEN_BG = "#2f5f8f"


def probability_background(p: float) -> str | None:
    for bound, colour in PROBABILITY_SCALE:
        if p >= bound:
            return colour
    return PROBABILITY_SCALE[-1][1]


def apply_theme(app: QApplication) -> None:
    """Fusion style, a matching palette (for what the stylesheet does not reach) and the QSS."""
    app.setStyle("Fusion")
    pal = QPalette()
    roles = {
        QPalette.ColorRole.Window: WINDOW,
        QPalette.ColorRole.WindowText: TEXT,
        QPalette.ColorRole.Base: SURFACE,
        QPalette.ColorRole.AlternateBase: SURFACE_RAISED,
        QPalette.ColorRole.Text: TEXT,
        QPalette.ColorRole.Button: SURFACE_RAISED,
        QPalette.ColorRole.ButtonText: TEXT,
        QPalette.ColorRole.ToolTipBase: SURFACE_RAISED,
        QPalette.ColorRole.ToolTipText: TEXT,
        QPalette.ColorRole.Highlight: ACCENT,
        QPalette.ColorRole.HighlightedText: WINDOW,
        QPalette.ColorRole.Link: ACCENT,
        QPalette.ColorRole.PlaceholderText: MUTED,
    }
    for role, colour in roles.items():
        pal.setColor(role, QColor(colour))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.ButtonText, QColor(MUTED))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text, QColor(MUTED))
    app.setPalette(pal)
    qss = asset_path("style.qss")
    if qss.is_file():
        app.setStyleSheet(qss.read_text(encoding="utf-8"))
