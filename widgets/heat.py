"""One colour ramp for the views of the model's inside (attention weights, a token's probability
per layer, expert load, surprise): dark background to a bright yellow through blue and magenta
(close to matplotlib's "magma", which reads in grey and for colour-blind viewers), as a 256-entry
lookup table for numpy-painted images and as QColors for painted cells."""

from __future__ import annotations

import numpy as np
from PySide6.QtGui import QColor

# (position, r, g, b): the ramp's anchors, interpolated linearly.
_ANCHORS = (
    (0.00, 21, 24, 29),  # theme.BACKGROUND: a weight of 0 is no mark at all
    (0.15, 40, 30, 90),
    (0.40, 120, 40, 130),
    (0.65, 210, 70, 100),
    (0.85, 250, 150, 60),
    (1.00, 252, 240, 150),
)


def _table() -> np.ndarray:
    xs = np.linspace(0.0, 1.0, 256)
    pos = np.array([a[0] for a in _ANCHORS])
    return np.stack(
        [np.interp(xs, pos, np.array([a[c] for a in _ANCHORS], dtype=float)) for c in (1, 2, 3)], axis=1
    ).astype(np.uint8)


LUT = _table()  # [256, 3] uint8


def heat_rgb(values: np.ndarray) -> np.ndarray:
    """values in [0, 1] (any shape) -> uint8 RGB (shape + (3,))."""
    index = np.clip(np.nan_to_num(values) * 255.0 + 0.5, 0, 255).astype(np.intp)
    return LUT[index]


def heat(value: float) -> QColor:
    r, g, b = (int(c) for c in heat_rgb(np.asarray(value)))
    return QColor(r, g, b)


def log_scale(p: float, floor: float = 1e-6) -> float:
    """A probability on a log ramp: `floor` -> 0, 1 -> 1 (a layer's 1e-4 and 0.3 both readable)."""
    if p <= floor:
        return 0.0
    return float(np.log10(p / floor) / -np.log10(floor))
