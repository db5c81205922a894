"""The one formatter per kind of figure (engine.units): what the CLI, the live state and the panels
print, and the rules that pick a unit."""

from __future__ import annotations

import pytest

from engine.units import GIB, KIB, MIB, byte_unit, duration, format_bytes, milliseconds, si


def test_format_bytes_takes_the_largest_unit_reached():
    assert [format_bytes(n) for n in (512, 2048, 3 * MIB, 5 * GIB)] == [
        "512 B",
        "2.0 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]
    # one decimal below 100 of the unit, none from there up
    assert format_bytes(538_060_032) == "513 MiB"
    assert format_bytes(99.94 * MIB) == "99.9 MiB"
    assert format_bytes(1.5 * GIB) == "1.5 GiB"
    assert format_bytes(0) == "0 B"
    assert format_bytes(-3 * KIB) == "-3.0 KiB"


def test_an_axis_unit_needs_two_of_it():
    assert byte_unit(1.5 * GIB) == ("MiB", MIB)  # 1536 MiB: round ticks, not 1.0 1.2 1.4 GiB
    assert byte_unit(2 * GIB) == ("GiB", GIB)
    assert byte_unit(3 * KIB) == ("KiB", KIB)
    assert byte_unit(1000) == ("B", 1)


def test_durations_and_latencies():
    assert [duration(s) for s in (2.5, 0.0123, 4.2e-5)] == ["2.5 s", "12.3 ms", "42 µs"]
    assert [milliseconds(s) for s in (0.0084, 0.123, 0.0999)] == ["8.4 ms", "123 ms", "99.9 ms"]


def test_si_prefixes():
    assert si(1.5e9, "B/s") == "1.5 GB/s"
    assert si(2.34e12, "FLOP/s") == "2.34 TFLOP/s"
    assert si(999, "B") == "999 B"
    assert si(1e15, "FLOP") == "1 PFLOP"


@pytest.mark.parametrize("value", [0, -1])
def test_utilisation_refuses_a_zero_time(value):
    from engine.units import mbu, mfu

    with pytest.raises(ValueError, match="step time"):
        mfu(1.0, value, 1.0)
    with pytest.raises(ValueError, match="step time"):
        mbu(1.0, value, 1.0)
