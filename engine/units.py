"""How every figure is written, in the engine's CLI and how-strings, the live state and the panels.

One formatter per kind of quantity, so a byte count or a duration reads the same wherever it is
shown. Qt-free and torch-free: the views import it (the import contracts allow it), as the engine
does.

- Bytes are binary (KiB, MiB, GiB: what memory is sized in). A text figure takes the largest unit
  it reaches; an axis takes the unit its largest value is at least two of, so its ticks stay round.
- Rates and counts (FLOP/s, bytes per second of bandwidth, FLOPs) are decimal SI, 3 significant
  digits: they are compared with datasheets, which are decimal.
- A utilisation is a measured rate over a measured limit; `mfu` and `mbu` say how each was got.
- Tokens per second are counted once, here (`tokens_per_s`), for every figure that reports one.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
_BINARY = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
_SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


# ---- bytes -----------------------------------------------------------------------------------
def byte_unit(largest: float) -> tuple[str, int]:
    """The unit an axis of values up to `largest` bytes reads best in: (name, divisor). A unit is
    taken once the values reach two of it, so an axis never counts 1.0, 1.2, 1.4 of a unit."""
    for name, size in _BINARY:
        if largest >= 2 * size:
            return name, size
    return "B", 1


def format_bytes(value: float) -> str:
    """A byte count in the largest binary unit it reaches: '512 B', '45.0 KiB', '513 MiB', '15.0 GiB'
    (one decimal below 100 of the unit, none from 100 up)."""
    for name, size in _BINARY:
        if abs(value) >= size:
            scaled = value / size
            return f"{scaled:.0f} {name}" if abs(scaled) >= 100 else f"{scaled:.1f} {name}"
    return f"{value:.0f} B"


# ---- time ------------------------------------------------------------------------------------
def duration(seconds: float) -> str:
    """3 significant digits in s, ms or µs: duration(0.0123) -> '12.3 ms'."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def milliseconds(seconds: float) -> str:
    """A latency in ms, one decimal below 100 ms: '8.4 ms', '123 ms' (latencies are read in ms)."""
    ms = seconds * 1000.0
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


# ---- rates ----------------------------------------------------------------------------------
def tokens_per_s(tokens: float, seconds: float) -> float:
    """Tokens over the seconds they took; 0 when no time passed (one token, or none)."""
    return tokens / seconds if seconds > 0 else 0.0


# ---- SI rates and counts ---------------------------------------------------------------------
def si(value: float, unit: str) -> str:
    """3 significant digits with a decimal SI prefix: si(1.5e9, 'B/s') -> '1.5 GB/s'."""
    for scale, prefix in _SI_PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


# ---- utilisation against a measured limit -----------------------------------------------------
@dataclass(frozen=True, slots=True)
class Utilisation:
    value: float  # achieved / limit: 0.25 means a quarter of the measured limit
    achieved: float  # FLOP/s or bytes/s
    how: str  # the formula with this measurement's numbers, for a tooltip


def mfu(flops: float, seconds: float, peak_flops: float) -> Utilisation:
    """Model FLOPs utilisation: the step's counted FLOPs per second over the measured matmul peak."""
    return _utilisation(
        "MFU = FLOPs / time / peak", flops, "FLOP", seconds, peak_flops, "measured matmul peak"
    )


def mbu(nbytes: float, seconds: float, bandwidth: float) -> Utilisation:
    """Memory bandwidth utilisation: the step's bytes moved per second over the measured bandwidth."""
    return _utilisation(
        "MBU = bytes / time / bandwidth", nbytes, "B", seconds, bandwidth, "measured copy bandwidth"
    )


def _utilisation(
    formula: str, amount: float, unit: str, seconds: float, limit: float, source: str
) -> Utilisation:
    """amount / seconds / limit, with the formula written out in this measurement's numbers."""
    _check_positive(seconds, "the step time")
    _check_positive(limit, "the peak FLOP/s" if unit == "FLOP" else "the memory bandwidth")
    achieved = amount / seconds
    value = achieved / limit
    rate = f"{unit}/s"
    how = (
        f"{formula} = {si(amount, unit)} / {duration(seconds)} / {si(limit, rate)} ({source}) = "
        f"{si(achieved, rate)} / {si(limit, rate)} = {value:.1%}"
    )
    return Utilisation(value, achieved, how)


def _check_positive(value: float, what: str) -> None:
    if not value > 0:
        raise ValueError(f"{what} must be positive, got {value}")
