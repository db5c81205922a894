"""The one theme: colours and fonts of the app's chrome and of the panels' instrument look.

The chrome (window, docks, buttons) is styled by assets/style.qss and the palette `apply_theme`
sets; Qt's rich-text engine cannot read the stylesheet, so the HTML the chat and the panels
render takes its colours from here: keep the stylesheet in step. The palette is dark because the
panels are: they paint their own backgrounds (plots and page map alike), so they look the same
under any application style, and colours that carry meaning (free, cached, a sequence, the
drawn token) are the same in every panel.

Two colours draw the eye, for two different things: ACCENT is the interface's (focus, hover,
selection, links, progress), MARK is the data's (the drawn token, cut lines, TTFT markers).
"""

from __future__ import annotations

import colorsys
from pathlib import Path

from PySide6.QtGui import QColor, QFont, QFontDatabase, QPalette
from PySide6.QtWidgets import QApplication

# ---- chrome ----------------------------------------------------------------------------------
WINDOW = "#1d2026"
SURFACE = "#252931"
SURFACE_RAISED = "#2c313a"
BORDER = "#3a404b"
TEXT = "#dde1e8"
MUTED = "#8d95a3"
ACCENT = "#5aa9e6"
USER_BUBBLE = "#283a52"
ASSISTANT_BUBBLE = "#262a32"
ERROR = "#ef6b73"
WARNING = "#e5c07b"
OK = "#98c379"

# ---- panels and code -------------------------------------------------------------------------
BACKGROUND = "#15181d"  # the panels' own background, the window's separators, code blocks
GRID = "#2b2f37"
MARK = "#f0b429"  # the drawn token, cut lines, TTFT markers: things in the data the eye should find
WHAT_IF = "#e8833a"  # a what-if's banner, a figure that does not fit, an input error
CODE_BG = BACKGROUND
CODE_TEXT = "#e6e1cf"

# Series colours, chosen to stay distinct for colour-blind viewers on a dark background.
SERIES = {
    "weights": "#5b9bd5",
    "kv_pool": "#9b7ede",
    "kv_used": "#5fd38d",
    "process": "#f0b429",
    "reserved": "#e8833a",
    "draft_weights": "#4fc4cf",  # a speculative draft model's own weights
    "draft_cache": "#4fc4cf",  # and its KV cache (dashed)
    "itl": "#5b9bd5",
    "ttft": MARK,
    "tokens_per_s": "#5fd38d",
    "raw": "#6b7280",
    "stage": "#5b9bd5",
}

# Page-map cell colours.
BLOCK_FREE = (38, 42, 49)
BLOCK_CACHED_FREE = (92, 74, 140)  # prefix-cached but unreferenced: reusable, not in use
BLOCK_OUTLINE_SHARED = (245, 245, 245)
BLOCK_GAP = (int(BACKGROUND[1:3], 16), int(BACKGROUND[3:5], 16), int(BACKGROUND[5:7], 16))

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

_GOLDEN = 0.618033988749895


def probability_background(p: float) -> str | None:
    for bound, colour in PROBABILITY_SCALE:
        if p >= bound:
            return colour
    return PROBABILITY_SCALE[-1][1]


def seq_rgb(seq_id: int) -> tuple[int, int, int]:
    """A stable colour per sequence id: golden-ratio hue steps keep consecutive ids far apart."""
    hue = (0.58 + seq_id * _GOLDEN) % 1.0
    r, g, b = colorsys.hsv_to_rgb(hue, 0.62, 0.95)
    return round(r * 255), round(g * 255), round(b * 255)


def mono_font(point_size: float = 9.0) -> QFont:
    font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    font.setPointSizeF(point_size)
    return font


def apply_theme(app: QApplication, stylesheet: Path | None = None) -> None:
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
    if stylesheet is not None and stylesheet.is_file():
        app.setStyleSheet(stylesheet.read_text(encoding="utf-8"))
