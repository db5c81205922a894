"""Paces the render timer so the GUI thread's share of the CPU stays within a budget.

The engine thread and the GUI thread share one Python process: while the GUI runs Python
(panel refreshes, pyqtgraph painting) it holds the GIL, and the engine, which takes the GIL back
after every torch op, waits. How much a frame costs depends on the machine and on which panels
are open, so a fixed frame rate is either wasteful on a slow machine (the measured cost of a
full frame on 2 cores starved generation to ~55% of its headless speed) or needlessly choppy on
a fast one. The pacer measures what the GUI thread actually spent (its own CPU time, which
includes the paints that follow a refresh) against the wall time, and stretches the render
interval while the share is over budget and shrinks it back while under half the budget.

Only while the engine generates: idle, the GUI takes the fastest rate (nothing competes). The rate
it settled at while generating is kept through idle time and taken up again by the next reply:
what a frame costs depends on the machine and the open panels, not on the reply, and a reply
of a few hundred tokens is over before the pacer could find it again from the fastest rate
(measured on the packaged model, 2 cores: a 128-token reply took 0.7 s, the interval had
climbed from 33 to 197 ms by its end, and the GUI spent 15-20% of a core throughout).
Idle frames do not count towards the share: they would make generating look cheap. Until a reply's
first token is on screen the frames stay at the fastest rate, so that a reply is seen to start as
soon as it does (its first frames have little to draw).
"""

from __future__ import annotations

import time

# The fastest rate: ~30 Hz, faster than the eye needs for streaming text and moving bars.
MIN_INTERVAL_MS = 33
# The slowest rate while generating: 2.5 Hz still reads as live text and moving bars.
MAX_INTERVAL_MS = 400
# The GUI thread's CPU time as a share of wall time, while the engine generates. The engine
# needs ~90% of its headless speed (the target); on the 2-core machine this was tuned
# on, a GUI taking ~12% of a core left it 0.84-0.96 of headless (tools.measure_app, five runs).
CPU_BUDGET = 0.10
# Smoothing of the measured share: ~10 frames, so one slow frame does not swing the rate.
SMOOTHING = 0.1
# Interval change per frame when over budget / well under it.
GROW, SHRINK = 1.25, 0.9


class FramePacer:
    def __init__(self, clock=time.perf_counter, cpu_clock=time.thread_time) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self.interval_ms = float(MIN_INTERVAL_MS)  # the interval now
        self.generating_interval_ms = float(MIN_INTERVAL_MS)  # the one generating settled at
        self.cpu_share = 0.0  # smoothed GUI-thread CPU / wall time over recent generating frames
        self._last_wall: float | None = None
        self._last_cpu = 0.0
        self._was_busy = False

    def next_interval_ms(self, busy: bool, first_token_due: bool = False) -> int:
        """Call once per frame, on the GUI thread, after the frame's work: the interval until
        the next frame. `busy`: the engine is generating; `first_token_due`: a reply in flight
        has shown no token yet."""
        wall, cpu = self._clock(), self._cpu_clock()
        if busy and self._was_busy and self._last_wall is not None and wall > self._last_wall:
            share = (cpu - self._last_cpu) / (wall - self._last_wall)
            self.cpu_share += SMOOTHING * (share - self.cpu_share)
        self._last_wall, self._last_cpu, self._was_busy = wall, cpu, busy
        if busy:
            if self.cpu_share > CPU_BUDGET:
                self.generating_interval_ms = min(MAX_INTERVAL_MS, self.generating_interval_ms * GROW)
            elif self.cpu_share < CPU_BUDGET / 2:
                self.generating_interval_ms = max(MIN_INTERVAL_MS, self.generating_interval_ms * SHRINK)
        fast = not busy or first_token_due
        self.interval_ms = float(MIN_INTERVAL_MS) if fast else self.generating_interval_ms
        return round(self.interval_ms)
