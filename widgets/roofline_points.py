"""Engine steps as roofline points, and the live MFU/MBU of the recent ones (no Qt here).

A point is one StepStats seen through `engine.measure.roofline.step_cost`: the FLOPs and bytes its
scheduled sequences imply for the loaded model's shapes, over the forward time the engine
measured. Its x is the arithmetic intensity (FLOP/byte), its y the FLOP/s it achieved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.events import ModelInfo, StepStats
from engine.measure.device_limits import DeviceLimits
from engine.measure.roofline import Utilisation, mbu, mfu, step_cost
from engine.model.shapes import ModelShapes

PHASES = ("prefill", "decode", "mixed")


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What the FLOP/byte counts need to know about the loaded model."""

    shapes: ModelShapes
    # Bytes per parameter as loaded (weights incl. buffers / parameters): the dtype's size for a
    # plain model, the packed average for a quantized one.
    weight_bytes_per_param: float

    @staticmethod
    def of(shapes: ModelShapes, info: ModelInfo) -> ModelCosts:
        return ModelCosts(shapes, info.weight_bytes / info.params)

    def kv_bytes_per_element(self, stats: StepStats) -> float:
        """Bytes per stored K/V element, from the pool's own block size (int8 caches include
        their scales, so this can be fractional)."""
        elements_per_block = stats.kv.block_size * self.shapes.kv_elements_per_token
        return stats.kv.bytes_per_block / elements_per_block


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
        return (
            f"step {self.step}: {self.phase}, {seqs}, {self.query_tokens} new tokens, "
            f"context up to {self.max_context}"
        )


def phase_of(stats: StepStats) -> str:
    if stats.prefill_tokens and stats.decode_tokens:
        return "mixed"
    return "prefill" if stats.prefill_tokens else "decode"


def point_from_step(costs: ModelCosts, stats: StepStats, logit_rows: int) -> RooflinePoint | None:
    """The step's point, or None for a step with nothing to place (no shapes or no time)."""
    if not stats.seq_shapes or stats.forward_s <= 0:
        return None
    cost = step_cost(
        costs.shapes,
        stats.seq_shapes,
        costs.weight_bytes_per_param,
        costs.kv_bytes_per_element(stats),
        logit_rows,
    )
    return RooflinePoint(
        step=stats.step,
        phase=phase_of(stats),
        num_seqs=len(stats.seq_shapes),
        query_tokens=sum(q for q, _ in stats.seq_shapes),
        max_context=max(c for _, c in stats.seq_shapes),
        logit_rows=logit_rows,
        flops=cost.flops,
        bytes=cost.bytes_total,
        forward_s=stats.forward_s,
    )


@dataclass(frozen=True, slots=True)
class PhaseUtilisation:
    phase: str
    steps: int
    mfu: Utilisation
    mbu: Utilisation


def phase_utilisation(
    points: Iterable[RooflinePoint], phase: str, limits: DeviceLimits, last_n: int
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
        phase, len(chosen), mfu(flops, seconds, limits.peak_flops), mbu(nbytes, seconds, limits.bandwidth)
    )
