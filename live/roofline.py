"""Engine steps as roofline points, and the MFU/MBU of the recent ones (Qt-free).

A point is one StepStats as the engine counted it: its `cost` (the FLOPs and bytes of what the
step ran, computed by the engine from its sequences, its LM-head rows and its kernels' weights)
over its target forward time (`forward_s`, drafting excluded). Nothing here infers a step's
rows or shapes from its tokens: a step without an engine-computed cost is not placed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.events import StepStats
from engine.units import Utilisation, mbu, mfu

PHASES = ("prefill", "decode", "mixed")
# Points kept: a few minutes of chat; older steps only crowd the newest.
MAX_POINTS = 2000


@dataclass(frozen=True, slots=True)
class RooflinePoint:
    step: int
    phase: str  # "prefill", "decode" or "mixed" (prefill chunks and decodes in one forward)
    num_seqs: int
    query_tokens: int
    max_context: int
    logit_rows: int
    flops: float
    bytes: float
    forward_s: float
    kernel: str = ""
    breakdown: dict[str, int | float] = field(default_factory=dict, compare=False)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.forward_s

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.forward_s

    def describe(self) -> str:
        seqs = f"{self.num_seqs} sequence{'s' if self.num_seqs != 1 else ''}"
        rows = f"{self.logit_rows} LM-head row{'s' if self.logit_rows != 1 else ''}"
        kernel = f", {self.kernel} kernels" if self.kernel else ""
        return (
            f"step {self.step}: {self.phase}, {seqs}, {self.query_tokens} new tokens, "
            f"context up to {self.max_context}, {rows}{kernel}"
        )


def phase_of(stats: StepStats) -> str:
    if stats.prefill_tokens and stats.decode_tokens:
        return "mixed"
    return "prefill" if stats.prefill_tokens else "decode"


def point_from_step(stats: StepStats) -> RooflinePoint | None:
    """The step's point, or None for a step with nothing to place (no cost, no bytes or no time)."""
    cost = stats.cost
    if cost is None or not stats.seq_shapes or stats.forward_s <= 0 or cost.bytes_total <= 0:
        return None
    return RooflinePoint(
        step=stats.step,
        phase=phase_of(stats),
        num_seqs=len(stats.seq_shapes),
        query_tokens=sum(q for q, _ in stats.seq_shapes),
        max_context=max(c for _, c in stats.seq_shapes),
        logit_rows=stats.logit_rows,
        flops=float(cost.flops),
        bytes=float(cost.bytes_total),
        forward_s=stats.forward_s,
        kernel=stats.kernel,
        breakdown=dict(cost.breakdown),
    )


class RooflinePoints:
    """The points of the latest steps (LiveState folds every StepStats in, so none is missed)."""

    def __init__(self, capacity: int = MAX_POINTS) -> None:
        self.points: deque[RooflinePoint] = deque(maxlen=capacity)
        self.added = 0  # points ever added: a view redraws when this moved

    def clear(self) -> None:
        self.points.clear()
        self.added = 0

    def add(self, stats: StepStats) -> bool:
        """Place a step; False when it has nothing to place."""
        point = point_from_step(stats)
        if point is None:
            return False
        self.points.append(point)
        self.added += 1
        return True

    def of_phase(self, phase: str) -> list[RooflinePoint]:
        return [p for p in self.points if p.phase == phase]


@dataclass(frozen=True, slots=True)
class PhaseUtilisation:
    phase: str
    steps: int
    mfu: Utilisation
    mbu: Utilisation


def phase_utilisation(
    points: Iterable[RooflinePoint], phase: str, peak_flops: float, bandwidth: float, last_n: int
) -> PhaseUtilisation | None:
    """MFU and MBU of the last `last_n` steps of `phase`: their FLOPs and bytes summed over their
    summed forward time (a ratio of totals, so a long step weighs as much as its time)."""
    chosen = [p for p in points if p.phase == phase][-last_n:]
    if not chosen:
        return None
    flops = sum(p.flops for p in chosen)
    nbytes = sum(p.bytes for p in chosen)
    seconds = sum(p.forward_s for p in chosen)
    return PhaseUtilisation(
        phase, len(chosen), mfu(flops, seconds, peak_flops), mbu(nbytes, seconds, bandwidth)
    )
