"""Byte and time formatting with binary units, and one unit per axis so ticks stay round."""

from __future__ import annotations

_BINARY = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit an axis of values up to `largest` bytes reads best in: (name, divisor)."""
    for name, size in _BINARY:
        if largest >= 2 * size:
            return name, size
    return "B", 1


def format_bytes(value: float) -> str:
    name, size = byte_unit(abs(value))
    if size == 1:
        return f"{value:.0f} B"
    scaled = value / size
    return f"{scaled:.0f} {name}" if scaled >= 100 else f"{scaled:.1f} {name}"


def format_ms(seconds: float) -> str:
    ms = seconds * 1000.0
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"
