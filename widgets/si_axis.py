"""A log-scale axis labelled in SI units (10 G, 100 G, 1 T FLOP/s), for values spanning decades.

pyqtgraph's own log axis writes powers of ten; a roofline's axes cover 0.1 to 1000 FLOP/byte
and 1e8 to 1e12 FLOP/s, which read best as plain SI values.
"""

from __future__ import annotations

import math

import pyqtgraph as pg

from engine.units import si


class SILogAxis(pg.AxisItem):
    def __init__(self, orientation: str, unit: str = "") -> None:
        super().__init__(orientation)
        self.unit = unit
        self.enableAutoSIPrefix(False)  # the labels carry their own prefixes

    def logTickStrings(self, values, scale, spacing):  # noqa: N802 - pyqtgraph override
        """Label the decades and their 2x and 5x ticks; leave the other minor ticks unlabelled."""
        labels = []
        for v in values:
            value = 10.0**v * scale
            if not math.isfinite(value) or value <= 0:
                labels.append("")
                continue
            leading = round(value / 10.0 ** math.floor(math.log10(value)))
            labels.append(si(value, self.unit).strip() if leading in (1, 2, 5) else "")
        return labels
