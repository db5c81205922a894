"""Redraw coalescing for panels whose drawing costs more than a render frame should spend.

The render timer calls every panel ~30 times a second, and the engine thread shares the GIL
with the GUI: a panel that redraws on every dirty frame takes time away from generation. A
throttle lets a panel redraw at most once per interval; a request is never dropped, only
carried to the next frame that is due (the timer keeps calling `refresh` even when idle).
"""

from __future__ import annotations

import math
import time


class RedrawThrottle:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._pending = False
        self._last = -math.inf

    def request(self) -> None:
        self._pending = True

    @property
    def pending(self) -> bool:
        return self._pending

    def due(self, now: float | None = None) -> bool:
        """True (and the request consumed) when a redraw is pending and the interval has passed."""
        now = time.perf_counter() if now is None else now
        if self._pending and now - self._last >= self.interval_s:
            self._pending, self._last = False, now
            return True
        return False

    def drawn(self, now: float | None = None) -> None:
        """Record a redraw made outside `due` (a forced flush): nothing is pending any more."""
        self._pending = False
        self._last = time.perf_counter() if now is None else now
