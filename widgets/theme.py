"""Colours and fonts shared by the panels: a dark instrument look that reads on any app theme.

The panels paint their own backgrounds (plots and page map alike), so they look the same under a
light or dark application style, and colours that carry meaning (free, cached, a sequence) are
the same in every panel.
"""

from __future__ import annotations

import colorsys

from PySide6.QtGui import QFont, QFontDatabase

BACKGROUND = "#15171c"
PANEL_TEXT = "#d7dae0"
MUTED_TEXT = "#8b919c"
GRID = "#2b2f37"
ACCENT = "#f0b429"  # the drawn token, cut lines, TTFT markers: things the eye should find
WHAT_IF = "#e8833a"

# Series colours, chosen to stay distinct for colour-blind viewers on a dark background.
SERIES = {
    "weights": "#5b9bd5",
    "kv_pool": "#9b7ede",
    "kv_used": "#5fd38d",
    "process": "#f0b429",
    "reserved": "#e8833a",
    "itl": "#5b9bd5",
    "ttft": ACCENT,
    "tokens_per_s": "#5fd38d",
    "raw": "#6b7280",
    "stage": "#5b9bd5",
}

# Page-map cell colours.
BLOCK_FREE = (38, 42, 49)
BLOCK_CACHED_FREE = (92, 74, 140)  # prefix-cached but unreferenced: reusable, not in use
BLOCK_OUTLINE_SHARED = (245, 245, 245)
BLOCK_GAP = (21, 23, 28)

_GOLDEN = 0.618033988749895


def seq_rgb(seq_id: int) -> tuple[int, int, int]:
    """A stable colour per sequence id: golden-ratio hue steps keep consecutive ids far apart."""
    hue = (0.58 + seq_id * _GOLDEN) % 1.0
    r, g, b = colorsys.hsv_to_rgb(hue, 0.62, 0.95)
    return round(r * 255), round(g * 255), round(b * 255)


def mono_font(point_size: float = 9.0) -> QFont:
    font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    font.setPointSizeF(point_size)
    return font
