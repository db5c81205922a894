"""The latency series: one point per generated token (or per beam step), with the rolling
tokens/s at it. A point is the TTFT for a sample's first token and the inter-token latency after
that, measured within its own stream (not from a sibling's token of the same step)."""

from __future__ import annotations

import math
from collections import deque

from engine.units import tokens_per_s
from live.ring_buffer import RingBuffer

# Rolling tokens/s over the last TPS_WINDOW_S seconds or the last TPS_MIN_TOKENS tokens,
# whichever reaches further back: a second follows a change of batch size quickly, and the token
# floor keeps slow generation (a few tokens a second) from reading as a comb of 1, 2, 3 tokens/s.
# The window never reaches back before the engine became busy, so an idle gap is not averaged in.
TPS_WINDOW_S = 1.0
TPS_MIN_TOKENS = 16
COLUMNS = ("t", "x", "latency_ms", "is_first", "request_id", "tokens_per_s")


class LatencySeries:
    def __init__(self, capacity: int) -> None:
        # One row per point: x is its global number; latency_ms the ITL, or the TTFT (is_first 1).
        self.ring = RingBuffer(capacity, COLUMNS)
        self._window_t: deque[float] = deque()  # point times of the last TPS_WINDOW_S
        self._last_tokens_t: deque[float] = deque(maxlen=TPS_MIN_TOKENS + 1)
        self._running: set[int] = set()
        self._busy_since: float | None = None  # arrival of the request that ended the last idle
        # Per request, the time of each sample's (or the beam search's) latest point.
        self._last_t: dict[int, dict[int, float]] = {}

    def started(self, request_id: int, t: float) -> None:
        if not self._running:
            self._busy_since = t
        self._running.add(request_id)

    def ended(self, request_id: int) -> None:
        self._running.discard(request_id)
        self._last_t.pop(request_id, None)

    def forget(self, request_id: int) -> None:
        self._last_t.pop(request_id, None)

    def point(self, request_id: int, branch: int, t: float, started_t: float) -> tuple[int, bool]:
        """Add the point of a token of sample `branch` at `t`: (its row, whether it is the first).
        A token stamped with its stream's previous time came in the same engine step (a
        speculative round's): it counts in tokens/s but makes no latency point of its own."""
        last_t = self._last_t.setdefault(request_id, {})
        previous_t = last_t.get(branch)
        if previous_t is not None and t == previous_t:
            self._rolling_rate(t)
            return self.ring.appended - 1, False
        is_first = previous_t is None
        latency_s = t - (started_t if previous_t is None else previous_t)
        last_t[branch] = t
        row = self.ring.append(
            t=t,
            x=self.ring.appended,
            latency_ms=latency_s * 1000.0,
            is_first=float(is_first),
            request_id=request_id,
            tokens_per_s=self._rolling_rate(t),
        )
        return row, is_first

    def set_ttft(self, row: int | None, ttft_s: float) -> bool:
        """Put the engine's own TTFT (from arrival) on a first point; False when it is gone."""
        if row is None or not self.ring.holds(row) or ttft_s <= 0:
            return False
        self.ring.set(row, "latency_ms", ttft_s * 1000.0)
        return True

    def _rolling_rate(self, t: float) -> float:
        window, recent = self._window_t, self._last_tokens_t
        window.append(t)
        recent.append(t)
        busy = self._busy_since if self._busy_since is not None else -math.inf
        edge = max(t - TPS_WINDOW_S, busy)
        while window and window[0] <= edge:
            window.popleft()  # window: the tokens in (edge, t]
        full = len(recent) == TPS_MIN_TOKENS + 1  # the deque's maxlen
        kth_back = recent[0] if full else -math.inf
        start = max(busy, min(t - TPS_WINDOW_S, kth_back))
        if math.isinf(start) or t <= start:
            return math.nan
        if not full or recent[0] <= start:
            count = sum(1 for x in recent if x > start)  # at most TPS_MIN_TOKENS + 1 to look at
        else:
            count = len(window)  # more tokens since `start` than `recent` holds: start == edge
        return tokens_per_s(count, t - start)
