"""What the engine's measuring queries answer, as plain data the app reads on its own thread:
the device and the memory left on it, the device's measured limits, a speedup measured, a
quantized model's distance from its full-precision reference, and a text's tokens. Torch-free (engine.api hands these to the GUI).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from engine.events import RequestStats
from engine.units import tokens_per_s


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """The device a loaded model runs on, now."""

    device: str  # "cpu", "cuda:0"
    name: str  # the CPU model and threads, or the GPU's name
    available_bytes: int  # memory still available beside what is loaded


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    device: str  # "cpu", "cuda:0"
    device_name: str  # CPU model and threads, or the GPU's name
    dtype: str
    peak_flops: float  # best FLOP/s of the measured matmuls in `dtype`
    matmul_size: int  # n of the n x n matmul that reached it
    bandwidth: float  # bytes/s of a device-to-device copy (read + write)
    threads: int  # torch's intra-op threads while measuring: a CPU's peak scales with them
    measured_at: str  # ISO 8601, UTC
    measure_seconds: float

    @property
    def ridge(self) -> float:
        """FLOP per byte at which the compute roof meets the bandwidth slope."""
        return self.peak_flops / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ridge_flops_per_byte": self.ridge}


@dataclass(frozen=True, slots=True)
class SpeedRun:
    """One timed run of a request to its end."""

    tokens: int
    seconds: float
    stats: RequestStats  # of the run

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.tokens, self.seconds)


@dataclass(frozen=True, slots=True)
class SpeedupResult:
    """The same request with and without speculative decoding, one after the other."""

    proposer: str
    speculative: SpeedRun
    plain: SpeedRun

    @property
    def speedup(self) -> float:
        return self.speculative.tokens_per_s / self.plain.tokens_per_s if self.plain.tokens_per_s else 0.0


@dataclass(frozen=True, slots=True)
class SpeedFigures:
    """A model's greedy speed through the engine: decode and prefill tokens/s, over how many."""

    decode_tok_s: float
    prefill_tok_s: float
    new_tokens: int


@dataclass(frozen=True, slots=True)
class QualityReport:
    """Per predicted position i (the token after position i of the input): i = 0 .. n-1."""

    kl: tuple[float, ...]  # KL(reference || quantized), nats
    top1_agree: tuple[bool, ...]
    reference_nll: tuple[float, ...]  # -log p_ref(actual next token)
    quantized_nll: tuple[float, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.kl)

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / len(self.kl)

    @property
    def max_kl(self) -> float:
        return max(self.kl)

    @property
    def top1_agreement(self) -> float:
        return sum(self.top1_agree) / len(self.top1_agree)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(sum(self.reference_nll) / len(self.reference_nll))

    @property
    def quantized_perplexity(self) -> float:
        return math.exp(sum(self.quantized_nll) / len(self.quantized_nll))


@dataclass(frozen=True, slots=True)
class Tokens:
    """What a text (or a token id) is in the model's tokens: their ids and each one's own text."""

    ids: tuple[int, ...]
    texts: tuple[str, ...]
